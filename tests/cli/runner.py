"""The one way tests run ``flashnext``: the console command in a fresh interpreter, as a user
runs it, or (where a test walks hundreds of argument lists) ``main`` in this process.

- :func:`run` -> ``subprocess.CompletedProcess`` (exit status, stdout, stderr as a user sees them);
  ``unprivileged=True`` makes file permissions apply when the tests run as root.
- :func:`run_here` -> the same from ``main`` in this process (no interpreter start, no imports:
  ~0.5-1.5 s less a command), for tests that only read the status and the streams; it runs
  :func:`run` where a process is what is tested (permissions as root, ``preexec``, a thread).
- :func:`run_ok`, :func:`run_ok_here` -> the same, raising with both streams when the exit
  status is not 0.
- :func:`popen` -> a running command (interrupt and kill tests).
- :func:`run_in_process` -> ``(exit status, stdout, stderr)`` of ``main(argv)`` under capsys.
- :func:`assert_one_line_error` -> the one ``error:`` line a refused command prints.
"""

from __future__ import annotations

import ctypes
import io
import os
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest

#: The console command: ``python -m flashnext`` in the interpreter running the tests.
FLASHNEXT = [sys.executable, "-m", "flashnext"]
#: Environment every run adds: one BLAS thread (2-core CI), wide lines (no rich wrapping).
BASE_ENV = {"OPENBLAS_NUM_THREADS": "1", "COLUMNS": "200"}


def drop_file_permission_override() -> None:
    """preexec_fn: drop CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH from the bounding set, so
    that root obeys file modes (root bypasses them otherwise)."""
    libc = ctypes.CDLL(None, use_errno=True)
    pr_capbset_drop, cap_dac_override, cap_dac_read_search = 24, 1, 2
    for cap in (cap_dac_override, cap_dac_read_search):
        if libc.prctl(pr_capbset_drop, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def _preexec(
    unprivileged: bool, preexec: Callable[[], None] | None
) -> Callable[[], None] | None:
    drop = unprivileged and os.geteuid() == 0
    if not drop:
        return preexec

    def both() -> None:
        drop_file_permission_override()
        if preexec is not None:
            preexec()

    return both


def _popen_kwargs(
    env: Mapping[str, str] | None,
    unprivileged: bool,
    preexec: Callable[[], None] | None,
    cwd: str | os.PathLike[str] | None,
) -> dict[str, Any]:
    return {
        "env": {**os.environ, **BASE_ENV, **(env or {})},
        "preexec_fn": _preexec(unprivileged, preexec),
        "cwd": cwd,
        "text": True,
    }


def run(
    *args: object,
    env: Mapping[str, str] | None = None,
    timeout: float = 300,
    unprivileged: bool = False,
    preexec: Callable[[], None] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    input: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``flashnext ARGS`` in a subprocess; ``env`` is added to this process's environment."""
    return subprocess.run(
        [*FLASHNEXT, *map(str, args)],
        capture_output=True,
        timeout=timeout,
        input=input,
        **_popen_kwargs(env, unprivileged, preexec, cwd),
    )


def run_here(
    *args: object,
    env: Mapping[str, str] | None = None,
    timeout: float = 300,
    unprivileged: bool = False,
    preexec: Callable[[], None] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    input: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """:func:`run`'s result from ``main`` in this process, with ``env`` (over :data:`BASE_ENV`),
    ``cwd`` and ``input`` in place while it runs; an exception escaping ``main`` becomes its
    traceback on stderr and exit status 1, as in a process. ``timeout`` is not enforced."""
    if (unprivileged and os.geteuid() == 0) or preexec or threading.current_thread() is not (
        threading.main_thread()
    ):  # the streams and the environment are the process's: one command at a time
        return run(*args, env=env, timeout=timeout, unprivileged=unprivileged, preexec=preexec,
                   cwd=cwd, input=input)  # fmt: skip
    import flashnext
    from flashnext.cli import main

    argv = [str(a) for a in args]
    out, err = io.StringIO(), io.StringIO()
    saved_env, saved_cwd, saved_argv = dict(os.environ), os.getcwd(), sys.argv
    saved_streams = sys.stdin, sys.stdout, sys.stderr
    sys.argv = [str(Path(flashnext.__file__).with_name("__main__.py")), *argv]  # as `-m` has it
    os.environ.update({**BASE_ENV, **(env or {})})
    # rich fixes a console's width when it is made with COLUMNS set: make it the call's, as a
    # process started with this environment would have it
    from flashnext.cli import _common

    consoles = [(c, c._width, c._height) for c in (_common.out_console, _common.err_console)]
    for console, _, _ in consoles:
        console.size = (int(os.environ["COLUMNS"]), 25)
    code = 0
    try:
        if cwd is not None:
            os.chdir(cwd)
        sys.stdin, sys.stdout, sys.stderr = io.StringIO(input or ""), out, err
        main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if isinstance(exc.code, str):
            err.write(exc.code + "\n")
    except Exception:
        traceback.print_exc(file=err)
        code = 1
    finally:
        for console, width, height in consoles:
            console._width, console._height = width, height
        sys.stdin, sys.stdout, sys.stderr = saved_streams
        sys.argv = saved_argv
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
    return subprocess.CompletedProcess(["flashnext", *argv], code, out.getvalue(), err.getvalue())


def run_ok(*args: object, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """:func:`run`, raising AssertionError with both streams unless the exit status is 0."""
    return _ok(run(*args, **kwargs), args)


def run_ok_here(*args: object, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """:func:`run_here`, raising as :func:`run_ok` does."""
    return _ok(run_here(*args, **kwargs), args)


def _ok(
    proc: subprocess.CompletedProcess[str], args: tuple[object, ...]
) -> subprocess.CompletedProcess[str]:
    if proc.returncode != 0:
        raise AssertionError(
            f"flashnext {' '.join(map(str, args))}: exit {proc.returncode}\n"
            f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
        )
    return proc


def popen(
    *args: object,
    env: Mapping[str, str] | None = None,
    unprivileged: bool = False,
    preexec: Callable[[], None] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    **kwargs: Any,
) -> subprocess.Popen[str]:
    """Start ``flashnext ARGS`` (stdout and stderr piped unless ``kwargs`` say otherwise)."""
    kwargs.setdefault("stdout", subprocess.PIPE)
    kwargs.setdefault("stderr", subprocess.PIPE)
    return subprocess.Popen(
        [*FLASHNEXT, *map(str, args)], **{**_popen_kwargs(env, unprivileged, preexec, cwd), **kwargs}
    )


def run_in_process(
    argv: list[str] | list[object], capsys: pytest.CaptureFixture[str]
) -> tuple[int, str, str]:
    """``flashnext ARGV`` in this process: (exit status, stdout, stderr). An exception that
    escapes ``main`` (a traceback a user would see) propagates and fails the test."""
    from flashnext.cli import main

    capsys.readouterr()  # drop what fixtures printed
    code = 0
    try:
        main([str(a) for a in argv])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    out = capsys.readouterr()
    return code, out.out, out.err


def assert_one_line_error(
    proc: subprocess.CompletedProcess[str], *fragments: str | Path, code: int = 1
) -> str:
    """Non-zero exit, no traceback, exactly one stderr line ``error: ...`` holding ``fragments``.

    Exit 2 is a bad argument caught by click's own checks, whose usage text above the error
    line is the CLI's business (``flashnext.cli.main``); its last line must say it all.
    Returns that line.
    """
    err = proc.stderr
    assert "Traceback" not in err, err[-3000:]
    assert proc.returncode == code, (proc.returncode, err[-3000:])
    lines = [line for line in err.splitlines() if line.strip()]
    if code != 2:
        assert len(lines) == 1 and lines[0].startswith("error: "), err[-3000:]
    for fragment in fragments:
        assert str(fragment) in lines[-1], (fragment, lines[-1])
    return lines[-1]

"""Bad input to ``flashnext validate`` (and ``compare``): one line, non-zero exit, no traceback.

Each case runs the real CLI in a subprocess, as a user would. The ``--out`` cases point at a
port where nothing listens: the check must fire before the run (no progress line, no wait).
Permission cases need permissions to apply (root bypasses them): when the tests run as root,
that subprocess drops CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH (the shared runner's ``unprivileged``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from devtools.vllm_cpu import free_port

from ..cli.runner import run_here as run


@pytest.fixture
def shared_tmp(tmp_path: Path) -> Iterator[Path]:
    """``tmp_path``, with what the cases locked unlocked again so that pytest can remove it."""
    try:
        yield tmp_path
    finally:
        for p in tmp_path.rglob("*"):
            if p.is_dir():
                p.chmod(0o755)


def _dir_with_report_json_dir(tmp: Path) -> Path:
    (tmp / "out" / "report.json").mkdir(parents=True)
    return tmp / "out"


def _out_under_locked_parent(tmp: Path) -> Path:
    (tmp / "locked").mkdir(mode=0o000)
    (tmp / "locked").chmod(0o000)
    return tmp / "locked" / "out"


def _out_is_a_file(tmp: Path) -> Path:
    (tmp / "file").write_text("x")
    return tmp / "file"


def _out_under_a_file(tmp: Path) -> Path:
    (tmp / "file").write_text("x")
    return tmp / "file" / "out"


def _readonly_out(tmp: Path) -> Path:
    (tmp / "ro").mkdir(mode=0o555)
    (tmp / "ro").chmod(0o555)
    return tmp / "ro"


URL_CASES = [
    (
        "http://[::1",
        "error: --url 'http://[::1': not a valid URL (Invalid IPv6 URL); "
        "expected the server root, e.g. http://127.0.0.1:8000",
    ),
    (
        "http://127.0.0.1:99999",
        "error: --url 'http://127.0.0.1:99999': not a valid URL "
        "(Port out of range 0-65535); expected the server root, "
        "e.g. http://127.0.0.1:8000",
    ),
    (
        "http://127.0.0.1:8x",
        "error: --url 'http://127.0.0.1:8x': not a valid URL (Port could "
        "not be cast to integer value as '8x'); expected the server root, "
        "e.g. http://127.0.0.1:8000",
    ),
    (
        "http://127.0.0.1:0",
        "error: --url 'http://127.0.0.1:0': port 0 is not a server port (1-65535)",
    ),
    (
        "http://127.0.0.1:8000/v1/responses/x",
        "error: --url 'http://127.0.0.1:8000/v1/responses/x':"
        " /v1/responses/x is not a route the validator knows; expected the server root, "
        "e.g. http://127.0.0.1:8000",
    ),
    (
        "http://127.0.0.1:8000/?a=1",
        "error: --url 'http://127.0.0.1:8000/?a=1': has a query or "
        "fragment; expected the server root, e.g. http://127.0.0.1:8000",
    ),
    (
        "http://bob:hunter2@[::1",
        "error: --url 'http://<redacted>@[::1': not a valid URL "
        "(Invalid IPv6 URL); expected the server root, e.g. "
        "http://127.0.0.1:8000",
    ),
]


@pytest.mark.parametrize(("url", "expected"), URL_CASES, ids=[c[0] for c in URL_CASES])
def test_bad_url_is_one_line(url: str, expected: str, tmp_path: Path) -> None:
    p = run(*["validate", "--url", url, "--out", str(tmp_path / "out")])
    assert p.returncode == 2, p.stderr  # a flag's value: a usage error (README's exit codes)
    line = p.stderr.strip()  # one line, no traceback, no secret
    assert line == f"{expected} (see `flashnext validate --help`)", line
    assert not (tmp_path / "out").exists()


OUT_CASES = [
    # (id, make, unprivileged, exit status, the one stderr line). The --out type rejects a path
    # it cannot create or write at parse time (a usage error, exit 2); a report.json that is a
    # directory is found by the validator's own check before the first stage (exit 1).
    (
        "report.json is a directory",
        _dir_with_report_json_dir,
        False,
        1,
        "error: --out {out}: report.json there is a directory; remove it or choose another --out",
    ),
    # The parent cannot even be searched: the OS says so when the directory is made (exit 1).
    ("unreadable parent", _out_under_locked_parent, True, 1, "error: {out}: Permission denied"),
    ("read-only directory", _readonly_out, True, 2, "error: Invalid value for '--out': "),
    (
        "a file",
        _out_is_a_file,
        False,
        2,
        "error: Invalid value for '--out': Directory '{out}' is a file",
    ),
    ("under a file", _out_under_a_file, False, 2, "error: Invalid value for '--out': "),
]


@pytest.mark.parametrize(
    ("make", "unprivileged", "code", "expected"),
    [c[1:] for c in OUT_CASES],
    ids=[c[0] for c in OUT_CASES],
)
def test_bad_out_is_found_before_the_run(
    make: Callable[[Path], Path], unprivileged: bool, code: int, expected: str, shared_tmp: Path
) -> None:
    out = make(shared_tmp)
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens: a run would wait and fail
    p = run("validate", "--url", url, "--ready-timeout", "30", "--out", out, unprivileged=unprivileged)
    assert p.returncode == code, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(expected.format(out=out)), p.stderr


def test_compare_bad_inputs_are_one_line(tmp_path: Path) -> None:
    v99 = tmp_path / "v99.json"
    v99.write_text(json.dumps({"schema_version": 99}))
    cases = [
        (
            [str(tmp_path), str(tmp_path)],
            f"error: {tmp_path}: a directory, not a regular file (a FIFO, device, socket or "
            "directory is never read); give a report.json as a file",
        ),
        (
            [str(tmp_path / "none.json"), str(v99)],
            f"error: {tmp_path / 'none.json'}: cannot "
            "read a report.json (No such file or directory)",
        ),
        (
            [str(v99), str(v99)],
            f"error: {v99}: schema_version 99, expected 1 or 2; re-run "
            "flashnext validate with this version to compare",
        ),
    ]
    for args, expected in cases:
        p = run(*["validate", "compare", *args])
        assert (p.returncode, p.stderr.strip()) == (1, expected)


def test_ab_names_its_own_flags_and_warns_of_one_server_twice(tmp_path: Path) -> None:
    from ..cli.inputs import closed_port

    url = f"http://127.0.0.1:{closed_port()}"
    p = run("validate", "ab", "--baseline", f"{url}/v1", "--candidate", f"{url}/",
            "--out", str(tmp_path / "ab"), "--no-png")  # fmt: skip
    assert p.returncode == 1  # nothing answers there: an error verdict
    lines = p.stderr.splitlines()
    assert lines[0] == f"note: --baseline: using the server root {url}"
    assert lines[1] == (f"warning: --baseline and --candidate are the same server ({url}): it "
                        "can only agree with itself")  # fmt: skip

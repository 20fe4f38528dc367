"""The ``flashnext`` command: ``flashnext <group> <verb>``.

Each group lives in its own module and is imported only when invoked, so that
``flashnext validate`` does not pay for numpy and ``flashnext --help`` stays fast.
Data goes to stdout, diagnostics to stderr; a :class:`FlashnextError` becomes one
``error: ...`` line and exit status 1.
"""

from __future__ import annotations

import errno
import importlib
import os
import sys
from typing import Any, TextIO

import click

from flashnext import __version__
from flashnext.errors import FlashnextError
from flashnext.records import CLI_ERROR, dumps, make_record

# name -> (module, attribute, one-line help)
_COMMANDS: dict[str, tuple[str, str, str]] = {
    "check": (
        "flashnext.cli.check",
        "check",
        "Pre-boot check of planned `vllm serve` arguments against model, GPU and host.",
    ),
    "checkpoint": (
        "flashnext.cli.checkpoint",
        "checkpoint",
        "Verify a downloaded checkpoint, find its PLE tables, override config entries.",
    ),
    "demo": ("flashnext.cli.demo", "demo", "Run the PLE pipeline end to end on synthetic data."),
    "explain": ("flashnext.cli.explain", "explain", "Explain the memory events of a vLLM log."),
    "plan": ("flashnext.cli.plan", "plan", "Plan GPU and host memory for a vLLM deployment."),
    "ple": ("flashnext.cli.ple", "ple", "Inspect, quantize and query PLE sidecar tables."),
    "record": (
        "flashnext.cli.record",
        "record",
        "Capture what a server runs, diff two captures, restore one.",
    ),
    "validate": ("flashnext.cli.validate", "validate", "Validate a live server stage by stage."),
}


class _LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(_COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in _COMMANDS:
            return None
        module, attr, _ = _COMMANDS[cmd_name]
        return getattr(importlib.import_module(module), attr)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, _COMMANDS[name][2]) for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=_LazyGroup)
@click.version_option(__version__, prog_name="flashnext")
def cli() -> None:
    """flashnext: serve Flash-Next-class models reliably on one workstation GPU."""


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: run the CLI; expected failures become one ``error:`` line.

    Exit status: 0 success, 1 a flashnext error or a file that cannot be read or written,
    2 a bad flag (click), 130 interrupted. With ``--json``, a failure that printed no record
    prints a ``flashnext.cli.error`` record (schema_version, kind, error) on stdout, so that
    a script always reads one JSON document; the exit status is kept.
    """
    args = sys.argv[1:] if argv is None else list(argv)
    if not wants_json(args):
        _exit(_run(args))
        return
    watch = _Watch(sys.stdout, sys.stderr)
    sys.stdout, sys.stderr = watch.stdout, watch.stderr
    try:
        code = _run(args)
    finally:
        # A broken pipe has already pointed stdout at os.devnull: leave it there.
        if sys.stdout is watch.stdout:
            sys.stdout = watch.stdout.inner
        if sys.stderr is watch.stderr:
            sys.stderr = watch.stderr.inner
    if code not in (0, None) and not watch.stdout.written:
        error = watch.stderr.last_error or ("interrupted" if code == 130 else f"exit status {code}")
        payload = {"error": error, "exit_code": code, "command": _command_path(args)}
        sys.stdout.write(dumps(make_record(CLI_ERROR, payload)))
        sys.stdout.flush()
    _exit(code)


def _exit(code: int | None) -> None:
    # A command that returned normally returns; one that exited (even with 0) exits.
    if code is not None:
        sys.exit(code)


def wants_json(args: list[str]) -> bool:
    """Whether ``--json`` is one of flashnext's own flags (not an argument after ``--``)."""
    own = args[: args.index("--")] if "--" in args else args
    return "--json" in own


def _command_path(args: list[str]) -> str:
    """The command words at the head of ``args`` (``"ple info"``), as far as click knows them."""
    command: click.Command = cli
    ctx = click.Context(cli)
    path: list[str] = []
    for word in args:
        sub = command.get_command(ctx, word) if isinstance(command, click.Group) else None
        if sub is None:
            break
        path.append(word)
        command = sub
    return " ".join(path)


#: Click 8.2+'s "no arguments, so help" (a UsageError); older clicks print help and exit 0.
_NO_ARGS: tuple[type[click.UsageError], ...] = tuple(
    getattr(click.exceptions, name)
    for name in ("NoArgsIsHelpError",)
    if hasattr(click.exceptions, name)
)


def _run(args: list[str]) -> int | None:
    """Run the command; the exit status, after printing the one ``error:`` line of a failure
    (None: the command returned without choosing one)."""
    try:
        rv = cli.main(args=args, prog_name="flashnext", standalone_mode=False)
    except (click.exceptions.Abort, KeyboardInterrupt):
        click.echo("aborted", err=True)
        return 130
    except _NO_ARGS as exc:
        # `flashnext` or `flashnext ple` alone: the help itself, laid out as --help lays it
        # out (squashed into one error line it was unreadable), and the usage exit status.
        click.echo(exc.ctx.get_help() if exc.ctx is not None else str(exc), err=True)
        return exc.exit_code
    except click.UsageError as exc:
        # One line, like every other error; click's own form spans four.
        hint = f" (see `{exc.ctx.command_path} --help`)" if exc.ctx is not None else ""
        click.echo(f"error: {_one_line(exc.format_message())}{hint}", err=True)
        return exc.exit_code
    except click.ClickException as exc:
        click.echo(f"error: {_one_line(exc.format_message())}", err=True)
        return exc.exit_code
    except FlashnextError as exc:
        click.echo(f"error: {_one_line(str(exc))}", err=True)
        return 1
    except BrokenPipeError:
        # stdout closed early (``| head``): not an error of ours; silence the flush at exit.
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115
        return 1
    except OSError as exc:
        click.echo(f"error: {describe_os_error(exc)}", err=True)
        return 1
    except (click.exceptions.Exit, SystemExit) as exc:
        code = exc.exit_code if isinstance(exc, click.exceptions.Exit) else exc.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    return rv if isinstance(rv, int) else None


class _Stream:
    """A text stream that notes whether anything was written, and the last ``error:`` line."""

    def __init__(self, inner: TextIO) -> None:
        self.inner = inner
        self.written = False
        self.last_error: str | None = None

    def write(self, text: str) -> int:
        if text:
            self.written = True
            for line in text.splitlines():
                if line.startswith("error: "):
                    self.last_error = line[len("error: ") :]
        return self.inner.write(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class _Watch:
    """stdout and stderr of one command, watched (see :class:`_Stream`)."""

    def __init__(self, stdout: TextIO, stderr: TextIO) -> None:
        self.stdout = _Stream(stdout)
        self.stderr = _Stream(stderr)


_OS_HINTS = {
    errno.ENOENT: "check the path",
    errno.ENOTDIR: "a part of the path is a file, not a directory",
    errno.EISDIR: "expected a file, found a directory",
    errno.EACCES: "check the owner and mode of the file and its directories",
    errno.EPERM: "check the owner and mode of the file and its directories",
    errno.ENOSPC: "free space or choose another destination",
    errno.EROFS: "choose another destination",
}


def describe_os_error(exc: OSError) -> str:
    """One line for an ``OSError``: the path(s), what went wrong and what to check."""
    where = " -> ".join(str(f) for f in (exc.filename, exc.filename2) if f is not None)
    what = exc.strerror or str(exc) or type(exc).__name__
    hint = _OS_HINTS.get(exc.errno or 0)
    text = f"{where}: {what}" if where else what
    return _one_line(f"{text} ({hint})" if hint else text)


def _one_line(text: str) -> str:
    return " ".join(text.split())

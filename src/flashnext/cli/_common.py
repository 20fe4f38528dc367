"""One console for every command: what goes where, and how text is printed.

- stdout: data and the closing summary. With ``--json`` stdout holds the record and nothing
  else (:func:`print_record`).
- stderr: progress bars, diagnostics, notes, and the ``error: ...`` line of ``flashnext.cli.main``.

Text is printed as it is: square brackets in paths, package extras (``flashnext[nvml]``) or
server messages are never read as rich markup. :func:`say` and :func:`note` print plain text
(``style`` colours the whole line); :func:`cell` makes a table cell from plain text; only
literal markup written in this package's own source goes through rich's parser.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import click
from rich.console import Console, RenderableType
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text

from flashnext.records import KINDS, dumps, make_record

F = TypeVar("F", bound=Callable[..., Any])

#: Data and summaries.
out_console = Console(highlight=False)
#: Progress, diagnostics and notes.
err_console = Console(stderr=True, highlight=False)


def say(text: str, style: str | None = None) -> None:
    """One line of summary on stdout, printed verbatim (no markup, not wrapped)."""
    out_console.print(Text(text, style=style or ""), soft_wrap=True)


def note(text: str, style: str | None = None) -> None:
    """One line of diagnostics on stderr, printed verbatim (no markup, not wrapped)."""
    err_console.print(Text(text, style=style or ""), soft_wrap=True)


def show(renderable: RenderableType) -> None:
    """A summary table (or other rich renderable) on stdout."""
    out_console.print(renderable)


def cell(value: object, style: str | None = None) -> Text:
    """A table cell (or title) showing ``value``'s text verbatim, never parsed as markup."""
    return Text(str(value), style=style or "")


def print_record(kind: str, payload: Mapping[str, Any] | Any, schema_version: int = 1) -> None:
    """The ``--json`` output: ``payload`` as a :func:`flashnext.records.make_record` record on
    stdout (strict JSON: NaN/inf become null).

    Raises:
        RecordError: ``kind`` is malformed or the payload uses an envelope key.
    """
    sys.stdout.write(dumps(make_record(kind, payload, schema_version=schema_version)))
    sys.stdout.flush()


class _RateColumn(ProgressColumn):
    """Rows/s and MB/s, from the task's rows and a ``bytes_per_unit`` field."""

    def render(self, task: Task) -> Text:
        speed = task.finished_speed or task.speed
        if not speed:
            return Text("-", style="progress.data.speed")
        mb = speed * task.fields.get("bytes_per_unit", 0) / 1e6
        unit = task.fields.get("unit", "rows")
        return Text(f"{speed:,.0f} {unit}/s  {mb:,.1f} MB/s", style="progress.data.speed")


class _Progress(Progress):
    """A progress display that leaves nothing behind when the work fails, so that the
    ``error:`` line is the only thing a failed command prints on stderr."""

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            super().__exit__(exc_type, exc, tb)
        elif not self.disable:
            # Progress.stop() would print the last frame (and a blank line when not a terminal).
            self.live.transient = True
            self.live.stop()


def progress(disable: bool = False) -> Progress:
    """A progress display on stderr with count, rate, MB/s and ETA."""
    return _Progress(
        TextColumn("[bold]{task.description}", markup=True),
        BarColumn(),
        MofNCompleteColumn(),
        _RateColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=err_console,
        disable=disable,
        transient=False,
    )


class OutputDir(click.Path):
    """A directory a command will create or write into: checked before any work starts.

    It may exist (as a directory) or not; the nearest existing ancestor must be a writable
    directory. A file where a directory is expected, or an unwritable parent, is a usage
    error (exit 2) naming the path at fault, instead of a failure after the work is done.
    """

    def __init__(self) -> None:
        super().__init__(file_okay=False, path_type=Path)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        path = super().convert(value, param, ctx)
        problem = output_dir_problem(Path(os.fsdecode(path)))
        if problem:
            self.fail(problem, param, ctx)
        return path


class FiniteRange(click.FloatRange):
    """A float flag (:class:`click.FloatRange`'s bounds) that refuses ``nan`` and ``inf``:
    ``nan`` passes every bound check, and a timeout or threshold of ``nan`` waits forever or
    fails everything. Every float flag of every command uses it (a usage error, exit 2)."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        from flashnext.numbers import NumberError, finite_float

        try:
            number = finite_float(value)
        except NumberError as exc:
            self.fail(str(exc), param, ctx)
        return super().convert(number, param, ctx)


def output_dir_problem(path: Path) -> str | None:
    """Why ``path`` cannot become a directory we write into, or None if it can."""
    probe = path
    while not probe.exists():
        if probe.is_symlink():
            return f"{probe} is a dangling symbolic link"
        if probe.parent == probe:
            break
        probe = probe.parent
    if not probe.is_dir():
        return f"{probe} is a file, not a directory; choose another path"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{probe} is not writable by this user; choose another path or fix its mode"
    return None


def human_bytes(n: float) -> str:
    """``n`` bytes in decimal units: ``"512 B"``, ``"1.5 MB"``, ``"49.0 GB"``."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:,.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n} B"


def json_help(kind: str) -> str:
    """The ``--json`` help of a command whose record is of ``kind`` (one of records.KINDS)."""
    if kind not in KINDS:
        raise ValueError(f"{kind!r} is not a record kind of flashnext.records")
    return f"Print a {kind} record (JSON) on stdout."


def json_option(kind: str) -> Callable[[F], F]:
    """``--json`` (parameter ``as_json``) for a command that prints a ``kind`` record."""
    option = click.option("--json", "as_json", is_flag=True, help=json_help(kind))
    return option  # type: ignore[return-value]


#: The one metavar of every argument and option that names a sidecar directory.
SIDECAR = "SIDECAR"


def sidecar_argument(name: str) -> Callable[[F], F]:
    """A command's sidecar directory argument (parameter ``name``), shown as :data:`SIDECAR`."""
    path = click.Path(exists=True, file_okay=False, path_type=Path)
    return click.argument(name, metavar=SIDECAR, type=path)  # type: ignore[return-value]


def old_spelling(old: str, new: str, dest: str, **option: Any) -> Callable[[F], F]:
    """Accept ``old``, the documented former spelling of option ``new`` (parameter ``dest``):
    hidden from ``--help``, converted with the same ``option`` settings (type...), and noted
    with one deprecation line on stderr. Giving both spellings is a usage error (exit 2).

    Stack it *above* the ``@click.option`` of ``new``.
    """
    hidden = f"old_spelling_of_{dest}"

    def decorate(f: F) -> F:
        @functools.wraps(f)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            value = kwargs.pop(hidden, None)
            if value is not None:
                if kwargs.get(dest) is not None:
                    raise click.UsageError(f"give {new} only ({old} is its old spelling)")
                note(f"warning: {old} is deprecated here; it is now spelled {new}")
                kwargs[dest] = value
            return f(*args, **kwargs)

        return click.option(old, hidden, hidden=True, default=None, **option)(wrapper)  # type: ignore[return-value]

    return decorate


def server_url(url: str, flag: str = "--url") -> str:
    """The server root of ``url`` given as ``flag`` (see
    :func:`flashnext.validate.client.server_root`: ``.../v1`` and routes are dropped), with a
    note on stderr when that changed it. Every command that takes a server URL reads it so."""
    from flashnext.errors import ValidationError
    from flashnext.records import redact_url
    from flashnext.validate.client import server_root

    try:
        root = server_root(url, flag)
    except ValidationError as exc:  # a flag's value, before any work: usage (exit 2)
        raise click.UsageError(str(exc)) from None
    if root != url.rstrip("/"):
        click.echo(f"note: {flag}: using the server root {redact_url(root)}", err=True)
    return root

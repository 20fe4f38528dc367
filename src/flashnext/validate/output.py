"""Writing a report's files so that one file that cannot be written loses nothing else.

Each file is rendered and written on its own, to a temporary name renamed when complete
(:func:`flashnext.atomic.atomic_write`): a full disk, a name taken by a directory or a plot
without matplotlib costs that file only, and the caller still prints the summary and ``--json``
on stdout, then names every file that could not be written. Text is written as UTF-8; a path
or argument that is not valid UTF-8 (an undecodable ``--out``) appears backslash-escaped. Each
file is noted as this report's (:func:`~flashnext.store.destination.remember_written`) before it
is renamed into place, so a later run may replace it and nothing else
(:class:`~flashnext.store.destination.ReportDestination`).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from flashnext.atomic import atomic_write
from flashnext.errors import MissingExtraError, ValidationError
from flashnext.store.destination import remember_written

Render = Callable[[], bytes | str]


@dataclass
class Written:
    """What :func:`write_files` did: ``paths`` written; ``failed``, one ``"PATH: why"`` line per
    file not written; ``notes``, optional files left out (a plot without matplotlib)."""

    paths: list[Path] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def write_files(out_dir: Path, files: dict[str, Render]) -> Written:
    """Render and write each of ``files`` (name -> renderer) into ``out_dir``; never raises
    :class:`OSError` or :class:`~flashnext.errors.MissingExtraError` (see :class:`Written`)."""
    done = Written()
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        done.failed += [f"{out_dir / name}: cannot write ({_why(exc)})" for name in files]
        return done
    for name, render in files.items():
        path = out_dir / name
        try:
            data = render()
        except MissingExtraError as exc:
            done.notes.append(f"{name} skipped: {exc}")
            continue
        if isinstance(data, str):
            data = printable(data).encode("utf-8")
        try:
            remember_written(out_dir, name, data)  # before the rename: a later run knows it
            with atomic_write(path) as fh:
                fh.write(data)
        except OSError as exc:
            done.failed.append(f"{path}: cannot write ({_why(exc)})")
        else:
            done.paths.append(path)
    return done


def check_writable(out_dir: Path, names: Sequence[str]) -> None:
    """Make sure files ``names`` can be written into ``out_dir``, before a run starts.

    Creates the directory, writes and removes a probe file in it, and checks that no file
    name is taken by a directory.

    Raises:
        ValidationError: one line naming ``--out`` and what is in the way.
    """
    try:
        if out_dir.exists() and not out_dir.is_dir():
            raise ValidationError(f"--out {out_dir}: exists and is not a directory")
        out_dir.mkdir(parents=True, exist_ok=True)
        for name in names:
            if (out_dir / name).is_dir():
                raise ValidationError(
                    f"--out {out_dir}: {name} there is a directory; remove it or choose "
                    "another --out"
                )
        with tempfile.NamedTemporaryFile(dir=out_dir, prefix=".flashnext-probe-"):
            pass
    except OSError as exc:
        raise ValidationError(
            f"--out {out_dir}: cannot write a report there ({_why(exc)})"
        ) from None


def printable(text: str) -> str:
    """``text`` as valid UTF-8: characters that stand for undecodable bytes of a path or an
    argument (surrogates) become backslash escapes, as in the files written."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _why(exc: OSError) -> str:
    return exc.strerror or str(exc)

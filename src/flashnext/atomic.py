"""Writes that never leave a half-written file under the final name.

The temporary name rule lives here and nowhere else: a file ``NAME`` is written as
``.NAME.tmp-PID`` (:func:`temp_name`) in the same directory and renamed over ``NAME`` when
complete; :func:`is_temp_name` recognises such a name (a cleaner removing what a killed writer
left asks it, instead of re-parsing the pattern). Errors name the user's path, never the
temporary one: a full disk while writing ``.v2.tmp-19241`` is reported as ``v2``.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

_TEMP_SEP = ".tmp-"


def temp_name(path: Path) -> Path:
    """The temporary name ``path`` is written under before the rename: ``.NAME.tmp-PID``."""
    return path.with_name(f".{path.name}{_TEMP_SEP}{os.getpid()}")


def is_temp_name(name: str, final: str | None = None) -> bool:
    """Whether ``name`` is :func:`temp_name`'s form (of the file ``final``, when given)."""
    base, sep, pid = name.rpartition(_TEMP_SEP)
    if not (sep and pid.isdigit() and base.startswith(".") and len(base) > 1):
        return False
    return final is None or base[1:] == final


def final_name(name: str) -> str:
    """The final file name of a temporary ``name`` (``.NAME.tmp-PID`` -> ``NAME``)."""
    if not is_temp_name(name):
        raise ValueError(f"{name!r} is not a temporary name")
    return name.rpartition(_TEMP_SEP)[0][1:]


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike[str], mode: str = "wb") -> Iterator[IO[Any]]:
    """Open a temporary file beside ``path``; on success fsync it and rename it over ``path``.

    On an exception the temporary file is removed and ``path`` is untouched. An ``OSError``
    is re-raised naming ``path`` (the file the caller asked for), not the temporary name, and
    with a file name even where the system gave none (a full disk on write or fsync).
    """
    final = Path(path)
    tmp = temp_name(final)
    try:
        with open(tmp, mode) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, final)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(exc, OSError) and exc.errno is not None:
            raise _naming(exc, final) from None
        raise


def _naming(exc: OSError, final: Path) -> OSError:
    """``exc`` as an error of ``final``: a rename onto a directory says so plainly."""
    if final.is_dir() and not final.is_symlink():
        return IsADirectoryError(exc.errno, "is a directory, expected a file", str(final))
    return type(exc)(exc.errno, exc.strerror, str(final))


def write_json(path: str | os.PathLike[str], data: Any, indent: int | None = 2) -> None:
    """Write ``data`` as JSON, atomically: indented, or with ``indent=None`` compact (encoded
    by json's C encoder, for a file rewritten often)."""
    with atomic_write(path, "w") as fh:
        fh.write(json.dumps(data, indent=indent, sort_keys=False) + "\n")

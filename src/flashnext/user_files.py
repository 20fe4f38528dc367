"""The one opener for files a user points at: regular files only, read within a bound.

A path on a command line can be anything: a FIFO nobody writes (``open`` blocks forever), a
device (``/dev/zero`` never ends), a directory, a socket, or a symbolic link to any of them.
Every command that reads a user's file opens it here, and is refused in one line naming the
path and what it is, before any work:

- :func:`open_user_file`: a binary file object of a regular file, opened with ``O_NONBLOCK``
  (a FIFO swapped in after a check cannot hang the open) and checked again on the open
  descriptor (``fstat``), so a symbolic link to a device is judged by what it points at.
- :func:`read_user_file` / :func:`read_user_text`: its bytes (text), refused above a size
  bound rather than read into memory without end.

Streaming readers (hashing) read at most the size ``fstat`` gave when the file was opened.
"""

from __future__ import annotations

import io
import os
import stat
from pathlib import Path

from flashnext.errors import FlashnextError

#: The most a whole-file read takes by default (records, reports, prompt and text files).
DEFAULT_LIMIT = 1 << 30
#: The most a JSON document (config.json, a record, a report) takes: far above any real one.
JSON_LIMIT = 256 << 20


class UserFileError(FlashnextError):
    """A path a user gave is not a regular file, or is larger than its reader's bound."""


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def _require_regular(path: str | os.PathLike[str], mode: int, what: str) -> None:
    if not stat.S_ISREG(mode):
        raise UserFileError(
            f"{path}: {_kind(mode)}, not a regular file (a FIFO, device, socket or directory is "
            f"never read); give {what} as a file"
        )


def open_user_file(path: str | os.PathLike[str], what: str = "it") -> io.FileIO:
    """``path`` opened for binary reading, when it is (or links to) a regular file.

    Args:
        path: the user's path.
        what: what the file should be, for the message ("the prompt file", "--log").

    Raises:
        UserFileError: a directory, FIFO, device or socket (one line, the path named).
        OSError: missing or unreadable (the caller names the path).
    """
    _require_regular(path, os.stat(path).st_mode, what)  # a socket cannot even be opened
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        _require_regular(path, os.fstat(fd).st_mode, what)
    except BaseException:
        os.close(fd)
        raise
    return io.FileIO(fd, "rb")


def read_user_file(
    path: str | os.PathLike[str], what: str = "it", limit: int = DEFAULT_LIMIT
) -> bytes:
    """The bytes of the regular file ``path``, at most ``limit`` of them.

    Raises:
        UserFileError: not a regular file, or larger than ``limit`` bytes.
        OSError: missing or unreadable.
    """
    with open_user_file(path, what) as fh:
        size = os.fstat(fh.fileno()).st_size
        data = fh.read(limit + 1) if size <= limit else b""
        if size > limit or len(data) > limit:
            raise UserFileError(
                f"{path}: {max(size, len(data)):,} bytes, more than the {limit:,} read for "
                f"{what}; give a smaller file"
            )
        return data


def read_user_text(
    path: str | os.PathLike[str], what: str = "it", limit: int = DEFAULT_LIMIT
) -> str:
    """:func:`read_user_file` decoded as UTF-8.

    Raises:
        UserFileError: as :func:`read_user_file`, or not UTF-8 text.
        OSError: missing or unreadable.
    """
    data = read_user_file(path, what, limit)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserFileError(
            f"{Path(path)}: not UTF-8 text (byte {exc.start}); give {what} as UTF-8 text"
        ) from None

"""Where a writing command may write, and the life of a sidecar directory being written.

Two jobs, one owner:

**The rule** (:func:`destination_problem`), a pure check every writing command calls before any
work: a destination may not be an input, contain one, or lie inside one (after following
symbolic links, and a hard link to an input file counts as the input), nor be the working
directory or one of its ancestors (``.``, ``..``, ``/``); a directory is expected where a
directory belongs and a file where a file does; an existing file the command would replace
must be one it wrote itself (the caller says how to recognise its own files).

**A report directory** (:class:`ReportDestination`): a directory a command writes a few named
files into (``validate``: report.json, report.md, report.png; ``validate ab``: ab.*,
baseline-answers.jsonl). It may hold only files a flashnext report writer wrote there and
that are unchanged since: :data:`OWN_FILES` in it lists each such file's sha256
(:func:`remember_written`, called by the writer before each rename). Anything else is refused,
naming it; ``force`` lets the command replace its own names (other files stay). The lock below
is held from before the run until the report is written.

**A sidecar destination** (:class:`SidecarDestination`): refuse or adopt what is there, lock it
against a second writer, keep the resume state, hand out the writer, commit, clean up. Every
sidecar writer goes through it: the quantizer's :class:`SidecarWriter` (a whole table) and
``ple slice``'s :class:`~flashnext.store.slicing.SliceWriter` (some ranks' shards).

- It is written only when it is missing, empty, or this command's own output for the same
  source and settings: unfinished (its state record, :data:`~flashnext.store.sidecar.STATE_NAME`,
  matches) or finished (its META.json matches). Anything else is refused, naming what is there.
- ``force`` replaces it, but the new table is written beside it (``.DST.flashnext-new``) and
  swapped in only once complete: the old contents stay intact until then. A ``force`` run that
  fails for lack of space removes its partial ``.DST.flashnext-new`` (it holds the space and
  cannot finish); other failures keep it, and the same command resumes it.
- Lock: ``.DST.flashnext-lock`` beside the destination is held (``fcntl.flock``) from the first
  look until the commit or the failure; a second writer is refused with "another flashnext
  process (pid N) is writing DST". The kernel drops the lock when its holder dies, so a
  killed run never blocks the next one.
- Resume: the state record lists the settings, the source's identity and each finished shard's
  sha256. Shards whose files still hash to the recorded value are kept; a changed source or
  setting is refused (or replaced with ``force``). Output is deterministic, so a resumed result
  is byte-identical to an uninterrupted run.
- Finished iff no state file: :meth:`SidecarWriter.start` writes the state record before
  anything else and removes an old META.json; :meth:`SidecarWriter.finish` writes META.json and
  only then removes the state record.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, Protocol

import numpy as np

from flashnext import __version__
from flashnext.atomic import atomic_write, final_name, is_temp_name, write_json
from flashnext.errors import DestinationError, SidecarError
from flashnext.ple.formats import get_codec
from flashnext.ple.geometry import PLEGeometry
from flashnext.records import to_jsonable
from flashnext.safetensors_file import sha256_file
from flashnext.store.sidecar import (
    FORMAT_VERSION,
    META_NAME,
    STATE_NAME,
    Sidecar,
    open_sidecar,
    read_meta,
    read_state,
    shard_index,
    shard_name,
    write_shard_file,
    write_state,
)

__all__ = [
    "OWN_FILES",
    "DestinationLock",
    "ReportDestination",
    "SidecarDestination",
    "SidecarWriter",
    "TableWriter",
    "destination_problem",
    "progress_kept",
    "recorded_source",
    "remember_written",
    "write_sidecar",
    "write_text_locked",
]

Expect = Literal["dir", "file"]


# -- the rule ------------------------------------------------------------------------------
def destination_problem(
    dst: str | os.PathLike[str],
    inputs: Iterable[str | os.PathLike[str]] = (),
    *,
    expect: Expect = "dir",
    owns: Callable[[Path], bool] | None = None,
    writes: Iterable[str] = (),
    holds: Callable[[Path], bool] | None = None,
    cwd: str | os.PathLike[str] | None = None,
) -> str | None:
    """Why a command may not write ``dst``, or None when it may (pure: reads, never writes).

    Args:
        dst: the destination as the user gave it.
        inputs: every path the command reads (missing ones are ignored).
        expect: ``dir`` (a directory written into) or ``file`` (one file written whole).
        owns: whether an existing file is one this command wrote (may be replaced); without it
            no existing file is replaced.
        writes: for ``dir``: the names the command writes inside it (each checked with ``owns``).
        holds: for ``dir``: whether an entry already in it is one this command may find there
            (its own output); with it, a directory holding anything else is refused.
        cwd: the working directory (default: the process's).
    """
    path = Path(os.fsdecode(dst))
    shape = _shape_problem(path, expect)
    if shape:
        return shape
    real = path.resolve()
    here = Path(cwd if cwd is not None else os.getcwd()).resolve()
    if real == here or real in here.parents:
        which = "the working directory" if real == here else "an ancestor of the working directory"
        return f"{path} is {which} ({here}); choose a new directory for the output"
    for given in inputs:
        problem = _input_problem(path, real, Path(os.fsdecode(given)))
        if problem:
            return problem
    if holds is not None and expect == "dir":
        strangers = _strangers(path, holds)
        if strangers:
            return strangers
    targets = [path] if expect == "file" else [path / name for name in writes]
    for target in targets:
        if target.exists() and not (owns is not None and target.is_file() and owns(target)):
            return (
                f"{target} exists and was not written by this command; it is never replaced: "
                "remove it yourself or choose another path"
            )
    return None


def _strangers(path: Path, holds: Callable[[Path], bool]) -> str | None:
    """Entries of the directory ``path`` that are not this command's output, in words."""
    if not path.is_dir():
        return None
    names = sorted(p.name for p in path.iterdir() if not holds(p))
    if not names:
        return None
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    return (
        f"{path} holds {', '.join(names[:3])}{more}, which this command did not write; it "
        "writes only into a new or empty directory or its own earlier output: choose another "
        "path (or remove them yourself)"
    )


def _shape_problem(path: Path, expect: Expect) -> str | None:
    """A file where a directory belongs (or the reverse), or a dangling symbolic link."""
    if path.is_symlink() and not path.exists():
        return f"{path} is a dangling symbolic link; remove it or choose another path"
    if expect == "dir" and path.exists() and not path.is_dir():
        return f"{path} is a file, not a directory; choose another path"
    if expect == "file" and path.is_dir():
        return f"{path} is a directory, expected a file; choose another path"
    return None


def _input_problem(path: Path, real: Path, given: Path) -> str | None:
    """Whether ``path`` (resolved: ``real``) is, holds or lies inside the input ``given``."""
    if not given.exists():
        return None
    source = given.resolve()
    if real == source or (path.exists() and os.path.samefile(path, given)):
        return f"{path} is the input {given}; choose another destination (nothing was written)"
    if real in source.parents:
        return (
            f"{path} contains the input {given}; writing there could destroy it: choose a "
            "destination outside every input"
        )
    if source in real.parents:
        return (
            f"{path} lies inside the input {given}; writing there would change an input: "
            "choose a destination outside it"
        )
    return None


# -- the lock ------------------------------------------------------------------------------
class DestinationLock:
    """An exclusive ``flock`` on ``.NAME.flashnext-lock`` beside a destination.

    The lock file holds the holder's pid (for the refusal) and is removed on release. A writer
    that opened a lock file another writer has just removed checks that it still holds the
    file under its name, and retries otherwise, so two writers never both hold it.

    Raises:
        SidecarError: "another flashnext process (pid N) is writing DST".
    """

    def __init__(self, dst: Path) -> None:
        self.dst = dst = real_destination(dst)
        self.path = dst.with_name(f".{dst.name}.flashnext-lock")
        self._fd: int | None = None
        self._made: list[Path] = []  # parents created for the lock file, deepest last

    def acquire(self) -> DestinationLock:
        missing = [p for p in [self.path.parent, *self.path.parent.parents] if not p.exists()]
        for parent in reversed(missing):
            parent.mkdir(exist_ok=True)
            self._made.append(parent)
        while self._fd is None:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_pid(fd)
                os.close(fd)
                raise SidecarError(
                    f"another flashnext process (pid {holder}) is writing {self.dst}; wait for "
                    "it to finish (or stop it), then run this command again"
                ) from None
            if _same_file(fd, self.path):
                with contextlib.suppress(OSError):  # the pid only informs; a full disk
                    os.ftruncate(fd, 0)  # must not stop the writer (it reports its own
                    os.write(fd, f"{os.getpid()}\n".encode())  # files it cannot write)
                self._fd = fd
            else:  # removed by the holder that just released it: take a fresh one
                os.close(fd)
        return self

    @property
    def held(self) -> bool:
        return self._fd is not None

    def abandoned(self) -> bool | None:
        """Whether the lock file is there and no process holds it (its writer died: a killed
        process leaves the file, unlocked); None when there is no lock file. Takes nothing."""
        try:
            fd = os.open(self.path, os.O_RDWR)
        except FileNotFoundError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        finally:
            os.close(fd)  # closing drops a lock just taken
        return True

    def release(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            self.path.unlink()
        os.close(self._fd)
        self._fd = None
        for parent in reversed(self._made):  # only those still empty: a failed run's
            with contextlib.suppress(OSError):
                parent.rmdir()
        self._made = []

    def __enter__(self) -> DestinationLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def write_text_locked(path: str | os.PathLike[str], text: str, mode: int | None = None) -> None:
    """Write ``text`` (UTF-8) as the whole file ``path``: under its :class:`DestinationLock`
    (a second writer is refused, naming this one), to a temporary name renamed when complete;
    ``mode`` (e.g. ``0o755``) is set before the rename."""
    with DestinationLock(Path(path)), atomic_write(path, "w") as fh:
        fh.write(text)
        if mode is not None:
            os.fchmod(fh.fileno(), mode)


def real_destination(dst: str | os.PathLike[str]) -> Path:
    """``dst`` with a symbolic link in its last component followed: the directory it names is
    the one written, locked and replaced (``--force`` would otherwise swap a new directory in
    for the link, and a second writer through another name would not meet the lock)."""
    path = Path(dst)
    return Path(os.path.realpath(path)) if path.is_symlink() and path.exists() else path


def _read_pid(fd: int) -> str:
    """The pid a lock file names ("?" while its holder has not written it yet)."""
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return "?"
    return text if text.isdigit() else "?"


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    return (st.st_dev, st.st_ino) == (os.fstat(fd).st_dev, os.fstat(fd).st_ino)


# -- a report directory ----------------------------------------------------------------------
#: In a report directory: ``{"files": {name: [sha256, ...]}}``, the files flashnext report
#: writers wrote there (the last two hashes of each: a run killed between this record and the
#: rename leaves the older file, still recognised).
OWN_FILES = ".flashnext-files.json"


def _own_files(directory: Path) -> dict[str, list[str]]:
    """The record of :data:`OWN_FILES` (empty when missing or unreadable: nothing is ours)."""
    try:
        data = json.loads((directory / OWN_FILES).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    files = data.get("files") if isinstance(data, dict) else None
    if not isinstance(files, dict):
        return {}
    return {str(k): [h for h in v if isinstance(h, str)] for k, v in files.items()
            if isinstance(v, list)}  # fmt: skip


def remember_written(directory: str | os.PathLike[str], name: str, data: bytes) -> None:
    """Record in ``directory``'s :data:`OWN_FILES` that ``name`` is about to hold ``data``
    (call it before renaming the file into place)."""
    root = Path(directory)
    files = _own_files(root)
    digest = hashlib.sha256(data).hexdigest()
    files[name] = [*[h for h in files.get(name, []) if h != digest][-1:], digest]
    write_json(root / OWN_FILES, {"files": files})


class ReportDestination:
    """A report directory (see the module docstring): refused when it holds anything but
    unchanged files of flashnext's report writers (``force``: this command's ``names`` may be
    replaced), locked from :meth:`__enter__` until :meth:`__exit__`.

    Raises:
        DestinationError: :meth:`problem`'s answer, or another process holds the lock.
    """

    def __init__(
        self,
        dst: str | os.PathLike[str],
        names: Iterable[str],
        *,
        force: bool = False,
    ) -> None:
        self.dst = real_destination(dst)
        self.names = tuple(names)
        self.force = force
        self._lock = DestinationLock(self.dst)

    def foreign(self) -> list[str]:
        """Entries of the directory that no flashnext report writer left unchanged there."""
        if not self.dst.is_dir():
            return []
        own = _own_files(self.dst)
        out = []
        for entry in sorted(self.dst.iterdir(), key=lambda p: p.name):
            name = entry.name
            if name == OWN_FILES or (is_temp_name(name) and final_name(name) in own):
                continue
            if not (entry.is_file() and not entry.is_symlink() and name in own
                    and sha256_file(entry) in own[name]):  # fmt: skip
                out.append(name)
        return out

    def problem(self) -> str | None:
        """Why this command may not write into the directory (None: it may)."""
        foreign = self.foreign()
        if self.force:  # its own names go; everything else stays, so it is still refused
            foreign = [n for n in foreign if n not in self.names]
            fix = f"; --force replaces only {', '.join(self.names)}, never other files"
        else:
            mine = ", ".join(n for n in foreign if n in self.names) or "the report's files"
            fix = (": choose a new or empty directory (or remove them), or pass --force to "
                   f"replace {mine} (other files stay)")  # fmt: skip
        if not foreign:
            return None
        more = f" and {len(foreign) - 5} more" if len(foreign) > 5 else ""
        return (
            f"{self.dst} holds files a flashnext report did not write (or changed "
            f"since): {', '.join(foreign[:5])}{more}{fix}"
        )

    def __enter__(self) -> ReportDestination:
        try:
            self._lock.acquire()
        except SidecarError as exc:
            raise DestinationError(str(exc)) from None
        problem = self.problem()  # again under the lock: what another writer left is judged
        if problem:
            self._lock.release()
            raise DestinationError(problem)
        return self

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


# -- the writer ----------------------------------------------------------------------------
class SidecarWriter:
    """Writes a sidecar shard by shard; :meth:`finish` writes META.json last.

    :meth:`start` marks the directory unfinished (the state record :data:`STATE_NAME`) before
    anything else is written, and only then removes an old META.json, so at every instant the
    directory is either finished or refused by readers as unfinished. :meth:`finish` writes
    META.json, then removes the state record. Shards may be written in any order (parallel
    workers: :meth:`adopt` counts a shard written elsewhere); each lands atomically.
    """

    #: Files besides shards, META.json and the state record that this writer creates.
    extra_names: ClassVar[tuple[str, ...]] = ()

    def __init__(
        self,
        path: str | os.PathLike[str],
        fmt: str,
        width: int,
        num_rows: int,
        rows_per_shard: int,
        geometry: PLEGeometry | Mapping[str, Any] | None = None,
        source: Mapping[str, Any] | None = None,
        settings: Mapping[str, Any] | None = None,
    ) -> None:
        self.path = Path(path)
        self.codec = get_codec(fmt)
        self.codec.check_width(width)
        if num_rows <= 0 or rows_per_shard <= 0:
            raise SidecarError(
                f"{self.path}: num_rows={num_rows} and rows_per_shard={rows_per_shard} must be "
                "positive"
            )
        self.width = width
        self.num_rows = num_rows
        self.rows_per_shard = rows_per_shard
        self.num_shards = -(-num_rows // rows_per_shard)
        if isinstance(geometry, PLEGeometry):
            geometry = geometry.to_dict()
        self.geometry = dict(geometry) if geometry is not None else None
        self.source = dict(source or {})
        #: What the output depends on besides the source; recorded in the state and META.json.
        self.settings = {**self.default_settings(), **(settings or {})}
        self.records: dict[int, dict[str, Any]] = {}
        self._state_records: dict[int, Any] = {}  # self.records as JSON values (_save_state)
        self._started = False

    def default_settings(self) -> dict[str, Any]:
        return {
            "format": self.codec.name,
            "rows_per_shard": self.rows_per_shard,
            "num_rows": self.num_rows,
            "width": self.width,
            "flashnext_version": __version__,
        }

    @property
    def params(self) -> dict[str, Any]:
        """The identity of this output: settings and the source's identity."""
        return {"settings": self.settings, "source": self.source}

    @property
    def indices(self) -> Sequence[int]:
        """The shard indices this output holds: all of the table's."""
        return range(self.num_shards)

    def shard_rows(self, index: int) -> tuple[int, int]:
        """Global row range ``[start, end)`` of shard ``index``."""
        start = index * self.rows_per_shard
        return start, min(start + self.rows_per_shard, self.num_rows)

    def start(self, kept: Mapping[int, Mapping[str, Any]] | None = None) -> None:
        """Mark the directory unfinished (creating it), counting ``kept`` shards as written."""
        self.path.mkdir(parents=True, exist_ok=True)
        self.records = {int(i): dict(r) for i, r in (kept or {}).items()}
        self._state_records = {i: to_jsonable(r) for i, r in self.records.items()}
        self._save_state()
        (self.path / META_NAME).unlink(missing_ok=True)
        self._started = True

    def _save_state(self) -> None:
        write_state(self.path, self.num_shards, self.params, self._state_records)

    def write_shard(
        self, index: int, tensors: Mapping[str, np.ndarray], **extra: Any
    ) -> dict[str, Any]:
        """Check ``tensors`` against the format and write shard ``index`` atomically.

        ``extra`` (e.g. ``rel_rmse``) is stored in the shard's META.json record.
        Returns the record ``{"file", "rows", "sha256", **extra}``.
        """
        if not 0 <= index < self.num_shards:
            raise SidecarError(f"{self.path}: shard index {index} outside [0, {self.num_shards})")
        if not self._started:
            self.start()
        start, end = self.shard_rows(index)
        record = write_shard_file(
            self.path,
            self.codec,
            self.width,
            index,
            start,
            end - start,
            tensors,
            table_rows=self.num_rows,
            **extra,
        )
        self.adopt(record)
        return record

    def adopt(self, record: Mapping[str, Any]) -> None:
        """Count a shard already on disk (written by a worker or verified) as written."""
        index = shard_index(str(record.get("file", "")))
        if index is None:
            raise SidecarError(f"{self.path}: record {record!r} names no shard file")
        if not self._started:
            self.start()
        self.records[index] = dict(record)
        self._state_records[index] = to_jsonable(record)
        self._save_state()

    def finish(self, quantization: Mapping[str, Any] | None = None) -> Sidecar:
        """Write META.json once every shard is written, drop the state record, re-open."""
        missing = [i for i in range(self.num_shards) if i not in self.records]
        if missing:
            raise SidecarError(f"{self.path}: cannot finish, shards {missing[:8]} not written")
        meta = {
            "format_version": FORMAT_VERSION,
            "format": self.codec.name,
            "width": self.width,
            "rows_per_shard": self.rows_per_shard,
            "num_rows": self.num_rows,
            "num_shards": self.num_shards,
            "shards": [self.records[i] for i in range(self.num_shards)],
            "geometry": self.geometry,
            "source": self.source,
            "settings": self.settings,
            "quantization": dict(quantization) if quantization else None,
            "flashnext_version": __version__,
        }
        write_json(self.path / META_NAME, meta)
        (self.path / STATE_NAME).unlink(missing_ok=True)
        return open_sidecar(self.path)


def write_sidecar(
    path: str | os.PathLike[str],
    fmt: str,
    rows: np.ndarray,
    rows_per_shard: int,
    geometry: Mapping[str, Any] | None = None,
    source: Mapping[str, Any] | None = None,
) -> Sidecar:
    """Quantize float32 ``rows`` [num_rows, width] to ``fmt`` and write a whole sidecar.

    Convenience for tables that fit in memory (tests, the demo); large tables stream through
    :func:`flashnext.store.quantize.quantize_table`. No destination checks: the caller owns
    ``path``.
    """
    rows = np.asarray(rows)
    writer = SidecarWriter(
        path, fmt, rows.shape[1], rows.shape[0], rows_per_shard, geometry, source
    )
    for i in range(writer.num_shards):
        start, end = writer.shard_rows(i)
        writer.write_shard(i, writer.codec.quantize(rows[start:end]))
    return writer.finish()


# -- a sidecar destination's life ------------------------------------------------------------
@dataclass(frozen=True)
class _Found:
    """What an earlier run left in a directory."""

    status: str  # "unfinished" | "finished" | "" (no flashnext table)
    params: dict[str, Any] | None
    shards: dict[int, dict[str, Any]]


@dataclass(frozen=True)
class _Existing:
    """A directory judged as a destination: this run's own output, or ``refusal``."""

    kept: dict[int, dict[str, Any]]  # shard index -> its record, verified by sha256
    finished: bool  # the directory already is this exact output
    refusal: str | None  # what is there, when it is not this run's own output


class TableWriter(Protocol):
    """What :class:`SidecarDestination` needs of a writer: :class:`SidecarWriter` (a whole
    table) or :class:`~flashnext.store.slicing.SliceWriter` (some ranks' shards).

    ``params`` is the output's identity, compared with the state record of an unfinished run
    and with a finished one's META.json (``settings``, ``source`` and, for a slice, ``slice``).
    """

    path: Path
    num_shards: int  # the table's shard count: a shard file with a higher index is foreign
    extra_names: ClassVar[tuple[str, ...]]

    @property
    def indices(self) -> Sequence[int]: ...

    @property
    def params(self) -> dict[str, Any]: ...

    def start(self, kept: Mapping[int, Mapping[str, Any]] | None = None) -> None: ...

    def adopt(self, record: Mapping[str, Any]) -> None: ...

    def finish(self, quantization: Mapping[str, Any] | None = None) -> Sidecar: ...


class SidecarDestination:
    """The directory a sidecar is written to, from the first look to the commit.

    Use as a context manager around the whole write::

        with SidecarDestination(dst, writer, force=force, inputs=[src]) as dest:
            for index in dest.todo: ...write shard index into dest.workdir, dest.adopt(record)
            sidecar = dest.commit(quantization={...})

    ``writer`` is built by the caller for ``dst`` with every setting that makes the output;
    the destination points it at its work directory (``dst``, or ``.DST.flashnext-new`` beside
    it with ``force``) and starts it. ``lock``: a :class:`DestinationLock` on ``dst`` the caller
    already holds (and releases), e.g. taken before a long read of the source so that a second
    writer is refused at once; without it the destination takes its own. See the module
    docstring for the rules.

    Raises:
        SidecarError: the rule refuses ``dst`` (an input, ``.``, ...), another process holds
            it, or it holds something else and ``force`` is not set (the message names what).
    """

    def __init__(
        self,
        dst: str | os.PathLike[str],
        writer: TableWriter,
        *,
        force: bool = False,
        inputs: Iterable[str | os.PathLike[str]] = (),
        lock: DestinationLock | None = None,
    ) -> None:
        self.dst = real_destination(dst)
        self.stage = self.dst.with_name(f".{self.dst.name}.flashnext-new")
        self._old = self.dst.with_name(f".{self.dst.name}.flashnext-old")
        self._writer = writer
        self._force = force
        self._inputs = list(inputs)
        self._own_lock = lock is None
        self._lock = lock or DestinationLock(self.dst)
        if self._lock.dst != self.dst:
            raise SidecarError(f"{self._lock.path}: a lock for another destination than {self.dst}")
        self.workdir = self.dst
        self.kept: dict[int, dict[str, Any]] = {}
        self.finished = False  # the destination already is this exact output

    def __enter__(self) -> SidecarDestination:
        problem = destination_problem(self.dst, self._inputs)
        if problem:
            raise SidecarError(problem)
        if self._own_lock:
            self._lock.acquire()
        elif not self._lock.held:
            raise SidecarError(f"{self._lock.path}: the caller's lock is not held")
        try:
            self._decide()
        except BaseException:
            self._release()
            raise
        return self

    def _release(self) -> None:
        if self._own_lock:
            self._lock.release()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
                self._free_stage()
        finally:
            self._release()

    @property
    def replaces(self) -> bool:
        """Whether the output is written beside ``dst`` and swapped in (``force``)."""
        return self.workdir != self.dst

    @property
    def todo(self) -> list[int]:
        """Shard indices still to write (empty when the destination is already finished)."""
        if self.finished:
            return []
        return [i for i in self._writer.indices if i not in self.kept]

    def start(self) -> TableWriter:
        """Remove temporaries a killed run left, mark the work directory unfinished."""
        self._writer.path = self.workdir
        self._remove_own_temps()
        self._writer.start(self.kept)
        return self._writer

    def adopt(self, record: Mapping[str, Any]) -> None:
        """Count a shard written into :attr:`workdir` (by a worker) as done."""
        self._writer.adopt(record)

    def commit(self, quantization: Mapping[str, Any] | None = None) -> Sidecar:
        """Finish the sidecar (META.json, state record gone) and swap it in when replacing."""
        if self.finished:
            return open_sidecar(self.dst)
        sidecar = self._writer.finish(quantization)
        if not self.replaces:
            return sidecar
        shutil.rmtree(self._old, ignore_errors=True)
        if self.dst.exists():
            os.replace(self.dst, self._old)
        os.replace(self.workdir, self.dst)
        shutil.rmtree(self._old, ignore_errors=True)
        return open_sidecar(self.dst)

    # -- refuse or adopt what is there -------------------------------------------------------
    def _decide(self) -> None:
        found = self._existing(self.dst)
        if found.refusal is None:
            self.kept, self.finished = found.kept, found.finished
            return
        if not self._force:
            raise SidecarError(
                f"{self.dst}: {found.refusal}. Refusing to overwrite it: choose a new or empty "
                "directory, or pass --force to replace it (the old contents stay until the new "
                "table is complete)"
            )
        not_a_table = _not_a_table(self.dst)
        if not_a_table:
            raise SidecarError(
                f"{self.dst}: {not_a_table}; --force replaces a sidecar table, not a folder of "
                "other things: choose a directory for this table (e.g. one inside it) or empty "
                "it yourself"
            )
        staged = self._existing(self.stage)
        if staged.refusal is not None:
            if not all(self._own(n, 1 << 20) for n in _listing(self.stage)):
                raise SidecarError(f"{self.stage}: {staged.refusal}; remove it")
            shutil.rmtree(self.stage, ignore_errors=True)  # an earlier --force run's leftovers
            staged = _Existing({}, False, None)
        self.workdir = self.stage
        self.kept = staged.kept

    def _existing(self, directory: Path) -> _Existing:
        """What ``directory`` holds: this run's own output (the shards to keep, whether
        finished), or something else (``refusal`` says what, in words)."""
        names = _listing(directory)
        if not names:
            return _Existing({}, False, None)
        params = self._writer.params
        found = _found(directory)
        num_shards = self._writer.num_shards
        most = max([num_shards, *(i + 1 for i in found.shards)])
        foreign = [n for n in names if not self._own(n, most)]
        there = []
        if found.status and found.params != params:
            article = "an" if found.status == "unfinished" else "a"
            there.append(
                f"{article} {found.status} table that differs "
                f"({_differences(found.params, params)})"
            )
        if foreign:
            more = f" and {len(foreign) - 5} more" if len(foreign) > 5 else ""
            there.append(f"files this command did not write ({', '.join(foreign[:5])}{more})")
        if not found.status and not foreign:
            there.append(f"{', '.join(names[:3])} but no flashnext {META_NAME} or run state")
        if there:
            return _Existing({}, False, "holds " + " and ".join(there))
        kept = {}
        for index, record in found.shards.items():
            path = directory / shard_name(index)
            ok = 0 <= index < num_shards and path.is_file()
            if ok and sha256_file(path) == record.get("sha256"):
                kept[index] = dict(record)
        whole = all(i in kept for i in self._writer.indices)
        return _Existing(kept, found.status == "finished" and whole, None)

    @staticmethod
    def _ours(name: str, num_shards: int) -> bool:
        """Whether a file name is one this writer creates (shards, META, state, their temps)."""
        if is_temp_name(name):
            name = final_name(name)
        index = shard_index(name)
        return name in (META_NAME, STATE_NAME) or (index is not None and index < num_shards)

    def _own(self, name: str, num_shards: int) -> bool:
        """:meth:`_ours`, or another file this destination's writer creates (a slice's profile)."""
        final = final_name(name) if is_temp_name(name) else name
        return self._ours(name, num_shards) or final in self._writer.extra_names

    def _remove_own_temps(self) -> None:
        """Temporary files a killed run left (only names this writer creates)."""
        for name in _listing(self.workdir):
            if is_temp_name(name) and self._own(name, self._writer.num_shards):
                (self.workdir / name).unlink(missing_ok=True)

    def _free_stage(self) -> None:
        """A ``force`` run that ran out of space: its partial table only holds the space."""
        if self.replaces:
            shutil.rmtree(self.workdir, ignore_errors=True)


def progress_kept(dst: str | os.PathLike[str]) -> str:
    """What an interrupted write of the sidecar ``dst`` left, in words, and how to go on: the
    shards its run state records as finished (in ``dst`` or, for ``--force``, beside it)."""
    real = real_destination(dst)
    for where in (real.with_name(f".{real.name}.flashnext-new"), real):
        try:
            state = read_state(where)
        except SidecarError:
            continue
        if state is None:
            continue
        done = state.get("shards")
        total = state.get("num_shards")
        n = len(done) if isinstance(done, dict) else 0
        of = f" of {total}" if isinstance(total, int) else ""
        return (
            f"{n}{of} shards are written and kept in {where}; run the same command again to "
            "resume (finished shards are checked and kept, not redone)"
        )
    return f"nothing of {real} was written yet; run the same command again to start"


def recorded_source(directory: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The ``source`` a sidecar writer recorded in ``directory`` (finished or not), or None
    when the directory holds anything a sidecar writer does not write, or no record at all.

    Lets a command that rebuilds its own tables (the demo) tell them from anything else.
    """
    root = Path(directory)
    names = _listing(root)
    if not names or not all(SidecarDestination._ours(n, 1 << 20) for n in names):
        return None
    found = _found(root)
    source = (found.params or {}).get("source")
    return dict(source) if isinstance(source, Mapping) else None


def _listing(directory: Path) -> list[str]:
    if not directory.exists() and not directory.is_symlink():
        return []
    if not directory.is_dir():
        raise SidecarError(
            f"{directory}: exists and is not a directory; choose another destination"
        )
    try:
        return sorted(p.name for p in directory.iterdir())
    except OSError as exc:
        raise SidecarError(f"{directory}: cannot list ({exc.strerror})") from None


def _not_a_table(directory: Path) -> str | None:
    """Why ``--force`` must not replace ``directory`` (None: it is a sidecar table, finished,
    unfinished or another tool's): a table is files only, shards or META.json among them. A
    folder of tables (``ple/layer_11``, ``ple/layer_23``) or of anything else is refused."""
    names = _listing(directory)
    subdirs = [n for n in names if (directory / n).is_dir()]
    if subdirs:
        more = f" and {len(subdirs) - 3} more" if len(subdirs) > 3 else ""
        return f"holds directories ({', '.join(subdirs[:3])}{more}), which a sidecar never has"
    if not any(SidecarDestination._ours(n, 1 << 20) for n in names):  # no table file at all
        more = " ..." if len(names) > 3 else ""
        return f"holds {', '.join(names[:3])}{more} but no shard_N.safetensors or {META_NAME}"
    return None


def _found(directory: Path) -> _Found:
    """What an earlier run left: its status, its params and its shards' records."""
    try:
        state = read_state(directory)
    except SidecarError:
        return _Found("unfinished", None, {})
    if state is not None:
        done = state.get("shards")
        shards = done if isinstance(done, dict) else {}
        return _Found("unfinished", state.get("params"), {int(k): v for k, v in shards.items()})
    try:
        meta = read_meta(directory)
    except SidecarError:
        return _Found("", None, {})
    if not meta:
        return _Found("", None, {})
    params = {"settings": meta.get("settings"), "source": meta.get("source")}
    if "slice" in meta:  # some ranks' shards: which ranks is part of what the output is
        params["slice"] = meta["slice"]
    listed = meta.get("shards")
    shards = {}
    for i, record in enumerate(listed if isinstance(listed, list) else []):
        if isinstance(record, dict):  # a slice lists only the shards it holds: the file says which
            index = shard_index(str(record.get("file", "")))
            shards[i if index is None else index] = record
    return _Found("finished", params, shards)


def _differences(old: Mapping[str, Any] | None, new: Mapping[str, Any]) -> str:
    """What changed between two runs' params, in words."""
    if not isinstance(old, Mapping):
        return "made by another version or tool"

    def mapping(value: Any) -> Mapping[str, Any]:
        return value if isinstance(value, Mapping) else {}

    out = []
    old_settings = mapping(old.get("settings"))
    for key, value in mapping(new.get("settings")).items():
        if old_settings.get(key) != value:
            out.append(f"{key} {old_settings.get(key)!r} -> {value!r}")
    if old.get("slice") != new.get("slice"):
        out.append(f"slice {old.get('slice')} -> {new.get('slice')}")
    old_src, new_src = mapping(old.get("source")), mapping(new.get("source"))
    if old_src.get("path") != new_src.get("path"):
        out.append(f"source {old_src.get('path')} -> {new_src.get('path')}")
    elif old_src != new_src:
        old_files = mapping(old_src.get("files"))
        changed = [n for n, v in new_src.get("files", {}).items() if old_files.get(n) != v]
        out.append(f"source changed since ({', '.join(changed[:3]) or 'its description'})")
    return (
        "; ".join(out[:3] + (["..."] if len(out) > 3 else [])) or "made by another version or tool"
    )

"""Memory maps of table files and the page cache behind them.

What Python's ``mmap`` module lacks: which pages of a map are in the page cache
(``mincore``), and ``madvise`` without holding the GIL (``mmap.madvise`` holds it, so a
``MADV_POPULATE_READ`` that reads 16 MiB from disk stalls every other Python thread, the
lookups' callers included). Linux and macOS; elsewhere ``cached_pages`` gives None and
``advise`` falls back to ``mmap.madvise``. And :class:`Warming`, which brings byte ranges of
files into the page cache in 2 MiB folios (what ``PLETable.warm`` and the hot tier's load run).
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

#: A PMD page on x86-64 and arm64 with 4 KiB pages.
HUGE_PAGE = 2 << 20
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux's value


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:  # Windows
        return None
    if not hasattr(libc, "mincore"):
        return None
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def _address(view: mmap.mmap) -> int:
    """The address of ``view``'s first byte (``view`` must not be empty)."""
    probe = np.frombuffer(view, np.uint8, count=1)
    address = int(probe.ctypes.data)
    del probe  # a map cannot close while an array holds it
    return address


def cached_pages(view: mmap.mmap) -> np.ndarray | None:
    """uint8 [pages of ``view``]: 1 where the page is in the page cache, or None where
    ``mincore`` is unavailable or fails."""
    libc = _libc()
    if libc is None or len(view) == 0:
        return None
    vec = np.zeros(-(-len(view) // mmap.PAGESIZE), np.uint8)
    if libc.mincore(ctypes.c_void_p(_address(view)), len(view), vec.ctypes.data) != 0:
        return None
    return vec & 1


def will_need(pages: np.ndarray) -> None:
    """Ask the kernel to start reading the pages at addresses ``pages`` (int64, page-aligned,
    mapped) now, all at once (``MADV_WILLNEED``, asynchronous): the page faults that follow
    then wait on reads already in flight together instead of issuing one 4 KiB read each, in
    turn. Best effort: a no-op where ``madvise`` is unavailable or refuses."""
    libc = _libc()
    if libc is None:
        return
    willneed = mmap.MADV_WILLNEED
    for address in pages.tolist():
        libc.madvise(ctypes.c_void_p(address), mmap.PAGESIZE, willneed)


def touch_pages(buf: Any, offset: int = 0, length: int | None = None) -> int:
    """Read one byte of every page of ``buf[offset : offset + length]`` (bytes; ``buf`` a map or
    a contiguous array; ``offset`` page-aligned; ``length`` None = to the end).

    In a virtual machine the hypervisor maps a guest page into its own (second-level) page
    tables only when the guest's CPU first touches it. Pages the disk filled by DMA (the
    readahead behind ``MADV_POPULATE_READ``) are cached and mapped in the guest with no guest
    fault left, yet each costs an exit of ~1-2.5 us on its first access, which no guest fault
    counter shows: right after warming a 5 GB table, decode steps of 512 ids took 1.3 ms
    instead of 80 us on this project's VM, recovering only over ~40 s as lookups touched the
    pages (issue 26). Touched here, in the warmer, each page costs that once (~1 us in a VM,
    ~0.1 us on bare metal) off the lookups' path. numpy's strided sum runs without the GIL.

    Returns:
        The pages touched (the range is clipped to the buffer's end).
    """
    with memoryview(buf) as whole:
        size = whole.nbytes
    length = size - offset if length is None else min(length, size - offset)
    if length <= 0:
        return 0
    pages = np.frombuffer(buf, np.uint8, count=length, offset=offset)[:: mmap.PAGESIZE]
    int(pages.sum(dtype=np.uint64))
    touched = pages.size
    del pages  # a map cannot close while an array holds it
    return touched


def advise(view: mmap.mmap, advice: int, offset: int = 0, length: int | None = None) -> None:
    """``view.madvise(advice, offset, length)``, with the GIL released during the call
    (ctypes releases it). ``offset`` must be a multiple of the page size.

    Raises:
        OSError: the kernel refused the advice (e.g. ``EINVAL`` for an advice it lacks).
    """
    size = len(view) - offset if length is None else min(length, len(view) - offset)
    if size <= 0:
        return
    libc = _libc()
    if libc is None:
        view.madvise(advice, offset, size)
        return
    if libc.madvise(ctypes.c_void_p(_address(view) + offset), size, advice) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"madvise({advice}) failed: {os.strerror(errno)}")


class Warming:
    """Reads byte ranges of files so the kernel caches them; see :meth:`PLETable.warm`."""

    CHUNK = 16 << 20

    def __init__(
        self,
        ranges: list[tuple[Path, int, int]],
        progress: Callable[[int], None] | None = None,
        then: Callable[[], None] | None = None,
        maps: Mapping[Path, mmap.mmap] | None = None,
    ):
        self.ranges = ranges
        self._then = then
        self._maps = dict(maps or {})  # the table's maps of these files, by path
        self.total_bytes = sum(length for _, _, length in ranges)
        self.bytes_read = 0
        self.error: BaseException | None = None
        self._progress = progress
        self._thread: threading.Thread | None = None
        self._done = threading.Event()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name="flashnext-warm", daemon=True)
        self._thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until warming ends (or ``timeout`` seconds); re-raise its error. True = done."""
        finished = self._done.wait(timeout)
        if self.error is not None:
            raise self.error
        return finished

    def run(self) -> None:
        """Bring every range into the page cache, in ``CHUNK`` pieces, then call ``then``."""
        try:
            for path, offset, length in self.ranges:
                with open(path, "rb", buffering=0) as fh:
                    if not self._fault_in(fh, offset, length, self._maps.get(path)):
                        self._read(fh, offset, length)
            if self._then is not None:
                self._then()
        except BaseException as exc:  # reported by wait()
            self.error = exc
        finally:
            self._done.set()

    def _advance(self, got: int) -> None:
        self.bytes_read += got
        if self._progress is not None:
            self._progress(got)

    def _fault_in(
        self, fh: Any, offset: int, length: int, table_map: mmap.mmap | None = None
    ) -> bool:
        """Fault the range in through a temporary map advised ``MADV_HUGEPAGE``: the kernel
        then reads it in 2 MiB folios (where the filesystem has large folios), which later
        maps of the file, the table's included, get as huge pages. Plain reads build
        folios up from small ones and reach 2 MiB only tens of MB into a file. Each piece's
        pages are then touched (:func:`touch_pages`: a VM's first-touch cost). False where
        the kernel cannot (another OS, Linux < 5.14): the caller reads instead.

        Pieces already cached in part (the header read at open, rows that lookups faulted in
        meanwhile) hold small folios and are dropped and read again first. The map is also
        advised ``MADV_RANDOM``: no readahead beyond the 2 MiB asked for, which would fill
        the next such piece with small folios (and a piece under I/O cannot be dropped).
        ``table_map``: the table's own map of the file, which lets go of those pieces."""
        if length <= 0:
            return True  # nothing to bring in
        if not hasattr(mmap, "MADV_HUGEPAGE"):
            return False
        huge = HUGE_PAGE
        base = offset // huge * huge
        end = offset + length
        # the map reaches to the end of the last 2 MiB piece the range touches, so that a
        # piece it shares with the next range is seen whole by _partly_cached
        reach = min(-(-end // huge) * huge, os.fstat(fh.fileno()).st_size)
        try:
            view = mmap.mmap(fh.fileno(), reach - base, access=mmap.ACCESS_READ, offset=base)
        except (OSError, ValueError):
            return False
        try:
            view.madvise(mmap.MADV_HUGEPAGE)
            view.madvise(mmap.MADV_RANDOM)
            first = (offset - base) // mmap.PAGESIZE * mmap.PAGESIZE
            started = False
            # piece by piece, each checked right before it is read: a lookup meanwhile (its
            # faults, its read-ahead while warming) may have cached part of it in 4 KiB
            # folios, which would keep the 2 MiB folio out
            pos = first
            while pos < end - base:
                step = min(huge - pos % huge, end - base - pos)
                try:
                    for piece in self._partly_cached(view, pos // huge * huge):
                        self._reread(fh, view, base, piece, table_map)
                    advise(view, MADV_POPULATE_READ, pos, step)
                    touch_pages(view, pos, step)
                except OSError:
                    if not started:
                        return False  # nothing done yet: read instead
                    raise
                started = True
                self._advance(pos + step - max(pos, offset - base))
                pos += step
        finally:
            view.close()
        return True

    @staticmethod
    def _partly_cached(view: mmap.mmap, piece: int | None = None) -> list[int]:
        """Offsets in ``view`` of its 2 MiB pieces (or of the one at offset ``piece``) of
        which some but not all pages are cached: a 2 MiB folio is cached whole or not at
        all, so these hold small folios and would stay on 4 KiB pages. The file's last
        piece, when it is not a whole 2 MiB, is left out: it cannot be huge. Empty where
        ``mincore`` is unavailable."""
        huge = HUGE_PAGE
        cached = cached_pages(view)
        if cached is None:
            return []
        per = huge // mmap.PAGESIZE
        whole = len(view) // huge
        counts = cached[: whole * per].reshape(whole, per).sum(axis=1, dtype=np.int64)
        found = [int(k) * huge for k in np.flatnonzero((counts > 0) & (counts < per))]
        return found if piece is None else [p for p in found if p == piece]

    @staticmethod
    def _reread(
        fh: Any, view: mmap.mmap, base: int, piece: int, table_map: mmap.mmap | None
    ) -> None:
        """Drop the 2 MiB piece at offset ``piece`` of ``view`` (file offset ``base +
        piece``) from the page cache and fault it in again as one folio. ``table_map`` lets
        go of the piece first, as the kernel keeps pages that are mapped; a lookup meanwhile
        faults them back from the page cache."""
        huge = HUGE_PAGE
        if table_map is not None:
            table_map.madvise(mmap.MADV_DONTNEED, base + piece, huge)
        os.posix_fadvise(fh.fileno(), base + piece, huge, os.POSIX_FADV_DONTNEED)
        advise(view, MADV_POPULATE_READ, piece, huge)

    def _read(self, fh: Any, offset: int, length: int) -> None:
        """Advise, then read the range into one reused buffer (no anonymous copy)."""
        buf = bytearray(min(self.CHUNK, length))
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fh.fileno(), offset, length, os.POSIX_FADV_WILLNEED)
        fh.seek(offset)
        left = length
        while left > 0:
            got = fh.readinto(memoryview(buf)[: min(left, self.CHUNK)])
            if not got:
                break
            left -= got
            self._advance(got)

"""Read-ahead hints for a staged step's rows on a cold page cache (the ``cold_hints`` knob).

A memory-mapped table whose pages are not in the page cache faults them in one at a time per
gathering thread: the disk sees one 4 KiB read at a time. vLLM's own disk offload queues the
whole step first (``POSIX_FADV_WILLNEED``, then ``preadv``). :func:`hint_rows` does the same
for the rows a step still has to gather (after the device cache's hit index / memo, before
the gather): their pages, coalesced into runs, each given one ``madvise(MADV_WILLNEED)``,
which starts the reads and returns. On the H200 (BENCHMARKS.md) that made nvfp4 cold steps
x1.0-2.5 of vLLM's speed instead of x0.8-2.1; on a warm table the same calls made a step x8-13
slower (madvise walks every run's pages even when all are cached; a T = 32 step on the
development VM: ~26 us unhinted, ~8 ms hinted). So the default is off, and :class:`FaultWatch`
(mode ``"auto"``) hints only while the process takes major page faults.
"""

from __future__ import annotations

import ctypes
import mmap
import resource

import numba
import numpy as np

MADV_WILLNEED = 3  # linux/mman.h
PAGE = mmap.PAGESIZE
MODES = ("off", "on", "auto")

_libc = ctypes.CDLL(None, use_errno=True)
_madvise = _libc.madvise
# addresses as size_t: numba calls ctypes functions with integer arguments only
_madvise.argtypes = [ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int]
_madvise.restype = ctypes.c_int


@numba.njit(nogil=True, cache=True)
def page_runs(uniq, n, seg_start, bases, row_bytes, page, runs):  # type: ignore[no-untyped-def]
    """The pages holding the stored bytes of rows ``uniq[:n]`` (int64; rows with no segment
    are never passed: the dedup drops them) as sorted, disjoint, non-adjacent runs of page
    addresses ``[start, end)`` in ``runs`` (int64 ``[>= n * F, 2]``); returns the run count.

    ``seg_start`` int64 [S], ``bases`` int64 [F, S], ``row_bytes`` int64 [F] as the gathers'
    (``gather.RowAddresses``); ``page`` a power of two.
    """
    mask = page - 1
    k = 0
    for j in range(n):
        row = uniq[j]
        s = np.searchsorted(seg_start, row, "right") - 1
        for f in range(row_bytes.size):
            addr = bases[f, s] + (row - seg_start[s]) * row_bytes[f]
            runs[k, 0] = addr & ~mask
            runs[k, 1] = (addr + row_bytes[f] + mask) & ~mask
            k += 1
    if k == 0:
        return 0
    order = np.argsort(runs[:k, 0])
    starts, ends = runs[:k, 0][order], runs[:k, 1][order]  # copies: runs is rewritten below
    m = 0
    start, end = starts[0], ends[0]
    for i in range(1, k):
        if starts[i] <= end:  # overlapping or adjacent: one run
            end = max(end, ends[i])
        else:
            runs[m, 0], runs[m, 1] = start, end
            m += 1
            start, end = starts[i], ends[i]
    runs[m, 0], runs[m, 1] = start, end
    return m + 1


# Not cached: it calls libc through an address numba bakes into the machine code.
@numba.njit(nogil=True)
def _advise(runs, m):  # type: ignore[no-untyped-def]
    for i in range(m):
        _madvise(runs[i, 0], runs[i, 1] - runs[i, 0], MADV_WILLNEED)


def hint_rows(
    uniq: np.ndarray,
    n: int,
    seg_start: np.ndarray,
    bases: np.ndarray,
    row_bytes: np.ndarray,
    runs: np.ndarray,
) -> int:
    """Start reading the pages of rows ``uniq[:n]`` (:func:`page_runs`' arguments) with one
    ``madvise(MADV_WILLNEED)`` per run; returns the run count. It does not wait for the reads:
    the gather that follows waits on each page, while the disk works on all of them."""
    m = page_runs(uniq, n, seg_start, bases, row_bytes, PAGE, runs)
    _advise(runs, m)
    return int(m)


def major_faults() -> int:
    """Major page faults of this process so far (all threads)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_majflt


class FaultWatch:
    """Whether a step hints its rows' pages (mode ``"auto"`` of ``cold_hints``).

    It starts on: a table's first steps are the ones most likely cold (after a start, the
    bench's cold section; on the H200 a watch that started off left the first two cold steps
    unhinted). While on, it reads the major fault count every step and switches off after
    ``off_after`` steps in a row without one; while off, it reads it every ``every`` steps (a
    warm decode step of ~30 us then pays a getrusage call, ~1 us, every ``every`` steps) and
    switches on when it grew (the hinted reads leave the gather only minor faults, so a table
    that stays cold comes back on within ``every`` steps).
    """

    def __init__(self, every: int = 8, off_after: int = 64, faults=major_faults):  # type: ignore[no-untyped-def]
        self.every, self.off_after, self._faults = int(every), int(off_after), faults
        self.on = True
        self._last = faults()
        self._count = 0  # steps since the last read (off) / quiet steps in a row (on)

    def step(self) -> bool:
        """Called once per step before its gather: whether this step hints."""
        if not self.on:
            self._count += 1
            if self._count < self.every:
                return False
            self._count = 0
        now = self._faults()
        faulted, self._last = now > self._last, now
        if faulted:
            self.on, self._count = True, 0
        elif self.on:
            self._count += 1
            if self._count >= self.off_after:
                self.on, self._count = False, 0
        return self.on

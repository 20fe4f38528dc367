"""The staged path's gather: unique rows' stored bytes into records (numba, nogil).

Where rows live is given as addresses (the table's arrays must stay alive during a call):
``seg_start`` int64 [S] global first row of each stored segment (sorted, contiguous), with
``seg_dir``/``seg_shift`` a directory that finds a row's segment without a binary search
(:func:`segment_directory`), ``bases`` int64 [F, S] address of field ``f``'s row
``seg_start[s]``, ``row_bytes`` and ``field_off`` int64 [F] the field's bytes per row and
offset in the record. The slot is passed whole as ``words`` (int32) and ``fwords`` (float32,
the same bytes): ``inverse`` is ``words[:n]``, ``scale_2`` starts at float ``s2_at``, records
at byte ``rec_at``.

:func:`gather_into` copies each unique row's stored bytes, tensor by tensor, straight into
its record (prefetching a few rows ahead), and its per-shard scalar into the slot's
``scale_2``; :func:`gather_parallel` splits a big step's rows over numba's threads (each core
walks its own page tables: random rows of a memory map are bound by page walks, not
bandwidth).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numba
import numpy as np

from flashnext.errors import KernelError
from flashnext.host.mapping import touch_pages
from flashnext.host.table import PLETable, StoredTable
from flashnext.kernels.records import RecordLayout
from flashnext.numba_intrinsics import memcpy, prefetch

AHEAD = 32  # rows prefetched ahead of the copy (random page-cache reads: latency-bound)
#: Unique rows per gather thread at least (fewer: handing work out costs more than it saves).
CHUNK_ROWS = 64


@numba.njit(nogil=True, cache=True, inline="always")
def segment(row, seg_start):  # type: ignore[no-untyped-def]
    """Index of the last segment starting at or before ``row`` (binary search)."""
    return _search(row, seg_start, 0, seg_start.size)


@numba.njit(nogil=True, cache=True, inline="always")
def _search(row, seg_start, lo, hi):  # type: ignore[no-untyped-def]
    """The last of segments ``lo..hi-1`` starting at or before ``row`` (binary search)."""
    while hi - lo > 1:
        mid = (lo + hi) >> 1
        if seg_start[mid] <= row:
            lo = mid
        else:
            hi = mid
    return lo


def segment_directory(seg_start: np.ndarray, end: int) -> tuple[np.ndarray, int]:
    """A directory of the segments starting at ``seg_start`` (int64 [S], ascending) and
    ending at row ``end``: ``dir[b]`` is the segment of row ``seg_start[0] + (b << shift)``,
    with 4 to 8 blocks per segment on average (int64 ``[D + 1]``, the last for ``end``).

    A row of block ``b`` lies in one of segments ``dir[b]..dir[b + 1]`` (:func:`_find`):
    with segments of one size that is one or two, so a row's segment costs a shift and at
    most one comparison instead of a 7-step binary search over 128 shards (mispredicted
    branches: a decode step's gather of ~80 rows took 9.6 us with the search, 6.7 with the
    directory, on the 2-vCPU development VM).
    """
    if seg_start.size == 0:  # nothing stored: no row is ever looked up
        return np.zeros(2, np.int64), 0
    first = int(seg_start[0])
    span = max(1, int(end) - first)
    shift = max(0, (span // (4 * seg_start.size)).bit_length() - 1)
    starts = first + (np.arange(-(-span // (1 << shift)) + 1, dtype=np.int64) << shift)
    seg_dir = np.searchsorted(seg_start, np.minimum(starts, end - 1), "right") - 1
    return seg_dir.astype(np.int64), shift


@numba.njit(nogil=True, cache=True, inline="always")
def _find(row, seg_start, seg_dir, shift):  # type: ignore[no-untyped-def]
    """Index of the segment holding ``row`` through :func:`segment_directory`'s directory."""
    b = (row - seg_start[0]) >> shift
    return _search(row, seg_start, seg_dir[b], seg_dir[b + 1] + 1)


@numba.njit(nogil=True, cache=True, inline="always")
def _prefetch_row(row, seg_start, seg_dir, seg_shift, bases, row_bytes):  # type: ignore[no-untyped-def]
    """Hint the CPU to load every stored byte of ``row`` (its first and last line per field)."""
    s = _find(row, seg_start, seg_dir, seg_shift)
    for f in range(row_bytes.size):
        addr = bases[f, s] + (row - seg_start[s]) * row_bytes[f]
        prefetch(addr)
        prefetch(addr + row_bytes[f] - 1)


@numba.njit(nogil=True, cache=True)
def gather_records(  # type: ignore[no-untyped-def]
    uniq, a, b, seg_start, seg_dir, seg_shift, bases, row_bytes, field_off, records,
    shard_starts, scalars, s2,
):  # fmt: skip
    """Copy rows ``uniq[a:b]`` into ``records[a:b]`` (uint8 ``[n, R]``); ``s2[a:b]`` gets each
    row's per-shard scalar when ``s2`` is non-empty (``shard_starts``/``scalars`` [K])."""
    dst = np.int64(records.ctypes.data)
    gather_into(uniq, a, b, seg_start, seg_dir, seg_shift, bases, row_bytes, field_off, dst,
                records.shape[1], shard_starts, scalars, s2, 0)  # fmt: skip


@numba.njit(nogil=True, cache=True)
def gather_into(  # type: ignore[no-untyped-def]
    uniq, a, b, seg_start, seg_dir, seg_shift, bases, row_bytes, field_off, dst, rec_bytes,
    shard_starts, scalars, fwords, s2_at, depth=AHEAD,
):  # fmt: skip
    """Copy rows ``uniq[a:b]`` into the records at address ``dst`` (``rec_bytes`` each,
    record ``j`` for row ``uniq[j]``), prefetching ``depth`` rows ahead; ``fwords[s2_at + j]``
    gets each row's per-shard scalar when ``scalars`` is non-empty (``shard_starts``/``scalars``
    [K])."""
    n_f = row_bytes.size
    # the prefetch-ahead loop written out, as in every dedup loop (kernels/dedup.py): one
    # helper taking the touch function and its arrays in a tuple cost 10-15% here (2048-id
    # steps) and 1-4% of a graph-staged decode step on the H200 (BENCHMARKS.md#redesign-remeasure)
    for j in range(a, min(b, a + depth)):
        _prefetch_row(uniq[j], seg_start, seg_dir, seg_shift, bases, row_bytes)
    for j in range(a, b):
        if j + depth < b:
            _prefetch_row(uniq[j + depth], seg_start, seg_dir, seg_shift, bases, row_bytes)
        row = uniq[j]
        s = _find(row, seg_start, seg_dir, seg_shift)
        rec = dst + j * rec_bytes
        for f in range(n_f):
            nb = row_bytes[f]
            memcpy(rec + field_off[f], bases[f, s] + (row - seg_start[s]) * nb, nb)
        if scalars.size:
            fwords[s2_at + j] = scalars[segment(row, shard_starts)]


@numba.njit(nogil=True, cache=True, parallel=True)
def gather_parallel(  # type: ignore[no-untyped-def]
    uniq, n_unique, chunk_rows, max_chunks, seg_start, seg_dir, seg_shift, bases, row_bytes,
    field_off, dst, rec_bytes, shard_starts, scalars, fwords, s2_at, depth=AHEAD,
):  # fmt: skip
    """:func:`gather_into` of ``uniq[:n_unique]`` split into chunks of at least
    ``chunk_rows`` rows, at most ``max_chunks``, gathered on numba's threads."""
    chunks = max(1, min(max_chunks, n_unique // chunk_rows))
    for c in numba.prange(chunks):
        a = n_unique * c // chunks
        b = n_unique * (c + 1) // chunks
        gather_into(uniq, a, b, seg_start, seg_dir, seg_shift, bases, row_bytes, field_off,
                    dst, rec_bytes, shard_starts, scalars, fwords, s2_at, depth)  # fmt: skip


# -- where a table's rows live, for the gathers (numpy) ---------------------------------
@dataclass(frozen=True)
class RowAddresses:
    """Where a table's stored rows live, as the numba gathers read them (see the module).

    ``keep`` holds the arrays whose addresses ``bases`` records; :attr:`rows` and
    :attr:`shards` are the gathers' arguments in their order.
    """

    seg_start: np.ndarray  # int64 [S]
    seg_dir: np.ndarray  # int64 [D + 1] (segment_directory)
    seg_shift: int
    bases: np.ndarray  # int64 [F, S]
    row_bytes: np.ndarray  # int64 [F]
    field_off: np.ndarray  # int64 [F]
    shard_starts: np.ndarray  # int64 [K]
    scalars: np.ndarray  # float32 [K] (per-shard scale_2; empty when the format has none)
    keep: tuple[Any, ...]

    @property
    def rows(self) -> tuple[np.ndarray, np.ndarray, int, np.ndarray, np.ndarray, np.ndarray]:
        """Where rows live: ``seg_start, seg_dir, seg_shift, bases, row_bytes, field_off``."""
        return (self.seg_start, self.seg_dir, self.seg_shift, self.bases, self.row_bytes,
                self.field_off)  # fmt: skip

    @property
    def shards(self) -> tuple[np.ndarray, np.ndarray]:
        """Per-shard scalars: ``shard_starts, scalars``."""
        return self.shard_starts, self.scalars


def row_addresses(stored: StoredTable, layout: RecordLayout) -> RowAddresses:
    """The addresses of ``stored``'s per-row tensors, field by field of ``layout``.

    Raises:
        KernelError: a stored tensor's rows are not contiguous (a table always stores them so).
    """
    bases = np.empty((len(layout.fields), len(stored.segments)), np.int64)
    keep = []
    for s, seg in enumerate(stored.segments):
        for f, fld in enumerate(layout.fields):
            arr = np.asarray(seg.tensors[fld.spec.name])
            strided = arr.shape[0] > 1 and arr.strides[0] != fld.nbytes
            if strided or not arr[:1].flags.c_contiguous:
                raise KernelError(
                    f"{stored.format}: stored tensor {fld.spec.name} of rows {seg.start}.. has "
                    f"row stride {arr.strides[0]}, expected {fld.nbytes} contiguous bytes"
                )
            bases[f, s] = arr.ctypes.data
            keep.append(arr)
    s2_names = [s.name for s in stored.codec.specs if not s.per_row]
    scalars = (
        np.asarray(stored.shard_scalars[s2_names[0]], np.float32)
        if s2_names
        else np.empty(0, np.float32)
    )
    seg_start = np.array([seg.start for seg in stored.segments], np.int64)
    end = stored.segments[-1].start + stored.segments[-1].rows if stored.segments else 0
    seg_dir, seg_shift = segment_directory(seg_start, end)
    return RowAddresses(
        seg_start=seg_start,
        seg_dir=seg_dir,
        seg_shift=seg_shift,
        bases=bases,
        row_bytes=np.array([f.nbytes for f in layout.fields], np.int64),
        field_off=np.array([f.offset for f in layout.fields], np.int64),
        shard_starts=np.asarray(stored.shard_starts, np.int64),
        scalars=scalars,
        keep=tuple(keep),
    )


def prefault_pages(table: PLETable) -> None:
    """Map every page of the table's stored tensors into this process now, so that steps take
    no page faults: ``PLETable.populate_maps`` (on 2 MiB pages where the page cache holds 2 MiB
    folios, e.g. after ``PLETable.warm``), then one byte read per page (where the kernel
    lacks ``MADV_POPULATE_READ``; in a VM, also the first touch ``touch_pages`` explains)."""
    table.populate_maps()
    for seg in table.stored().segments:
        for arr in seg.tensors.values():
            touch_pages(np.asarray(arr).reshape(-1).view(np.uint8))

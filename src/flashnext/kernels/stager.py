"""The host work of a staged table: each step's ids into one of its staging slots (numba).

A step's ids become an ``inverse`` int32 index per id and the stored bytes of each unique row
as a record in the pinned staging slot (see :mod:`flashnext.kernels.staged` for the slot's
layout, :func:`flashnext.kernels._layout.slot_offsets` for its offsets):
:mod:`flashnext.kernels.dedup` deduplicates (:func:`stage_cached` behind a device cache,
:func:`stage_sorted` without one), :mod:`flashnext.kernels.gather` copies the rows.

One call does all of a small step's work on the calling thread (handing work to numba's
threads costs more than gathering a few hundred rows): :func:`stage_step`, which reads every
argument but the ids from the slot's step context (:class:`~flashnext.kernels._layout.StepContext`,
built once per slot); a step with more unique rows than ``serial_rows`` returns ``-(n + 1)``
and :meth:`HostStager.fill` gathers with :func:`~flashnext.kernels.gather.gather_parallel`.
The settings that trade one path for another are :class:`StageKnobs`, fixed at construction.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import numba
import numpy as np

from flashnext.errors import KernelError
from flashnext.host.table import StoredTable
from flashnext.kernels import _cold
from flashnext.kernels._layout import (
    AT,
    HIT_BLOCK,
    LAYOUT_ID,
    MEMO_LINES,
    STALE_LAYOUT,
    StepContext,
    rows_that_fit,
    slot_offsets,
)
from flashnext.kernels.dedup import (
    GROUP,
    POS_BITS,
    _classify,
    _hash_misses,
    build_hit_index,
    checked_memo_lines,
    classify,
    classify_grouped,
    dedup_misses,
    dedup_positions,
    new_memo,
    new_memo_lines,
    sort_keys,
    unique_sorted,
)
from flashnext.kernels.gather import (
    AHEAD,
    CHUNK_ROWS,
    gather_into,
    gather_parallel,
    gather_records,
    row_addresses,
)
from flashnext.kernels.records import RecordLayout
from flashnext.numba_intrinsics import ptr

#: Steps of at most this many unique rows (keys, without a cache) are deduplicated and gathered
#: in one numba call on the calling thread: waking numba's threads costs more than it saves.
SERIAL_ROWS = 256
#: Steps of at least this many ids look them up in the hit index on numba's threads first.
PARALLEL_IDS = 32768
#: Steps of at most this many ids dedup their cache misses in a hash table (32 KB), not the
#: slot map.
HASH_IDS = 4096

_slot_offsets = numba.njit(nogil=True, cache=True, inline="always")(slot_offsets)


@dataclass(frozen=True)
class StageKnobs:
    """The settings that choose a step's path (defaults: the measured best; benchmarks build
    a stager per setting they compare).

    Attributes:
        serial_rows: steps of at most this many unique rows gather on the calling thread
            (-1: every step on numba's threads).
        parallel_ids: steps of at least this many ids (behind a cache) read the hit index on
            numba's threads first.
        hash_ids: steps of at most this many ids dedup their misses in a small hash table,
            bigger ones through the slot map.
        chunk_rows: unique rows per gather thread at least.
        depth: rows prefetched ahead of the gather's copy.
        memo_lines: lines of the group memo of each device cache (0: none; else a power of
            two >= 2).
        workers: numba threads for a big step's gather (0: up to 8).
        cold_hints: ``"off"``, ``"on"`` or ``"auto"``: whether a step first asks the kernel to
            read the pages of the rows it gathers (:mod:`flashnext.kernels._cold`; auto: while
            the process takes major page faults).

    Raises:
        KernelError: an unknown ``cold_hints`` or a ``memo_lines`` that is not 0 or a power of
            two >= 2.
    """

    serial_rows: int = SERIAL_ROWS
    parallel_ids: int = PARALLEL_IDS
    hash_ids: int = HASH_IDS
    chunk_rows: int = CHUNK_ROWS
    depth: int = AHEAD
    memo_lines: int = MEMO_LINES
    workers: int = 0
    cold_hints: str = "off"

    def __post_init__(self) -> None:
        checked_memo_lines(self.memo_lines)
        if self.cold_hints not in _cold.MODES:
            raise KernelError(f"cold_hints is {self.cold_hints!r}, expected one of {_cold.MODES}")
        if self.workers <= 0:
            object.__setattr__(self, "workers", min(8, os.cpu_count() or 1))


# Every function that reads a context word (ctx[AT.name]) is inlined into stage_step: numba's
# disk cache keys on this file alone, so a kernel compiled for an older StepContext is caught
# by stage_step's layout check and all of it is recompiled at once (_restaged).
@numba.njit(nogil=True, cache=True, inline="always")
def _slot_of(ctx, n):  # type: ignore[no-untyped-def]
    """The staging slot of context ``ctx`` for a step of ``n`` ids: ``words`` (int32),
    ``fwords`` (float32, the same bytes), ``uniq``, and the float index of scale_2 and the byte
    offset of the records (:func:`slot_offsets`)."""
    words = numba.carray(ptr(ctx[AT.words]), ctx[AT.slot_words], np.int32)
    fwords = numba.carray(ptr(ctx[AT.words]), ctx[AT.slot_words], np.float32)
    uniq = numba.carray(ptr(ctx[AT.uniq]), ctx[AT.max_ids], np.int64)
    s2_at, rec_at = _slot_offsets(n, ctx[AT.n_scalars])
    return words, fwords, uniq, s2_at >> 2, rec_at


@numba.njit(nogil=True, cache=True, inline="always")
def _gather_step(ctx, uniq, n, fwords, s2_at, rec_at):  # type: ignore[no-untyped-def]
    """:func:`gather_into` of ``uniq[:n]`` into the slot of ``ctx``, where its table's rows
    live and its settings say (``s2_at`` a float index, ``rec_at`` a byte offset)."""
    fields, segments = ctx[AT.fields], ctx[AT.segments]
    seg_start = numba.carray(ptr(ctx[AT.seg_start]), segments, np.int64)
    seg_dir = numba.carray(ptr(ctx[AT.seg_dir]), ctx[AT.dir_size], np.int64)
    bases = numba.carray(ptr(ctx[AT.bases]), (fields, segments), np.int64)
    row_bytes = numba.carray(ptr(ctx[AT.row_bytes]), fields, np.int64)
    field_off = numba.carray(ptr(ctx[AT.field_off]), fields, np.int64)
    shard_starts = numba.carray(ptr(ctx[AT.shard_starts]), ctx[AT.shards], np.int64)
    scalars = numba.carray(ptr(ctx[AT.scalars]), ctx[AT.n_scalars], np.float32)
    dst = ctx[AT.words] + rec_at
    gather_into(uniq, 0, n, seg_start, seg_dir, ctx[AT.seg_shift], bases, row_bytes, field_off,
                dst, ctx[AT.rec_bytes], shard_starts, scalars, fwords, s2_at,
                ctx[AT.depth])  # fmt: skip


@numba.njit(nogil=True, cache=True, inline="always")
def stage_cached(ids, ctx):  # type: ignore[no-untyped-def]
    """One step behind a device cache (the context's): :func:`dedup_hashed` (at most
    ``hash_ids`` ids; classified through the group memo first, :func:`classify_grouped`,
    unless it has no line) or :func:`dedup_misses` into the slot's inverse, then, with at most
    ``serial_rows`` unique rows, the gather on this thread. Returns the unique count ``n``, or
    ``-(n + 1)`` when the caller still has to gather ``uniq[:n]``."""
    n_ids = ids.size
    lo, hi = ctx[AT.lo], ctx[AT.hi]
    words, fwords, uniq, s2_at, rec_at = _slot_of(ctx, n_ids)
    index = numba.carray(ptr(ctx[AT.hit_index]), (ctx[AT.blocks], 8), np.uint64)
    pos = numba.carray(ptr(ctx[AT.pos]), ctx[AT.max_ids], np.int64)
    if n_ids <= ctx[AT.hash_ids] and 2 * n_ids <= ctx[AT.hash_size]:
        table = numba.carray(ptr(ctx[AT.hash]), ctx[AT.hash_size], np.int32)
        memo = numba.carray(ptr(ctx[AT.memo]), (ctx[AT.memo_lines], 2 * GROUP), np.int32)
        if memo.shape[0]:
            scratch = numba.carray(ptr(ctx[AT.scratch]), ctx[AT.scratch_size], np.int64)
            shift = np.uint64(ctx[AT.memo_shift])
            k = classify_grouped(ids, lo, hi, index, memo, shift, words, pos, scratch)
        else:
            k = _classify(ids, 0, n_ids, lo, hi, index, words, pos, 0)
        n = _hash_misses(ids, k, table, words, uniq, pos)
    else:
        slot_map = numba.carray(ptr(ctx[AT.slot_map]), ctx[AT.map_rows], np.int32)
        n = dedup_misses(ids, lo, hi, index, slot_map, words, uniq, pos)
    if n > ctx[AT.serial_rows]:
        return -(n + 1)
    _gather_step(ctx, uniq, n, fwords, s2_at, rec_at)
    return n


@numba.njit(nogil=True, cache=True, inline="always")
def stage_sorted(ids, ctx):  # type: ignore[no-untyped-def]
    """One step without a cache: :func:`sort_keys` into the slot's inverse; with at most
    ``serial_rows`` keys also the sort (numba's), :func:`unique_sorted` and the gather on this
    thread. Returns the unique count, or ``-(m + 1)`` with the ``m`` keys unsorted (the
    caller sorts them, dedups and gathers)."""
    words, fwords, uniq, s2_at, rec_at = _slot_of(ctx, ids.size)
    keys = numba.carray(ptr(ctx[AT.keys]), ctx[AT.max_ids], np.int64)
    m = sort_keys(ids, ctx[AT.lo], ctx[AT.hi], keys, words)
    if m > ctx[AT.serial_rows]:
        return -(m + 1)
    part = keys[:m]
    part.sort()
    n = unique_sorted(part, words, uniq)
    _gather_step(ctx, uniq, n, fwords, s2_at, rec_at)
    return n


@numba.njit(nogil=True, cache=True)
def stage_step(ids, ctx):  # type: ignore[no-untyped-def]
    """:func:`stage_cached` (a cache is set) or :func:`stage_sorted` of ``ids`` (int64 [n],
    n <= the context's max ids), every other argument read from the step context ``ctx``
    (int64 [CONTEXT_WORDS], :class:`~flashnext.kernels._layout.StepContext`): the same return
    value, or ``STALE_LAYOUT`` for a context of another declaration (this compiled kernel is
    older than the declaration: :meth:`HostStager.fill` recompiles it)."""
    if ctx[AT.layout_id] != LAYOUT_ID:
        return STALE_LAYOUT
    if ctx[AT.cached]:
        return stage_cached(ids, ctx)
    return stage_sorted(ids, ctx)


# -- the host side of one staged table (numpy only: benchmarks run it without torch) ---------
def flat_ids(arr: np.ndarray) -> np.ndarray:
    """``arr`` as contiguous int64 ``[n]`` (a view when it already is int64 and contiguous)."""
    if arr.dtype == np.int64 and arr.flags.c_contiguous:
        return arr.reshape(-1)
    return np.ascontiguousarray(arr, dtype=np.int64).reshape(-1)


def align(n: int, k: int = 16) -> int:
    """``n`` rounded up to a multiple of ``k``."""
    return -(-n // k) * k


class HostStager:
    """The host work of a staged table: each step's ids into one of its staging slots.

    A slot (uint8, ``slot_bytes`` long, pinned by the GPU classes) holds
    ``[inverse int32 [n_ids] | scale_2 float32 [n_ids] (nvfp4) | records [n_unique, R]]``,
    each part 16-byte aligned (:meth:`offsets`). Everything a step needs is allocated here
    once; :meth:`fill` allocates nothing and builds no views.

    Args:
        stored: the table's stored tensors (memory-mapped or resident).
        layout: the record layout of its format.
        row_range: the rows served ``[lo, hi)``; other ids give ``inverse = -1``.
        max_ids: the most ids one step may stage.
        knobs: the settings that choose a step's path (:class:`StageKnobs`).

    Raises:
        KernelError: ``max_ids`` is above ``2 ** POS_BITS``.
    """

    def __init__(
        self,
        stored: StoredTable,
        layout: RecordLayout,
        row_range: tuple[int, int],
        max_ids: int,
        knobs: StageKnobs | None = None,
    ):
        if max_ids > 1 << POS_BITS:
            raise KernelError(f"max_ids is {max_ids}, at most {1 << POS_BITS}")
        self._knobs = knobs or StageKnobs()
        self._contexts: list[np.ndarray] | None = None  # per slot, built at the first step
        self._hint_contexts: list[np.ndarray] | None = None
        self.src = row_addresses(stored, layout)
        self.record_bytes = layout.record_bytes
        self.row_range = (int(row_range[0]), int(row_range[1]))
        self.max_ids = int(max_ids)
        self.slot_bytes = align(self.offsets(self.max_ids, self.max_ids)[-1])
        self.slot_map: np.ndarray | None = None  # int32 [hi - lo]: cache slot or -1
        self._memo = new_memo(0, 0)  # classify_grouped's, made with each hit index
        self._keys = np.empty(self.max_ids, np.int64)
        self._uniq = np.empty(self.max_ids, np.int64)
        self._pos = np.empty(self.max_ids, np.int64)  # a step's missed ids (by chunk)
        self._counts = np.empty(64, np.int64)
        self._index = np.empty((0, 8), np.uint64)  # build_hit_index's, with the slot map
        self._hash = np.empty(2 * min(self.max_ids, HASH_IDS), np.int32)  # dedup_hashed's
        self._scratch = np.empty(2 * (min(self.max_ids, HASH_IDS) // GROUP) + 2, np.int64)
        self._rows, self._shards = self.src.rows, self.src.shards  # built once, not per step
        self._slots: list[tuple[np.ndarray, np.ndarray, int]] = []
        self._runs = np.empty((0, 2), np.int64)
        self._watch: _cold.FaultWatch | None = None
        self.set_cold_hints(self.knobs.cold_hints)

    @property
    def knobs(self) -> StageKnobs:
        """The settings fixed at construction (``cold_hints`` switches with
        :meth:`set_cold_hints`)."""
        return self._knobs

    @property
    def hit_index(self) -> np.ndarray:
        """The device cache's hit index (uint64 ``[blocks, 8]``, :func:`build_hit_index`;
        ``[0, 8]`` without a cache)."""
        return self._index

    @property
    def cold_hints(self) -> str:
        """The ``cold_hints`` mode in use (:meth:`set_cold_hints`)."""
        return self.knobs.cold_hints

    def set_cold_hints(self, mode: str) -> None:
        """Switch the ``cold_hints`` mode between steps (``"off"``, ``"on"``, ``"auto"``).

        Raises:
            KernelError: an unknown mode.
        """
        if mode != self.knobs.cold_hints:
            self._knobs = replace(self._knobs, cold_hints=mode)  # checks the mode
        self._watch = _cold.FaultWatch() if mode == "auto" else None
        runs = self.max_ids * self.src.row_bytes.size  # one per row and field before merging
        if mode != "off" and self._runs.shape[0] < runs:
            self._runs = np.empty((runs, 2), np.int64)

    def _context(self, slot: int) -> np.ndarray:
        """Slot ``slot``'s step context for :func:`stage_step` (int64 [CONTEXT_WORDS]); the
        arrays it points into are this object's, kept alive by it."""
        if self._contexts is None:
            self._contexts = [self._build_context(words) for words, _, _ in self._slots]
        return self._contexts[slot]

    def _hint_context(self, slot: int) -> np.ndarray:
        """:meth:`_context` with ``serial_rows`` -1: :func:`stage_step` only dedups, so that
        the rows can be hinted before they are gathered."""
        if self._hint_contexts is None:
            self._hint_contexts = [self._build_context(w, -1) for w, _, _ in self._slots]
        return self._hint_contexts[slot]

    def _hinting(self) -> bool:
        if self._watch is not None:
            return self._watch.step()
        return self.knobs.cold_hints == "on"

    def _build_context(self, words: np.ndarray, serial_rows: int | None = None) -> np.ndarray:
        src, knobs = self.src, self.knobs
        slot_map = self._hash[:0] if self.slot_map is None else self.slot_map  # never read
        ctx = StepContext(
            layout_id=LAYOUT_ID, lo=self.row_range[0], hi=self.row_range[1],
            cached=int(self.slot_map is not None), hash_ids=knobs.hash_ids,
            serial_rows=knobs.serial_rows if serial_rows is None else serial_rows,
            depth=knobs.depth, rec_bytes=self.record_bytes,
            hit_index=self._index.ctypes.data, blocks=self._index.shape[0],
            slot_map=slot_map.ctypes.data, map_rows=slot_map.size,
            hash=self._hash.ctypes.data, hash_size=self._hash.size,
            keys=self._keys.ctypes.data, uniq=self._uniq.ctypes.data, pos=self._pos.ctypes.data,
            max_ids=self.max_ids, words=words.ctypes.data, slot_words=words.size,
            seg_start=src.seg_start.ctypes.data, segments=src.seg_start.size,
            seg_dir=src.seg_dir.ctypes.data, dir_size=src.seg_dir.size, seg_shift=src.seg_shift,
            bases=src.bases.ctypes.data, fields=src.row_bytes.size,
            row_bytes=src.row_bytes.ctypes.data, field_off=src.field_off.ctypes.data,
            shard_starts=src.shard_starts.ctypes.data, shards=src.shard_starts.size,
            scalars=src.scalars.ctypes.data, n_scalars=src.scalars.size,
            memo=self._memo.ctypes.data, memo_lines=self._memo.shape[0],
            memo_shift=65 - max(1, self._memo.shape[0]).bit_length(),
            scratch=self._scratch.ctypes.data, scratch_size=self._scratch.size,
        )  # fmt: skip
        return np.array(ctx, np.int64)

    def _cache_changed(self) -> None:
        """The device cache's arrays changed: contexts are rebuilt at the next step."""
        self._contexts = self._hint_contexts = None

    def add_slot(self, slot: np.ndarray) -> int:
        """Register a staging slot (uint8 ``[>= slot_bytes]``, kept alive by the caller);
        returns its index for :meth:`fill`."""
        if slot.dtype != np.uint8 or slot.ndim != 1 or slot.size < self.slot_bytes:
            raise KernelError(f"a staging slot is uint8 [{self.slot_bytes}], found {slot.dtype} "
                              f"{list(slot.shape)}")  # fmt: skip
        words = slot[: self.slot_bytes].view(np.int32)
        fwords = slot[: self.slot_bytes].view(np.float32)
        self._slots.append((words, fwords, int(slot.ctypes.data)))
        self._cache_changed()
        return len(self._slots) - 1

    def offsets(self, n_ids: int, n_unique: int) -> tuple[int, int, int]:
        """Byte offsets of scale_2 and the records in a slot (:func:`slot_offsets`), and the
        used length."""
        s2_at, rec_at = slot_offsets(n_ids, self.src.scalars.size)
        return s2_at, rec_at, rec_at + n_unique * self.record_bytes

    def fill(self, slot: int, flat: np.ndarray) -> int:
        """Dedup ``flat`` (int64 ``[n]``, contiguous, ``n <= max_ids``) into slot ``slot``'s
        inverse and gather the unique rows' records (and scale_2); returns the unique count.

        A small step is one numba call on this thread; a big one reads the slot map (or sorts
        its keys with numpy) and gathers on numba's threads. A hinted step (``cold_hints``)
        dedups first, hints the rows to gather (:func:`_cold.hint_rows`), then gathers.
        """
        knobs = self._knobs
        cached = self.slot_map is not None
        hinting = knobs.cold_hints != "off" and self._hinting()
        if not (cached and flat.size >= knobs.parallel_ids and knobs.workers > 1):
            ctx = self._hint_context(slot) if hinting else self._context(slot)
            n = stage_step(flat, ctx)
            if n == STALE_LAYOUT:
                n = _restaged(flat, ctx)
            if n >= 0:
                return int(n)  # deduplicated and gathered in the one call
        lo, hi = self.row_range
        s2_at, rec_at, _ = self.offsets(flat.size, 0)
        words, fwords, addr = self._slots[slot]
        uniq, rb = self._uniq, self.record_bytes
        rows, shards = self._rows, self._shards
        if not cached:
            keys = self._keys[: -n - 1]
            keys.sort()  # many keys: numpy's sort is the fastest
            n = unique_sorted(keys, words, uniq)
        elif flat.size >= knobs.parallel_ids and knobs.workers > 1:
            chunks = max(1, min(knobs.workers, flat.size >> 12, self._counts.size))
            classify(flat, lo, hi, self._index, words, self._pos, self._counts, chunks)
            n = dedup_positions(flat, lo, self.slot_map, words, uniq, self._pos, self._counts,
                                chunks)  # fmt: skip
        else:
            n = -n - 1  # deduplicated; too many rows for this thread alone
        dst = addr + rec_at
        if hinting:
            _cold.hint_rows(uniq, n, self.src.seg_start, self.src.bases, self.src.row_bytes,
                            self._runs)  # fmt: skip
        if n <= knobs.serial_rows:
            gather_into(uniq, 0, n, *rows, dst, rb, *shards, fwords, s2_at >> 2, knobs.depth)
        else:
            gather_parallel(uniq, n, knobs.chunk_rows, knobs.workers, *rows, dst, rb, *shards,
                            fwords, s2_at >> 2, knobs.depth)  # fmt: skip
        return int(n)

    def cache_rows(self, ids: np.ndarray, cache_bytes: int) -> tuple[np.ndarray, np.ndarray]:
        """Serve the rows of ``ids`` (int64 ``[n]``, priority order) that fit in
        ``cache_bytes`` (:func:`~flashnext.kernels._layout.rows_that_fit`; 0 rows turn the
        cache off) from a device cache from now on. Slot ``j`` holds the ``j``-th kept row in
        ascending order (ascending rows gather fastest).

        Returns:
            the kept rows' records (uint8 ``[k, R]``) and nvfp4 scale_2 (float32 ``[k]``, empty
            for other formats), for the device copy.
        """
        lo, hi = self.row_range
        rows = np.sort(ids[rows_that_fit(ids, self.row_range, cache_bytes, self.record_bytes)])
        src = self.src
        records = np.empty((rows.size, self.record_bytes), np.uint8)
        s2 = np.empty(rows.size if src.scalars.size else 0, np.float32)
        self._cache_changed()
        if rows.size == 0:
            self.slot_map, self._index = None, np.empty((0, 8), np.uint64)
            self._memo = new_memo(0, 0)
            return records, s2
        gather_records(rows, 0, rows.size, *src.rows, records, *src.shards, s2)
        slot_map = np.full(hi - lo, -1, np.int32)
        slot_map[rows - lo] = np.arange(rows.size, dtype=np.int32)
        blocks = -(-(hi - lo) // HIT_BLOCK)
        raw = np.zeros(8 * blocks + 8, np.uint64)  # one block per 64-byte line: aligned
        skip = (-raw.ctypes.data % 64) // 8
        index = raw[skip : skip + 8 * blocks].reshape(blocks, 8)
        build_hit_index(rows, lo, index)
        self.slot_map, self._index = slot_map, index
        self._memo = new_memo(self.knobs.memo_lines, hi - lo)  # memos what this index says
        return records, s2

    def share(self, other: HostStager) -> None:
        """Serve from ``other``'s device cache: its slot map, hit index and group memo (same
        row range; the two must not stage at the same time). A stager whose ``memo_lines``
        differs from ``other``'s gets a memo of its own size instead."""
        self.slot_map, self._index, self._memo = other.slot_map, other._index, other._memo
        rows = self.row_range[1] - self.row_range[0]
        lines = new_memo_lines(self.knobs.memo_lines, rows)
        if self.slot_map is not None and self._memo.shape[0] != lines:
            self._memo = new_memo(self.knobs.memo_lines, rows)
        self._cache_changed()


def _restaged(flat: np.ndarray, ctx: np.ndarray) -> int:
    """:func:`stage_step` recompiled: numba's on-disk cache held a kernel compiled for an
    older :class:`~flashnext.kernels._layout.StepContext` (its cache keys on this file alone).

    Raises:
        KernelError: the recompiled kernel still refuses the context.
    """
    stage_step.recompile()
    n = stage_step(flat, ctx)
    if n == STALE_LAYOUT:
        raise KernelError("stage_step refuses its step context even after recompiling")
    return int(n)

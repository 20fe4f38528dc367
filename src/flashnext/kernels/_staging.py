"""Host side of the staged path: dedup ids and gather stored rows into records (numba, nogil).

A step's ids become an ``inverse`` int32 index per id and the stored bytes of each unique row
as a record in the pinned staging slot (see :mod:`flashnext.kernels.staged` for the slot's
layout). Two ways to dedup, both exact:

- **behind a device cache** (:func:`stage_cached`): a hit index (:func:`build_hit_index`: a
  bit per served row and running counts per 384 rows, 53 MB for 320M rows, so its lines stay
  in the CPU's last-level cache) gives each cached id its slot, ``inverse = -(slot + 2)``. A
  step of at most ``HASH_IDS`` ids deduplicates its misses in a small open-addressing table
  (:func:`dedup_hashed`: it stays in L1, where the slot map's entries are DRAM and TLB misses;
  a T = 32 step's dedup 8.9 -> 5.7 us at 320M rows on a 2-vCPU VM, within noise on the H200's
  host), after a group memo (:func:`classify_grouped`) answered the groups of 8 ids (a token's
  heads of one n-gram order) that an earlier step resolved: one memo line instead of 8 index
  lines (an A/B on the H200's host: a T = 32 fill 1.2-3.5 us shorter once 54-61% of its
  groups repeat). A bigger step deduplicates them through the cache's
  slot map (int32 per served row, -1 = not cached): a row's first miss writes
  ``-(index + 2)`` into its entry for the rest of the step, later ids read their index back,
  and the entries are reset to -1 before the call returns. No sort, one pass, and only misses
  touch the big map. Tables sharing a cache (its slot map and memo) must not stage at the same
  time (the plugin and the benchmarks stage one step at a time). A step of ``PARALLEL_IDS`` or
  more looks its ids up in the hit index on numba's threads first (:func:`classify`), then
  dedups the misses (:func:`dedup_positions`).
- **without one** (:func:`stage_sorted`): each in-range id with its position packs into one
  int64 key (``(row << POS_BITS) | i``), the keys are sorted (numba's sort for small steps,
  numpy's by the caller for big ones: measured 10x faster than a hash table for a prefill's
  131K ids), and :func:`unique_sorted` walks them. Ids outside ``[lo, hi)`` get ``inverse = -1``,
  which the lookup kernel turns into zero rows.

Either way one call does all of a small step's work on the calling thread (handing work to
numba's threads costs more than gathering a few hundred rows): :func:`stage_step`, which reads
every argument but the ids from the slot's step context (an int64 array of addresses, sizes and
settings, built once); a step with more unique rows
than ``serial_rows`` returns ``-(n + 1)`` and the caller gathers with :func:`gather_parallel`
(each core walks its own page tables: random rows of a memory map are bound by page walks,
not bandwidth). :func:`gather_into` copies each unique row's stored bytes, tensor by tensor,
straight into its record (prefetching a few rows ahead), and its per-shard scalar into the
slot's ``scale_2``.

Where rows live is given as addresses (the table's arrays must stay alive during a call):
``seg_start`` int64 [S] global first row of each stored segment (sorted, contiguous), with
``seg_dir``/``seg_shift`` a directory that finds a row's segment without a binary search
(:func:`segment_directory`), ``bases`` int64 [F, S] address of field ``f``'s row
``seg_start[s]``, ``row_bytes`` and ``field_off`` int64 [F] the field's bytes per row and
offset in the record. The slot is passed whole as ``words`` (int32) and ``fwords`` (float32,
the same bytes): ``inverse`` is ``words[:n]``, ``scale_2`` starts at float ``s2_at``, records
at byte ``rec_at``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numba
import numpy as np

from flashnext.errors import KernelError
from flashnext.kernels import _cold
from flashnext.kernels.records import RecordLayout

# the address intrinsics of the CPU lookup kernels (one definition for both)
from flashnext.ple.lookup_kernels import _copy, _popcount, _prefetch, _ptr
from flashnext.ple.mapping import touch_pages
from flashnext.ple.table import PLETable, StoredTable
from flashnext.serve.cache_plan import (  # HIT_BLOCK: 6 words of bits after 2 of counts
    HIT_BLOCK,
    MEMO_LINE_BYTES,
    MEMO_LINES,
)

AHEAD = 32  # rows prefetched ahead of the copy (random page-cache reads: latency-bound)
_MAP_AHEAD = 16  # ids whose slot-map entry is prefetched ahead of the dedup
POS_BITS = 21  # sort keys are (row << POS_BITS) | position: at most 2M ids per step
#: Unique rows per gather thread at least (fewer: handing work out costs more than it saves).
CHUNK_ROWS = 64
#: Steps of at most this many unique rows (keys, without a cache) are deduplicated and gathered
#: in one numba call on the calling thread: waking numba's threads costs more than it saves.
SERIAL_ROWS = 256
#: Steps of at least this many ids look them up in the hit index on numba's threads first.
PARALLEL_IDS = 32768
#: Steps of at most this many ids dedup their cache misses in a hash table (32 KB), not the
#: slot map.
HASH_IDS = 4096
#: Ids a group memo line holds: a token's heads of one n-gram order (8 per order in the
#: released config), whose rows hit or miss the cache together when the n-gram repeats.
GROUP = 8
_MEMO_AHEAD = 8  # groups whose memo line is prefetched ahead
_GROUPS_AHEAD = 2  # groups the memo missed whose ids' hit-index lines are prefetched ahead
_FIBONACCI = np.uint64(0x9E3779B97F4A7C15)  # 2**64 / golden ratio: multiplicative hashing


@numba.njit(nogil=True, cache=True)
def sort_keys(ids, lo, hi, keys, inverse):  # type: ignore[no-untyped-def]
    """Sort keys ``(row << POS_BITS) | i`` of the ids inside ``[lo, hi)`` into ``keys`` (int64
    [>= n]); ``inverse[i] = -1`` for the others. Returns the number of keys written."""
    m = 0
    for i in range(ids.size):
        row = ids[i]
        if row < lo or row >= hi:
            inverse[i] = -1
        else:
            keys[m] = (row << POS_BITS) | i
            m += 1
    return m


@numba.njit(nogil=True, cache=True)
def unique_sorted(keys, inverse, uniq):  # type: ignore[no-untyped-def]
    """From sorted ``keys`` (see :func:`sort_keys`): ascending unique rows into ``uniq`` and
    each id's index into them into ``inverse``. Returns the unique count."""
    mask = (1 << POS_BITS) - 1
    n_unique = 0
    prev = -1
    for k in keys:
        row = k >> POS_BITS
        if row != prev:
            uniq[n_unique] = row
            n_unique += 1
            prev = row
        inverse[k & mask] = n_unique - 1
    return n_unique


@numba.njit(nogil=True, cache=True)
def build_hit_index(rows, lo, index):  # type: ignore[no-untyped-def]
    """Fill ``index`` (uint64 ``[ceil(served / HIT_BLOCK), 8]``, zeroed) for the cached rows
    ``rows`` (int64, ascending, global). Block ``b`` covers local rows ``[384 b, 384 b + 384)``
    in one 64-byte line: word 0 counts the cached rows of all earlier blocks, word 1 packs, 9
    bits each, how many of the block's rows before word ``k`` are cached (``k`` = 0..5), words
    2..7 are its rows' bits. A cached row's slot is its rank among the cached rows
    (:func:`_hit_slot`: one line, one popcount), as ``HostStager.cache_rows`` assigns slots;
    the whole index is 0.17 bytes per served row (53 MB for 320M rows: it stays in a server
    CPU's last-level cache, where the int32 slot map, 1.28 GB, cannot)."""
    for j in range(rows.size):
        r = rows[j] - lo
        b = r // HIT_BLOCK
        w = r - b * HIT_BLOCK
        index[b, 2 + (w >> 6)] |= np.uint64(1) << np.uint64(w & 63)
    total = 0
    for b in range(index.shape[0]):
        index[b, 0] = np.uint64(total)
        before = 0
        packed = np.uint64(0)
        for k in range(6):
            packed |= np.uint64(before) << np.uint64(9 * k)
            before += _popcount(index[b, 2 + k])
        index[b, 1] = packed
        total += before


@numba.njit(nogil=True, cache=True, inline="always")
def _hit_slot(r, index):  # type: ignore[no-untyped-def]
    """The cache slot of local row ``r`` from :func:`build_hit_index`'s index, or -1."""
    b = r // HIT_BLOCK
    w = r - b * HIT_BLOCK
    k = w >> 6
    word = index[b, 2 + k]
    bit = np.uint64(w & 63)
    if (word >> bit) & np.uint64(1) == np.uint64(0):
        return -1
    before = (index[b, 1] >> np.uint64(9 * k)) & np.uint64(511)
    below = word & ((np.uint64(1) << bit) - np.uint64(1))
    return np.int64(index[b, 0]) + np.int64(before) + _popcount(below)


@numba.njit(nogil=True, cache=True, inline="always")
def _mark(i, row, lo, slot_map, inverse, uniq, n_unique):  # type: ignore[no-untyped-def]
    """Id ``i`` misses the cache: its row's index in ``uniq``, a new one (marked in the slot
    map as ``-(index + 2)``) at its first miss of the step. Returns the unique count."""
    m = slot_map[row - lo]
    if m == -1:
        uniq[n_unique] = row
        slot_map[row - lo] = -(n_unique + 2)
        inverse[i] = n_unique
        return n_unique + 1
    inverse[i] = -(m + 2)
    return n_unique


@numba.njit(nogil=True, cache=True, inline="always")
def _classify(ids, a, b, lo, hi, index, inverse, pos, k):  # type: ignore[no-untyped-def]
    """Ids ``a..b`` against the hit ``index``: ``inverse[i]`` = -1 outside ``[lo, hi)``,
    ``-(slot + 2)`` for a cached row; the positions of the others go to ``pos[k:]``. Returns
    the next free place in ``pos``."""
    base = np.int64(index.ctypes.data)
    for i in range(a, min(b, a + _MAP_AHEAD)):
        _prefetch(_index_line(base, ids[i], lo))
    for i in range(a, b):
        if i + _MAP_AHEAD < b:
            _prefetch(_index_line(base, ids[i + _MAP_AHEAD], lo))
        c = _resolve(ids[i], lo, hi, index)
        if c == 0:
            pos[k] = i
            k += 1
        else:
            inverse[i] = c
    return k


@numba.njit(nogil=True, cache=True, inline="always")
def _index_line(base, row, lo):  # type: ignore[no-untyped-def]
    """The address of row ``row``'s line of the hit index at ``base`` (any row: only ever
    prefetched, and a prefetch never faults)."""
    return base + 64 * ((row - lo) // HIT_BLOCK)


@numba.njit(nogil=True, cache=True, inline="always")
def _resolve(row, lo, hi, index):  # type: ignore[no-untyped-def]
    """What the hit ``index`` says of global row ``row``, as an int32 inverse code: -1 outside
    ``[lo, hi)``, ``-(slot + 2)`` cached, 0 missed."""
    if row < lo or row >= hi:
        return np.int32(-1)
    s = _hit_slot(row - lo, index)
    return np.int32(-(s + 2)) if s >= 0 else np.int32(0)


@numba.njit(nogil=True, cache=True, inline="always")
def _dedup_range(  # type: ignore[no-untyped-def]
    ids, lo, slot_map, inverse, uniq, pos, a, e, n_unique
):
    """The missed ids ``pos[a:e]`` deduplicated through the slot map (:func:`_mark`), its
    entries prefetched ahead (random reads of a large map). Returns the unique count."""
    base = np.int64(slot_map.ctypes.data)
    for k in range(a, min(e, a + _MAP_AHEAD)):
        _prefetch(base + 4 * (ids[pos[k]] - lo))
    for k in range(a, e):
        if k + _MAP_AHEAD < e:
            _prefetch(base + 4 * (ids[pos[k + _MAP_AHEAD]] - lo))
        i = pos[k]
        n_unique = _mark(i, ids[i], lo, slot_map, inverse, uniq, n_unique)
    return n_unique


@numba.njit(nogil=True, cache=True)
def dedup_misses(ids, lo, hi, index, slot_map, inverse, uniq, pos):  # type: ignore[no-untyped-def]
    """Inverse of each id behind a device cache: -1 outside ``[lo, hi)``, ``-(slot + 2)`` for
    a cached row (its slot from the hit ``index``), else the index of its row in ``uniq``
    (first-seen order), deduplicated through ``slot_map`` (int32 ``[hi - lo]``; see the module
    docstring; every mark is -1 again on return). Two passes: the hit index first, then only
    the misses' slot-map entries (``pos`` int64 ``[>= n]`` holds their positions). Returns
    the unique count."""
    k = _classify(ids, 0, ids.size, lo, hi, index, inverse, pos, 0)
    n_unique = _dedup_range(ids, lo, slot_map, inverse, uniq, pos, 0, k, 0)
    for u in range(n_unique):
        slot_map[uniq[u] - lo] = -1
    return n_unique


@numba.njit(nogil=True, cache=True)
def dedup_hashed(ids, lo, hi, index, table, inverse, uniq, pos):  # type: ignore[no-untyped-def]
    """:func:`dedup_misses` for a small step: the same inverse and ``uniq`` (first-seen
    order), the misses deduplicated in ``table`` (int32 ``[>= 2 * ids.size]``, any content:
    cleared here) by linear probing instead of the slot map. Returns the unique count."""
    k = _classify(ids, 0, ids.size, lo, hi, index, inverse, pos, 0)
    return _hash_misses(ids, k, table, inverse, uniq, pos)


@numba.njit(nogil=True, cache=True, inline="always")
def _hash_misses(ids, k, table, inverse, uniq, pos):  # type: ignore[no-untyped-def]
    """The missed ids ``pos[:k]`` deduplicated in ``table`` (see :func:`dedup_hashed`)."""
    bits = 4
    while (1 << bits) < 2 * k:
        bits += 1
    mask = (1 << bits) - 1
    table[: mask + 1] = -1
    shift = np.uint64(64 - bits)
    n_unique = 0
    for q in range(k):
        i = pos[q]
        row = ids[i]
        h = np.int64((np.uint64(row) * _FIBONACCI) >> shift)
        while True:
            u = table[h]
            if u < 0:  # the row's first miss
                table[h] = n_unique
                uniq[n_unique] = row
                inverse[i] = n_unique
                n_unique += 1
                break
            if uniq[u] == row:
                inverse[i] = u
                break
            h = (h + 1) & mask
    return n_unique


@numba.njit(nogil=True, cache=True, inline="always")
def _memo_line(ids, i, shift):  # type: ignore[no-untyped-def]
    """The memo line of the group of ids starting at ``i`` (its first two ids, hashed)."""
    key = np.uint64(ids[i]) ^ (np.uint64(ids[i + 1]) << np.uint64(32))
    return np.int64((key * _FIBONACCI) >> shift)


@numba.njit(nogil=True, cache=True, inline="always")
def _memo_key(row, lo, hi):  # type: ignore[no-untyped-def]
    """An id as a memo line stores it: its local row, or -1 for every id outside ``[lo, hi)``
    (they all resolve alike)."""
    if row < lo or row >= hi:
        return np.int32(-1)
    return np.int32(row - lo)


@numba.njit(nogil=True, cache=True, inline="always")
def _prefetch_group(ids, a, lo, ibase):  # type: ignore[no-untyped-def]
    """Hint the CPU to load the hit-index lines (at ``ibase``) of the group of ids at ``a``."""
    for j in range(a, a + GROUP):
        _prefetch(_index_line(ibase, ids[j], lo))


@numba.njit(nogil=True, cache=True)
def classify_grouped(  # type: ignore[no-untyped-def]
    ids, lo, hi, index, memo, shift, inverse, pos, scratch
):
    """:func:`_classify` of all ``ids`` (the same ``inverse`` for hits and ids outside, the
    misses' positions into ``pos`` in id order; returns their count), through a memo of
    whole groups first.

    Ids come in groups of ``GROUP`` (a token's heads of one n-gram order); a line of ``memo``
    (int32 ``[2 ** (64 - shift), 2 * GROUP]``, 64 bytes, one cache line) holds one group's
    ids (:func:`_memo_key`) and what each resolved to (-1 outside, ``-(slot + 2)`` cached, 0
    missed). A group found there costs one line instead of one hit-index line per id; one
    that is not is looked up in the index and replaces the line (a direct-mapped cache of
    n-grams: on real text 40-60% of a decode step's groups repeat an earlier step's, 80% of a
    single stream's). The memo is only ever filled from the index it was made with
    (``HostStager.cache_rows`` makes a new one with each index), so it changes no result.
    ``scratch`` int64 ``[>= 2 * (n // GROUP)]``."""
    n = ids.size
    groups = n // GROUP
    todo = _memo_pass(ids, groups, lo, hi, memo, shift, inverse, scratch)
    ibase = np.int64(index.ctypes.data)
    for q in range(min(todo, _GROUPS_AHEAD)):
        _prefetch_group(ids, scratch[groups + q] * GROUP, lo, ibase)
    k = 0  # pass two, in id order: the misses' positions, the other groups through the index
    q = 0
    for g in range(groups):
        a = g * GROUP
        if scratch[g] >= 0:  # the memo's answer, in inverse since pass one
            for j in range(GROUP):
                if inverse[a + j] == 0:
                    pos[k] = a + j
                    k += 1
            continue
        if q + _GROUPS_AHEAD < todo:
            _prefetch_group(ids, scratch[groups + q + _GROUPS_AHEAD] * GROUP, lo, ibase)
        q += 1
        k = _index_group(ids, a, lo, hi, index, memo, -scratch[g] - 1, inverse, pos, k)
    return _classify(ids, groups * GROUP, n, lo, hi, index, inverse, pos, k)


@numba.njit(nogil=True, cache=True, inline="always")
def _memo_pass(ids, groups, lo, hi, memo, shift, inverse, scratch):  # type: ignore[no-untyped-def]
    """Pass one of :func:`classify_grouped`: each group the memo holds gets its ``inverse``
    now (a group the memo missed may take its line in pass two) and ``scratch[g] = 0``; each
    other one ``scratch[g] = -(line + 1)`` and a place in the list ``scratch[groups:]``.
    Returns the length of that list."""
    mbase = np.int64(memo.ctypes.data)
    for g in range(min(groups, _MEMO_AHEAD)):
        _prefetch(mbase + MEMO_LINE_BYTES * _memo_line(ids, g * GROUP, shift))
    todo = 0
    for g in range(groups):
        if g + _MEMO_AHEAD < groups:
            _prefetch(mbase + MEMO_LINE_BYTES * _memo_line(ids, (g + _MEMO_AHEAD) * GROUP, shift))
        a = g * GROUP
        h = _memo_line(ids, a, shift)
        same = True
        for j in range(GROUP):
            if memo[h, j] != _memo_key(ids[a + j], lo, hi):
                same = False
                break
        if same:
            for j in range(GROUP):
                inverse[a + j] = memo[h, GROUP + j]
            scratch[g] = 0
        else:
            scratch[g] = -(h + 1)
            scratch[groups + todo] = g
            todo += 1
    return todo


@numba.njit(nogil=True, cache=True, inline="always")
def _index_group(ids, a, lo, hi, index, memo, h, inverse, pos, k):  # type: ignore[no-untyped-def]
    """The group of ids at ``a`` through the hit index, remembered in memo line ``h``; its
    misses' positions go to ``pos[k:]``. Returns the next free place in ``pos``."""
    for j in range(GROUP):
        row = ids[a + j]
        c = _resolve(row, lo, hi, index)
        memo[h, j] = _memo_key(row, lo, hi)
        memo[h, GROUP + j] = c
        inverse[a + j] = c
        if c == 0:
            pos[k] = a + j
            k += 1
    return k


def checked_memo_lines(lines: int) -> int:
    """``lines`` when it is 0 (no memo) or a power of two >= 2.

    Raises:
        KernelError: any other number.
    """
    whole = isinstance(lines, (int, np.integer)) and not isinstance(lines, bool)
    if not whole or (lines != 0 and (lines < 2 or lines & (lines - 1))):
        raise KernelError(f"memo_lines is {lines!r}, expected a power of two >= 2 (or 0: no memo)")
    return int(lines)


def new_memo_lines(lines: int, rows: int) -> int:
    """How many lines :func:`new_memo` gives a table of ``rows`` served rows: ``lines``, or 0
    where its local rows do not fit an int32."""
    return 0 if rows >= 1 << 31 else checked_memo_lines(lines)


def new_memo(lines: int, rows: int) -> np.ndarray:
    """An empty group memo for :func:`classify_grouped` (int32 ``[lines, 2 * GROUP]``, each
    line 64-byte aligned, no id stored), or a ``[0, 2 * GROUP]`` array (no memo) when
    ``lines`` is 0 or a table's local rows do not fit an int32."""
    lines = new_memo_lines(lines, rows)
    if lines == 0:
        return np.empty((0, 2 * GROUP), np.int32)
    raw = np.full(lines * 2 * GROUP + 16, -2, np.int32)  # -2: no id is stored so
    skip = (-raw.ctypes.data % 64) // 4
    return raw[skip : skip + lines * 2 * GROUP].reshape(lines, 2 * GROUP)


@numba.njit(nogil=True, cache=True, parallel=True)
def classify(ids, lo, hi, index, inverse, pos, counts, chunks):  # type: ignore[no-untyped-def]
    """The hit-index pass of :func:`dedup_misses` for a big step, on ``chunks`` of numba's
    threads: chunk ``c``'s missed ids go to ``pos[a : a + counts[c]]`` (``a``: its first id),
    for :func:`dedup_positions`."""
    n = ids.size
    for c in numba.prange(chunks):
        a = n * c // chunks
        b = n * (c + 1) // chunks
        counts[c] = _classify(ids, a, b, lo, hi, index, inverse, pos, a) - a


@numba.njit(nogil=True, cache=True)
def dedup_positions(  # type: ignore[no-untyped-def]
    ids, lo, slot_map, inverse, uniq, pos, counts, chunks
):
    """After :func:`classify`: the missed ids get their row's index in ``uniq`` as in
    :func:`dedup_misses`. Returns the unique count."""
    n = ids.size
    n_unique = 0
    for c in range(chunks):
        a = n * c // chunks
        n_unique = _dedup_range(ids, lo, slot_map, inverse, uniq, pos, a, a + counts[c],
                                n_unique)  # fmt: skip
    for u in range(n_unique):
        slot_map[uniq[u] - lo] = -1
    return n_unique


@numba.njit(nogil=True, cache=True, inline="always")
def _segment(row, seg_start):  # type: ignore[no-untyped-def]
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
        _prefetch(addr)
        _prefetch(addr + row_bytes[f] - 1)


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
            _copy(rec + field_off[f], bases[f, s] + (row - seg_start[s]) * nb, nb)
        if scalars.size:
            fwords[s2_at + j] = scalars[_segment(row, shard_starts)]


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


@numba.njit(nogil=True, cache=True)
def stage_cached(  # type: ignore[no-untyped-def]
    ids, lo, hi, index, slot_map, table, memo, memo_shift, scratch, uniq, pos, words, fwords,
    s2_at, rec_at, rec_bytes, seg_start, seg_dir, seg_shift, bases, row_bytes, field_off,
    shard_starts, scalars, serial_rows, depth=AHEAD,
):  # fmt: skip
    """One step behind a device cache: :func:`dedup_hashed` (at most ``table.size // 2``
    ids; classified through the group ``memo`` first, :func:`classify_grouped`, unless it has
    no line) or :func:`dedup_misses` into ``words[:ids.size]``, then, with at most
    ``serial_rows`` unique rows, :func:`gather_into` on this thread. Returns the unique count
    ``n``, or ``-(n + 1)`` when the caller still has to gather ``uniq[:n]``."""
    if 2 * ids.size <= table.size:
        if memo.shape[0]:
            k = classify_grouped(ids, lo, hi, index, memo, memo_shift, words, pos, scratch)
        else:
            k = _classify(ids, 0, ids.size, lo, hi, index, words, pos, 0)
        n = _hash_misses(ids, k, table, words, uniq, pos)
    else:
        n = dedup_misses(ids, lo, hi, index, slot_map, words, uniq, pos)
    if n > serial_rows:
        return -(n + 1)
    dst = np.int64(words.ctypes.data) + rec_at
    gather_into(uniq, 0, n, seg_start, seg_dir, seg_shift, bases, row_bytes, field_off, dst,
                rec_bytes, shard_starts, scalars, fwords, s2_at, depth)  # fmt: skip
    return n


@numba.njit(nogil=True, cache=True)
def stage_sorted(  # type: ignore[no-untyped-def]
    ids, lo, hi, keys, uniq, words, fwords, s2_at, rec_at, rec_bytes, seg_start, seg_dir,
    seg_shift, bases, row_bytes, field_off, shard_starts, scalars, serial_rows, depth=AHEAD,
):  # fmt: skip
    """One step without a cache: :func:`sort_keys` into ``words[:ids.size]``; with at most
    ``serial_rows`` keys also the sort (numba's), :func:`unique_sorted` and :func:`gather_into`
    on this thread. Returns the unique count, or ``-(m + 1)`` with the ``m`` keys unsorted
    (the caller sorts them, dedups and gathers)."""
    m = sort_keys(ids, lo, hi, keys, words)
    if m > serial_rows:
        return -(m + 1)
    part = keys[:m]
    part.sort()
    n = unique_sorted(part, words, uniq)
    dst = np.int64(words.ctypes.data) + rec_at
    gather_into(uniq, 0, n, seg_start, seg_dir, seg_shift, bases, row_bytes, field_off, dst,
                rec_bytes, shard_starts, scalars, fwords, s2_at, depth)  # fmt: skip
    return n


# The words of a step context (HostStager._context): every argument of stage_cached and
# stage_sorted but the ids, as int64 addresses, sizes and knobs. A decode step's call then
# unboxes two arrays instead of 23 arguments: numba's dispatch of those took 2.1 us of a
# 26 us T = 32 step on the development VM, Python's choice of path and offsets 0.7 us more
# (on the H200's host the fill went from ~27 to ~24 us).
(_LO, _HI, _CACHED, _HASH_IDS, _SERIAL_ROWS, _DEPTH, _REC_BYTES, _INDEX, _BLOCKS, _SLOT_MAP,
 _MAP_ROWS, _HASH, _HASH_SIZE, _KEYS, _UNIQ, _POS, _MAX_IDS, _WORDS, _SLOT_WORDS, _SEG_START,
 _SEGMENTS, _SEG_DIR, _DIR_SIZE, _SEG_SHIFT, _BASES, _FIELDS, _ROW_BYTES, _FIELD_OFF,
 _SHARD_STARTS, _SHARDS, _SCALARS, _N_SCALARS, _MEMO, _MEMO_LINES, _MEMO_SHIFT, _SCRATCH,
 _SCRATCH_SIZE, CONTEXT_WORDS) = range(38)  # fmt: skip


@numba.njit(nogil=True, cache=True, inline="always")
def _align16(n):  # type: ignore[no-untyped-def]
    return (n + 15) & ~15


@numba.njit(nogil=True, cache=True)
def stage_step(ids, ctx):  # type: ignore[no-untyped-def]
    """:func:`stage_cached` (a cache is set) or :func:`stage_sorted` of ``ids`` (int64 [n],
    n <= the context's max ids), every other argument read from the step context ``ctx``
    (int64 [CONTEXT_WORDS], :meth:`HostStager._context`): the same return value. The slot's
    offsets are :meth:`HostStager.offsets`'."""
    n = ids.size
    lo, hi = ctx[_LO], ctx[_HI]
    s2_at = _align16(4 * n)
    rec_at = _align16(s2_at + (4 * n if ctx[_N_SCALARS] else 0))
    words = numba.carray(_ptr(ctx[_WORDS]), ctx[_SLOT_WORDS], np.int32)
    fwords = numba.carray(_ptr(ctx[_WORDS]), ctx[_SLOT_WORDS], np.float32)
    uniq = numba.carray(_ptr(ctx[_UNIQ]), ctx[_MAX_IDS], np.int64)
    seg_start = numba.carray(_ptr(ctx[_SEG_START]), ctx[_SEGMENTS], np.int64)
    seg_dir = numba.carray(_ptr(ctx[_SEG_DIR]), ctx[_DIR_SIZE], np.int64)
    bases = numba.carray(_ptr(ctx[_BASES]), (ctx[_FIELDS], ctx[_SEGMENTS]), np.int64)
    row_bytes = numba.carray(_ptr(ctx[_ROW_BYTES]), ctx[_FIELDS], np.int64)
    field_off = numba.carray(_ptr(ctx[_FIELD_OFF]), ctx[_FIELDS], np.int64)
    shard_starts = numba.carray(_ptr(ctx[_SHARD_STARTS]), ctx[_SHARDS], np.int64)
    scalars = numba.carray(_ptr(ctx[_SCALARS]), ctx[_N_SCALARS], np.float32)
    if ctx[_CACHED]:
        index = numba.carray(_ptr(ctx[_INDEX]), (ctx[_BLOCKS], 8), np.uint64)
        slot_map = numba.carray(_ptr(ctx[_SLOT_MAP]), ctx[_MAP_ROWS], np.int32)
        hashed = ctx[_HASH_SIZE] if n <= ctx[_HASH_IDS] else 0
        table = numba.carray(_ptr(ctx[_HASH]), hashed, np.int32)
        pos = numba.carray(_ptr(ctx[_POS]), ctx[_MAX_IDS], np.int64)
        memo = numba.carray(_ptr(ctx[_MEMO]), (ctx[_MEMO_LINES], 2 * GROUP), np.int32)
        scratch = numba.carray(_ptr(ctx[_SCRATCH]), ctx[_SCRATCH_SIZE], np.int64)
        return stage_cached(ids, lo, hi, index, slot_map, table, memo,
                            np.uint64(ctx[_MEMO_SHIFT]), scratch, uniq, pos, words, fwords,
                            s2_at >> 2, rec_at, ctx[_REC_BYTES], seg_start, seg_dir,
                            ctx[_SEG_SHIFT], bases, row_bytes, field_off, shard_starts, scalars,
                            ctx[_SERIAL_ROWS], ctx[_DEPTH])  # fmt: skip
    keys = numba.carray(_ptr(ctx[_KEYS]), ctx[_MAX_IDS], np.int64)
    return stage_sorted(ids, lo, hi, keys, uniq, words, fwords, s2_at >> 2, rec_at,
                        ctx[_REC_BYTES], seg_start, seg_dir, ctx[_SEG_SHIFT], bases, row_bytes,
                        field_off, shard_starts, scalars, ctx[_SERIAL_ROWS], ctx[_DEPTH])  # fmt: skip


# -- the host side of one staged table (numpy only: benchmarks run it without torch) ---------
def align(n: int, k: int = 16) -> int:
    """``n`` rounded up to a multiple of ``k``."""
    return -(-n // k) * k


@dataclass(frozen=True)
class RowSource:
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


def row_source(stored: StoredTable, layout: RecordLayout) -> RowSource:
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
    return RowSource(
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


def flat_ids(arr: np.ndarray) -> np.ndarray:
    """``arr`` as contiguous int64 ``[n]`` (a view when it already is int64 and contiguous)."""
    if arr.dtype == np.int64 and arr.flags.c_contiguous:
        return arr.reshape(-1)
    return np.ascontiguousarray(arr, dtype=np.int64).reshape(-1)


def prefault_pages(table: PLETable) -> None:
    """Map every page of the table's stored tensors into this process now, so that steps take
    no page faults: ``PLETable.populate_maps`` (on 2 MiB pages where the page cache holds 2 MiB
    folios, e.g. after ``PLETable.warm``), then one byte read per page (where the kernel
    lacks ``MADV_POPULATE_READ``; in a VM, also the first touch ``touch_pages`` explains)."""
    table.populate_maps()
    for seg in table.stored().segments:
        for arr in seg.tensors.values():
            touch_pages(np.asarray(arr).reshape(-1).view(np.uint8))


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
        workers: numba threads for a big step's gather (default: up to 8).
        cold_hints: ``"off"``, ``"on"`` or ``"auto"``: whether a step first asks the kernel
            to read the pages of the rows it gathers (:mod:`flashnext.kernels._cold`; auto:
            while the process takes major page faults).

    Raises:
        KernelError: ``max_ids`` is above ``2 ** POS_BITS``, or an unknown ``cold_hints``.
    """

    def __init__(
        self,
        stored: StoredTable,
        layout: RecordLayout,
        row_range: tuple[int, int],
        max_ids: int,
        workers: int | None = None,
        cold_hints: str = "off",
    ):
        if max_ids > 1 << POS_BITS:
            raise KernelError(f"max_ids is {max_ids}, at most {1 << POS_BITS}")
        self._contexts: list[np.ndarray] | None = None  # per slot, built at the first step
        self.src = row_source(stored, layout)
        self.record_bytes = layout.record_bytes
        self.row_range = (int(row_range[0]), int(row_range[1]))
        self.max_ids = int(max_ids)
        self.slot_bytes = align(self.offsets(self.max_ids, self.max_ids)[-1])
        self.workers = workers or min(8, os.cpu_count() or 1)
        self.serial_rows = SERIAL_ROWS
        self.parallel_ids = PARALLEL_IDS
        self.hash_ids = HASH_IDS
        self.chunk_rows = CHUNK_ROWS
        self.depth = AHEAD
        self.memo_lines = MEMO_LINES  # the group memo of the next cache (0: none)
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
        self._hint_contexts: list[np.ndarray] | None = None
        self._runs = np.empty((0, 2), np.int64)
        self._watch: _cold.FaultWatch | None = None
        self.cold_hints = cold_hints  # checked, with its watch and buffer, by __setattr__

    #: What a step context holds besides addresses that never change: setting one rebuilds
    #: the contexts at the next step (benchmarks change the knobs between steps).
    _CONTEXT_INPUTS = frozenset(
        {"slot_map", "_index", "_memo", "serial_rows", "hash_ids", "depth"}
    )

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "memo_lines":
            value = checked_memo_lines(value)
        if name == "cold_hints":
            self._set_cold_hints(value)
        object.__setattr__(self, name, value)
        if name == "memo_lines" and getattr(self, "slot_map", None) is not None:
            self._fit_memo()
        if name in HostStager._CONTEXT_INPUTS:
            object.__setattr__(self, "_contexts", None)
            object.__setattr__(self, "_hint_contexts", None)

    def _set_cold_hints(self, mode: str) -> None:
        if mode not in _cold.MODES:
            raise KernelError(f"cold_hints is {mode!r}, expected one of {_cold.MODES}")
        object.__setattr__(self, "_watch", _cold.FaultWatch() if mode == "auto" else None)
        runs = self.max_ids * self.src.row_bytes.size  # one per row and field before merging
        if mode != "off" and self._runs.shape[0] < runs:
            object.__setattr__(self, "_runs", np.empty((runs, 2), np.int64))

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
            self._hint_contexts = [self._build_context(w) for w, _, _ in self._slots]
            for ctx in self._hint_contexts:
                ctx[_SERIAL_ROWS] = -1
        return self._hint_contexts[slot]

    def _hinting(self) -> bool:
        if self._watch is not None:
            return self._watch.step()
        return self.cold_hints == "on"

    def _build_context(self, words: np.ndarray) -> np.ndarray:
        src = self.src
        cached = self.slot_map is not None
        slot_map = self._hash[:0] if self.slot_map is None else self.slot_map  # never read
        ctx = np.zeros(CONTEXT_WORDS, np.int64)
        for at, value in (
            (_LO, self.row_range[0]), (_HI, self.row_range[1]), (_CACHED, int(cached)),
            (_HASH_IDS, self.hash_ids), (_SERIAL_ROWS, self.serial_rows), (_DEPTH, self.depth),
            (_REC_BYTES, self.record_bytes), (_INDEX, self._index.ctypes.data),
            (_BLOCKS, self._index.shape[0]), (_SLOT_MAP, slot_map.ctypes.data),
            (_MAP_ROWS, slot_map.size), (_HASH, self._hash.ctypes.data),
            (_HASH_SIZE, self._hash.size), (_KEYS, self._keys.ctypes.data),
            (_UNIQ, self._uniq.ctypes.data), (_POS, self._pos.ctypes.data),
            (_MAX_IDS, self.max_ids), (_WORDS, words.ctypes.data), (_SLOT_WORDS, words.size),
            (_SEG_START, src.seg_start.ctypes.data), (_SEGMENTS, src.seg_start.size),
            (_SEG_DIR, src.seg_dir.ctypes.data), (_DIR_SIZE, src.seg_dir.size),
            (_SEG_SHIFT, src.seg_shift), (_BASES, src.bases.ctypes.data),
            (_FIELDS, src.row_bytes.size), (_ROW_BYTES, src.row_bytes.ctypes.data),
            (_FIELD_OFF, src.field_off.ctypes.data),
            (_SHARD_STARTS, src.shard_starts.ctypes.data), (_SHARDS, src.shard_starts.size),
            (_SCALARS, src.scalars.ctypes.data), (_N_SCALARS, src.scalars.size),
            (_MEMO, self._memo.ctypes.data), (_MEMO_LINES, self._memo.shape[0]),
            (_MEMO_SHIFT, 65 - max(1, self._memo.shape[0]).bit_length()),
            (_SCRATCH, self._scratch.ctypes.data), (_SCRATCH_SIZE, self._scratch.size),
        ):  # fmt: skip
            ctx[at] = value
        return ctx

    def add_slot(self, slot: np.ndarray) -> int:
        """Register a staging slot (uint8 ``[>= slot_bytes]``, kept alive by the caller);
        returns its index for :meth:`fill`."""
        if slot.dtype != np.uint8 or slot.ndim != 1 or slot.size < self.slot_bytes:
            raise KernelError(f"a staging slot is uint8 [{self.slot_bytes}], found {slot.dtype} "
                              f"{list(slot.shape)}")  # fmt: skip
        words = slot[: self.slot_bytes].view(np.int32)
        fwords = slot[: self.slot_bytes].view(np.float32)
        self._slots.append((words, fwords, int(slot.ctypes.data)))
        self._contexts = self._hint_contexts = None
        return len(self._slots) - 1

    def offsets(self, n_ids: int, n_unique: int) -> tuple[int, int, int]:
        """Byte offsets of scale_2 and the records in a slot, and the used length.

        scale_2 gets room for ``n_ids`` rows (4 bytes each), so that the records' place is
        known before the dedup says how many rows there are.
        """
        s2_at = align(4 * n_ids)
        rec_at = align(s2_at + (4 * n_ids if self.src.scalars.size else 0))
        return s2_at, rec_at, rec_at + n_unique * self.record_bytes

    def fill(self, slot: int, flat: np.ndarray) -> int:
        """Dedup ``flat`` (int64 ``[n]``, contiguous, ``n <= max_ids``) into slot ``slot``'s
        inverse and gather the unique rows' records (and scale_2); returns the unique count.

        A small step is one numba call on this thread; a big one reads the slot map (or sorts
        its keys with numpy) and gathers on numba's threads. A hinted step (``cold_hints``)
        dedups first, hints the rows to gather (:func:`_cold.hint_rows`), then gathers.
        """
        cached = self.slot_map is not None
        hinting = self.cold_hints != "off" and self._hinting()
        if not (cached and flat.size >= self.parallel_ids and self.workers > 1):
            ctx = self._hint_context(slot) if hinting else self._context(slot)
            n = stage_step(flat, ctx)
            if n >= 0:
                return n  # deduplicated and gathered in the one call
        lo, hi = self.row_range
        s2_at, rec_at, _ = self.offsets(flat.size, 0)
        words, fwords, addr = self._slots[slot]
        uniq, rb, serial = self._uniq, self.record_bytes, self.serial_rows
        rows, shards = self._rows, self._shards
        if not cached:
            keys = self._keys[: -n - 1]
            keys.sort()  # many keys: numpy's sort is the fastest
            n = unique_sorted(keys, words, uniq)
        elif flat.size >= self.parallel_ids and self.workers > 1:
            chunks = max(1, min(self.workers, flat.size >> 12, self._counts.size))
            classify(flat, lo, hi, self._index, words, self._pos, self._counts, chunks)
            n = dedup_positions(flat, lo, self.slot_map, words, uniq, self._pos, self._counts,
                                chunks)  # fmt: skip
        else:
            n = -n - 1  # deduplicated; too many rows for this thread alone
        dst = addr + rec_at
        if hinting:
            _cold.hint_rows(uniq, n, self.src.seg_start, self.src.bases, self.src.row_bytes,
                            self._runs)  # fmt: skip
        if n <= serial:
            gather_into(uniq, 0, n, *rows, dst, rb, *shards, fwords, s2_at >> 2, self.depth)
        else:
            gather_parallel(uniq, n, self.chunk_rows, self.workers, *rows, dst, rb, *shards,
                            fwords, s2_at >> 2, self.depth)  # fmt: skip
        return int(n)

    def cache_rows(self, ids: np.ndarray, cache_bytes: int) -> tuple[np.ndarray, np.ndarray]:
        """Serve the first rows of ``ids`` (int64 ``[n]``, priority order) that fit in
        ``cache_bytes`` from a device cache from now on (``GpuTable.set_device_cache``' rule: rows
        outside ``row_range`` skipped, repeats keep their first place, ``cache_bytes //
        record_bytes`` rows kept; 0 rows turn the cache off). Slot ``j`` holds the ``j``-th
        kept row in ascending order (ascending rows gather fastest).

        Returns:
            the kept rows' records (uint8 ``[k, R]``) and nvfp4 scale_2 (float32 ``[k]``, empty
            for other formats), for the device copy.
        """
        lo, hi = self.row_range
        ids = ids[(ids >= lo) & (ids < hi)]
        _, first = np.unique(ids, return_index=True)
        rows = np.sort(ids[np.sort(first)][: max(0, int(cache_bytes)) // self.record_bytes])
        src = self.src
        records = np.empty((rows.size, self.record_bytes), np.uint8)
        s2 = np.empty(rows.size if src.scalars.size else 0, np.float32)
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
        self._memo = new_memo(self.memo_lines, hi - lo)  # memos what this index says
        return records, s2

    def share(self, other: HostStager) -> None:
        """Serve from ``other``'s device cache: its slot map, hit index and group memo (same
        row range; the two must not stage at the same time). A stager whose ``memo_lines``
        differs from ``other``'s gets a memo of its own size instead."""
        self.slot_map, self._index, self._memo = other.slot_map, other._index, other._memo
        self._fit_memo()

    def _fit_memo(self) -> None:
        """A new memo for the cache in use when the one held is not ``memo_lines`` long."""
        rows = self.row_range[1] - self.row_range[0]
        if self.slot_map is not None and self._memo.shape[0] != new_memo_lines(self.memo_lines, rows):
            self._memo = new_memo(self.memo_lines, rows)

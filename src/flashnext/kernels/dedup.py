"""The staged path's dedup: a step's ids to an ``inverse`` index and their unique rows (numba).

Each id gets ``inverse`` int32: -1 outside the served rows ``[lo, hi)``, ``-(slot + 2)`` for a
row the device cache holds, else the index of its row among the step's unique rows ``uniq``
(which :mod:`flashnext.kernels.gather` then copies). Two ways to dedup, both exact:

- **behind a device cache** (:func:`~flashnext.kernels.stager.stage_cached`): a hit index (:func:`build_hit_index`: a
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
- **without one** (:func:`~flashnext.kernels.stager.stage_sorted`): each in-range id with its position packs into one
  int64 key (``(row << POS_BITS) | i``), the keys are sorted (numba's sort for small steps,
  numpy's by the caller for big ones: measured 10x faster than a hash table for a prefill's
  131K ids), and :func:`unique_sorted` walks them. Ids outside ``[lo, hi)`` get ``inverse = -1``,
  which the lookup kernel turns into zero rows.

:mod:`flashnext.kernels.stager` runs these for a step (a small step's dedup and gather in one
call on the calling thread).
"""

from __future__ import annotations

import numba
import numpy as np

from flashnext.errors import KernelError
from flashnext.kernels._layout import HIT_BLOCK, MEMO_LINE_BYTES
from flashnext.numba_intrinsics import popcount, prefetch

# Each loop below prefetches its items ahead written out, as gather.gather_into's does: one
# helper taking the touch function and its arrays in a tuple cost 1-4% of a decode step (H200).
_MAP_AHEAD = 16  # ids whose slot-map entry is prefetched ahead of the dedup
POS_BITS = 21  # sort keys are (row << POS_BITS) | position: at most 2M ids per step
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
            before += popcount(index[b, 2 + k])
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
    return np.int64(index[b, 0]) + np.int64(before) + popcount(below)


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
        prefetch(_index_line(base, ids[i], lo))
    for i in range(a, b):
        if i + _MAP_AHEAD < b:
            prefetch(_index_line(base, ids[i + _MAP_AHEAD], lo))
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
        prefetch(base + 4 * (ids[pos[k]] - lo))
    for k in range(a, e):
        if k + _MAP_AHEAD < e:
            prefetch(base + 4 * (ids[pos[k + _MAP_AHEAD]] - lo))
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
        prefetch(_index_line(ibase, ids[j], lo))


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
        prefetch(mbase + MEMO_LINE_BYTES * _memo_line(ids, g * GROUP, shift))
    todo = 0
    for g in range(groups):
        if g + _MEMO_AHEAD < groups:
            prefetch(mbase + MEMO_LINE_BYTES * _memo_line(ids, (g + _MEMO_AHEAD) * GROUP, shift))
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

"""bench/gpu_lookup.py's ``staged-host`` section: the staged path's host work per step, no GPU.

What ``StagedTable.stage`` / ``GraphStagedTable.stage`` do on the host between the ids and the
copy (``flat_ids`` + ``HostStager.fill``: dedup, gather into the staging slot), timed on a
memory-mapped int4 sidecar with and without a device cache of the profile's hot rows, against
the previous version of the same work in the same run (:class:`Previous`, the code before
issue 23's rework, kept here verbatim: sort keys for every step, numpy's sort, then dedup and
the gather on numba's threads through a ``parallel=True`` call). Every variant must give every
id the same row (checked on two more steps per case, id by id). Each variant is timed on fresh
steps of its own (no step twice: rows as cold as a served model's). Needs numpy and numba only:
no torch, no GPU.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from typing import Any

import numba
import numpy as np

from flashnext.kernels.dedup import POS_BITS, dedup_hashed, dedup_misses, sort_keys, unique_sorted
from flashnext.kernels.gather import (
    CHUNK_ROWS,
    gather_into,
    gather_parallel,
    prefault_pages,
    segment,
)
from flashnext.kernels.records import record_layout
from flashnext.kernels.stager import HostStager, StageKnobs, flat_ids
from flashnext.numba_intrinsics import prefetch, ptr

_AHEAD = 8


# -- the previous host path (before issue 23's rework), verbatim --------------------------------
@numba.njit(nogil=True, cache=True)
def _previous_keys(ids, lo, hi, slot_map, keys, inverse):  # type: ignore[no-untyped-def]
    m = 0
    for i in range(ids.size):
        row = ids[i]
        if row < lo or row >= hi:
            inverse[i] = -1
            continue
        slot = slot_map[row - lo] if slot_map.size else -1
        if slot >= 0:
            inverse[i] = -(slot + 2)
        else:
            keys[m] = (row << POS_BITS) | i
            m += 1
    return m


@numba.njit(nogil=True, cache=True)
def _previous_gather(  # type: ignore[no-untyped-def]
    uniq, a, b, seg_start, bases, row_bytes, field_off, records, shard_starts, scalars, s2
):
    n_f = row_bytes.size
    for j in range(a, min(b, a + _AHEAD)):
        s = segment(uniq[j], seg_start)
        for f in range(n_f):
            prefetch(bases[f, s] + (uniq[j] - seg_start[s]) * row_bytes[f])
    for j in range(a, b):
        ahead = j + _AHEAD
        if ahead < b:
            s = segment(uniq[ahead], seg_start)
            for f in range(n_f):
                addr = bases[f, s] + (uniq[ahead] - seg_start[s]) * row_bytes[f]
                prefetch(addr)
                prefetch(addr + row_bytes[f] - 1)
        row = uniq[j]
        s = segment(row, seg_start)
        dst = records[j]
        for f in range(n_f):
            nb = row_bytes[f]
            src = numba.carray(ptr(bases[f, s] + (row - seg_start[s]) * nb), nb, np.uint8)
            off = field_off[f]
            dst[off : off + nb] = src
        if s2.size:
            s2[j] = scalars[segment(row, shard_starts)]


@numba.njit(nogil=True, cache=True, parallel=True)
def _previous_stage_rows(  # type: ignore[no-untyped-def]
    keys, inverse, uniq, chunk_rows, max_chunks, seg_start, bases, row_bytes, field_off,
    records, shard_starts, scalars, s2,
):  # fmt: skip
    n_unique = unique_sorted(keys, inverse, uniq)
    chunks = max(1, min(max_chunks, n_unique // chunk_rows))
    for c in numba.prange(chunks):
        a = n_unique * c // chunks
        b = n_unique * (c + 1) // chunks
        _previous_gather(uniq, a, b, seg_start, bases, row_bytes, field_off, records,
                         shard_starts, scalars, s2)  # fmt: skip
    return n_unique


class Previous:
    """The previous ``StagedTable._fill`` over the same table, slot map and slot layout."""

    def __init__(self, stager: HostStager):
        self.stager = stager
        self.keys = np.empty(stager.max_ids, np.int64)
        self.uniq = np.empty(stager.max_ids, np.int64)
        self.no_map = np.empty(0, np.int32)

    def fill(self, host: np.ndarray, ids: np.ndarray) -> int:
        st, src = self.stager, self.stager.src
        flat = np.ascontiguousarray(ids.reshape(-1), dtype=np.int64)
        n, rb = flat.size, st.record_bytes
        lo, hi = st.row_range
        s2_at, rec_at, _ = st.offsets(n, 0)
        inverse = host[: 4 * n].view(np.int32)
        s2 = host[s2_at : s2_at + (4 * n if src.scalars.size else 0)].view(np.float32)
        records = host[rec_at : rec_at + n * rb].reshape(n, rb)
        slot_map = self.no_map if st.slot_map is None else st.slot_map
        m = _previous_keys(flat, lo, hi, slot_map, self.keys, inverse)
        keys = self.keys[:m]
        keys.sort()
        return int(_previous_stage_rows(
            keys, inverse, self.uniq, CHUNK_ROWS, st.knobs.workers, src.seg_start, src.bases,
            src.row_bytes, src.field_off, records, src.shard_starts, src.scalars, s2,
        ))  # fmt: skip


def resolved(stager: HostStager, host: np.ndarray, n_ids: int, n_unique: int) -> np.ndarray:
    """Each id's staged bytes as the kernel resolves them: uint8 ``[n_ids, 1 + R + 4]``
    (kind: 0 outside, 1 cache hit, 2 staged; then the record or the cache slot, then
    scale_2), so two slots compare id by id whatever order their records are in."""
    s2_at, rec_at, _ = stager.offsets(n_ids, n_unique)
    rb = stager.record_bytes
    inverse = host[: 4 * n_ids].view(np.int32)
    records = host[rec_at : rec_at + n_unique * rb].reshape(n_unique, rb)
    out = np.zeros((n_ids, 1 + rb + 4), np.uint8)
    staged = inverse >= 0
    out[:, 0] = np.where(inverse == -1, 0, np.where(staged, 2, 1))
    out[staged, 1 : 1 + rb] = records[inverse[staged]]
    hit = inverse <= -2
    out[hit, 1:5] = (-(inverse[hit] + 2)).astype(np.int32).view(np.uint8).reshape(-1, 4)
    if stager.src.scalars.size:
        s2 = host[s2_at : s2_at + 4 * n_unique].view(np.uint8).reshape(n_unique, 4)
        out[staged, 1 + rb :] = s2[inverse[staged]]
    return out


def time_variants(stager: HostStager, variants: dict[str, Any], draw: Any, count: int,
                  checks: list[np.ndarray]) -> dict[str, list[float]]:  # fmt: skip
    """Microseconds per step of each variant (``name -> fill(ids) -> (slot, n_unique)``),
    each on ``count`` fresh steps of its own (``draw(k)``: k id sets), in turns; no step twice, so rows are as
    cold as a served model's (only the hot ones recur, as in the text). Then every variant
    stages each of ``checks``, and every id must get the same row as from the first."""
    own = {name: draw(count + 1) for name in variants}
    times: dict[str, list[float]] = {name: [] for name in variants}
    times["unique_rows"] = []
    for i in range(count + 1):  # step 0 warms up (numba compiles on first use)
        for name, fill in variants.items():
            t0 = time.perf_counter()
            _, n = fill(own[name][i])
            if i:
                times[name].append((time.perf_counter() - t0) * 1e6)
                if name == "us":
                    times["unique_rows"].append(n)
    for ids in checks:
        first = None
        for name, fill in variants.items():
            slot, n = fill(ids)
            got = resolved(stager, slot, ids.size, n)
            if first is None:
                first = got
            elif not np.array_equal(got, first):
                raise SystemExit(f"error: staged-host: {name} staged other rows than "
                                 f"{next(iter(variants))} for a step of {ids.shape[0]} "
                                 "tokens")  # fmt: skip
    return times


def parts(stager: HostStager, slot: np.ndarray, draw: Any, count: int) -> dict[str, list[float]]:
    """Where this version's time goes, on ``count`` fresh steps each: the dedup alone
    (``dedup_us``: the hit index + a hash table or the slot map, or keys + numpy's sort +
    unique), then the gather of the step's unique rows on this thread (``gather1_us``) or on
    numba's threads (``gatherN_us``), into ``slot`` (``stager``'s slot 0) with buffers of
    its own."""
    lo, hi = stager.row_range
    knobs, n_max = stager.knobs, stager.max_ids
    words = slot[: stager.slot_bytes].view(np.int32)
    fwords = slot[: stager.slot_bytes].view(np.float32)
    addr = int(slot.ctypes.data)
    rows, shards = stager.src.rows, stager.src.shards
    uniq, pos, keys = (np.empty(n_max, np.int64) for _ in range(3))
    table = np.empty(2 * min(n_max, knobs.hash_ids), np.int32)
    rb = stager.record_bytes
    out: dict[str, list[float]] = {"dedup_us": [], "gather1_us": [], "gatherN_us": []}
    for i, ids in enumerate(draw(2 * count + 1)):
        flat = flat_ids(ids)
        s2_at, rec_at, _ = stager.offsets(flat.size, 0)
        t0 = time.perf_counter()
        if stager.slot_map is not None and flat.size <= knobs.hash_ids:
            n = dedup_hashed(flat, lo, hi, stager.hit_index, table, words, uniq, pos)
        elif stager.slot_map is not None:
            n = dedup_misses(flat, lo, hi, stager.hit_index, stager.slot_map, words, uniq, pos)
        else:
            m = sort_keys(flat, lo, hi, keys, words)
            part = keys[:m]
            part.sort()
            n = unique_sorted(part, words, uniq)
        t1 = time.perf_counter()
        if i % 2:
            gather_into(uniq, 0, n, *rows, addr + rec_at, rb, *shards, fwords, s2_at >> 2,
                        knobs.depth)  # fmt: skip
        else:
            gather_parallel(uniq, n, knobs.chunk_rows, knobs.workers, *rows, addr + rec_at,
                            rb, *shards, fwords, s2_at >> 2, knobs.depth)  # fmt: skip
        t2 = time.perf_counter()
        if i:  # the first compiles
            out["dedup_us"].append((t1 - t0) * 1e6)
            out["gather1_us" if i % 2 else "gatherN_us"].append((t2 - t1) * 1e6)
    return out


def staged_host(bench: Any, root: Any) -> None:
    """The section: both versions at T <= 8192 on uniform and text ids, no cache and a 2 GB
    cache of the profile's hot rows (``--repeats`` x 16 steps, x 4 at T = 8192, for each).
    At T <= 512 this version also with every step on one thread (``serial``), every step on
    numba's threads (``threads``), for ``serial_rows``, the misses deduplicated through the
    slot map instead of a hash table (``slot_map``, for ``hash_ids``), classified through the
    hit index alone, without the group memo (``index_only``, for ``memo_lines``), and
    prefetching 16 or all rows ahead (``depth16``, ``depth_all``); at 8192 with the hit index
    read on one thread (``one_pass``, for ``parallel_ids``), 16 rows ahead and 16 gather
    threads (``w16``). Each setting is a stager of its own (``StageKnobs`` are fixed at
    construction) sharing the default one's cache. ``parts``: the dedup and the gather
    alone."""
    args, rng, heads = bench.args, bench.rng, 16
    print(f"staged-host: {platform.machine()}, {os.cpu_count()} cores, numba "
          f"{numba.config.NUMBA_NUM_THREADS} threads, seed {args.seed}", flush=True)  # fmt: skip
    table = open_table_mmap(bench.staged_sidecar(root))
    sizes = [t for t in bench.sizes if t <= 8192]
    stager = HostStager(table.stored(), stager_layout(table), table.row_range, max(sizes) * heads)
    new_slot = np.zeros(stager.slot_bytes, np.uint8)
    old_slot = np.zeros(stager.slot_bytes, np.uint8)
    stager.add_slot(new_slot)
    prefault_pages(table)
    bench.huge_share(root)
    prev = Previous(stager)

    others: dict[StageKnobs, tuple[HostStager, np.ndarray]] = {}

    def ours(**change: int) -> Any:
        """This version's fill with some knobs changed (the rest at their defaults): a stager
        of its own, serving from the default stager's cache (its first, untimed, step builds
        its context)."""
        knobs = StageKnobs(**change)
        if knobs == stager.knobs:
            st, slot = stager, new_slot
        elif knobs in others:
            st, slot = others[knobs]
        else:
            st = HostStager(table.stored(), stager_layout(table), table.row_range,
                            stager.max_ids, knobs)  # fmt: skip
            slot = np.zeros(st.slot_bytes, np.uint8)
            st.add_slot(slot)
            st.share(stager)
            others[knobs] = st, slot

        def fill(ids: np.ndarray) -> tuple[np.ndarray, int]:
            return slot, st.fill(0, flat_ids(ids))

        return fill

    variants = {"previous_us": lambda ids: (old_slot, prev.fill(old_slot, ids)), "us": ours()}
    for gb in (0, 2):
        t0 = time.perf_counter()
        stager.cache_rows(bench.text.profile_rows % args.staged_rows, gb << 30)
        for st, _ in others.values():
            st.share(stager)
        cached = 0 if stager.slot_map is None else int((stager.slot_map >= 0).sum())
        print(f"staged-host cache {gb} GB: {cached:,} rows (built in "
              f"{time.perf_counter() - t0:.1f} s)", flush=True)  # fmt: skip
        for kind in ("uniform", "text"):
            for t in sizes:
                n = 2 if bench.device == "cpu" else args.repeats * (16 if t < 8192 else 4)

                def draw(k: int, t: int = t, kind: str = kind) -> list[np.ndarray]:
                    if kind == "uniform":
                        return [rng.integers(0, args.staged_rows, (t, heads)) for _ in range(k)]
                    return bench.text.host_sets(t, k, rng, args.staged_rows)

                checks = draw(2)
                slot_map = stager.slot_map
                hit = 0.0 if slot_map is None else float(np.mean([(slot_map[s] >= 0).mean()
                                                                   for s in checks]))  # fmt: skip
                if t <= 512:  # serial_rows, hash_ids, depth
                    more = {"serial_us": ours(serial_rows=1 << 30),
                            "threads_us": ours(serial_rows=-1),
                            "depth16_us": ours(depth=16), "depth_all_us": ours(depth=1 << 20)}
                    if gb:
                        more["slot_map_us"] = ours(hash_ids=0)
                        more["index_only_us"] = ours(memo_lines=0)
                else:  # parallel_ids, all 16 cores, depth
                    more = {"one_pass_us": ours(parallel_ids=1 << 30)} if gb else {}
                    more["depth16_us"] = ours(depth=16)
                    if (os.cpu_count() or 1) >= 16:
                        more["w16_us"] = ours(workers=16)
                times = time_variants(stager, {**variants, **more}, draw, n, checks)
                times |= parts(stager, new_slot, draw, max(4, n // 4))
                row = {"case": "staged-host", "cache_GB": gb, "ids": kind, "T": t,
                       "hit_rate": hit, "cached_rows": cached,
                       "unique_rows": int(statistics.median(times.pop("unique_rows"))),
                       "us_min": min(times["us"]), "us_max": max(times["us"]),
                       **{k: statistics.median(v) for k, v in times.items()}}  # fmt: skip
                bench.results.append(row)
                extra = "".join(f"  {k[:-3]} {row[k]:.1f}"
                                for k in [*more, "dedup_us", "gather1_us", "gatherN_us"])
                print(f"staged-host int4 cache {gb}GB {kind:>7} T={t:>5}: {row['us']:8.1f} us "
                      f"[{row['us_min']:.1f}..{row['us_max']:.1f}]  previous "
                      f"{row['previous_us']:8.1f} us  x{row['previous_us'] / row['us']:.2f}  "
                      f"({row['unique_rows']} unique rows, hit {hit:.1%}){extra}",
                      flush=True)  # fmt: skip
    stager.cache_rows(np.empty(0, np.int64), 0)
    print(f"staged-host: numba threading layer {numba.threading_layer()}", flush=True)


def stager_layout(table: Any) -> Any:
    return record_layout(table.codec, table.width)


def open_table_mmap(path: Any) -> Any:
    from flashnext.host import open_table

    return open_table(path, "mmap")

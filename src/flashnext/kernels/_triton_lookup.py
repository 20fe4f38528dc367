"""The fused gather + dequantize Triton kernel and its launcher (no allocation, no host sync).

One program handles ``BLOCK_R`` ids (flattened ``[T * heads]``) and all ``width`` columns of
their rows. Per id: ``valid = row_start <= id < row_end`` (so -1 and other ranks' ids give
+0.0 rows), the record is read from the device cache when the slot map has the row, else from
the table (device memory or pinned host memory through UVA), and dequantized in float32 in the
order of :mod:`flashnext.ple.formats` (``E2M1[code] * scale`` is exact, then ``* scale_2``),
then rounded once to bf16. With ``CODED`` (the staged path's device cache) an id ``<= -2`` names
cache slot ``-id - 2`` instead of a row (and its nvfp4 ``scale_2`` comes from ``cache_s2``): the
host already split the step into hits and misses. With a permutation the ids come sorted (neighbouring programs read
neighbouring rows: measured up to 3.6x faster over UVA at 1M ids) and each row is written to
its id's original place. Lookup tables for e2m1 and e4m3 codes come from ``formats`` too.
With a flag (the graph-staged handover) the kernel first waits until the host has filled the
pinned slot it reads, and its last program writes the flag back (see ``launch_lookup``).
"""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl

#: Kernel format codes (the kernel is specialised per format).
FMT_CODES = {"bf16": 0, "fp8": 1, "int4": 2, "nvfp4": 3}
#: nvfp4 ``weight_scale_2``: 0 = none, 1 = per shard (binary search of shard starts),
#: 2 = per table row (the staged path stores one per staged row).
S2_NONE, S2_PER_SHARD, S2_PER_ROW = 0, 1, 2
BLOCK_R = 64
MIN_BLOCK_R = 1
SPREAD = 1024  # programs to aim for before blocks grow past MIN_BLOCK_R
NUM_WARPS = 8


@triton.jit
def _shard_of(gid, starts_ptr, n_shards, STEPS: tl.constexpr):
    """Index of the last shard start <= gid (branch-free binary search, 2**STEPS > n_shards)."""
    lo = tl.zeros(gid.shape, dtype=tl.int32)
    for i in tl.static_range(STEPS):
        cand = lo + (1 << (STEPS - 1 - i))
        inside = cand < n_shards
        start = tl.load(starts_ptr + tl.where(inside, cand, 0))
        lo = tl.where(inside & (start <= gid), cand, lo)
    return lo


@triton.jit
def _bf16_bits(val):
    """float32 -> bf16 bits, round to nearest even (spelled out: the interpreter truncates)."""
    bits = val.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return tl.where(val != val, 0x7FC0, rounded).to(tl.uint16)


@triton.jit
def _poll(ptr, POLL: tl.constexpr):
    """Spin until the int32 at ``ptr`` is not 0; returns it. One lane of the program polls
    (volatile loads: every poll reads memory again, none is served from L1); the reduction
    hands the value to the others behind a barrier."""
    lane = tl.arange(0, POLL)
    first = lane == 0
    seen = tl.max(tl.load(ptr + lane * 0, mask=first, other=0, volatile=True), axis=0)
    while seen == 0:
        seen = tl.max(tl.load(ptr + lane * 0, mask=first, other=0, volatile=True), axis=0)
    return seen


@triton.jit
def _wait_flag(flag_ptr, count_ptr, POLL: tl.constexpr):
    """Wait until the int32 at ``flag_ptr`` (pinned host memory, read through UVA) is not 0;
    returns its value minus 1 (0: the host only ever writes 1), which the caller adds to its
    first slot address, so that no slot read can be issued before the flag was seen.

    One program polls the host: the first to take a ticket from ``count_ptr[0]`` (int32,
    device memory; a ticket, not program 0, so the poller is one that already runs), which
    relays the flag through ``count_ptr[1]``; the others poll that word in the GPU's L2.
    Every program polling the host flag itself was measured ~12x slower on the H200 (its reads
    of one host word are served one after another: ~1 us each, ~500 us for 512 programs).
    """
    ticket = tl.atomic_add(count_ptr, 1, sem="relaxed", scope="gpu")
    if ticket == 0:
        seen = _poll(flag_ptr, POLL)
        tl.atomic_xchg(count_ptr + 1, seen, sem="release", scope="gpu")
    else:
        seen = _poll(count_ptr + 1, POLL)
    return seen - 1


@triton.jit
def _hand_back(flag_ptr, count_ptr):
    """The last program to finish writes the flag back to 0 (the host may refill the slot):
    every program counts itself in ``count_ptr[0]`` once its slot reads have returned (its
    stores used them), after its ticket of :func:`_wait_flag`, and the one that counts last
    resets both counter words for the next launch, then the flag."""
    tl.debug_barrier()
    done = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu")
    if done == 2 * tl.num_programs(0) - 1:
        tl.store(count_ptr, 0)
        tl.store(count_ptr + 1, 0)
        tl.store(flag_ptr, 0)


@triton.jit
def _lookup_kernel(
    ids_ptr,
    out_ptr,
    n_ids,
    rec_ptr,
    slot_ptr,
    cache_ptr,
    e2m1_ptr,
    e4m3_ptr,
    s2_ptr,
    starts_ptr,
    n_shards,
    row_start,
    row_end,
    perm_ptr,
    cache_s2_ptr,
    flag_ptr,
    count_ptr,
    FMT: tl.constexpr,
    WIDTH: tl.constexpr,
    BLOCK_W: tl.constexpr,
    REC: tl.constexpr,
    SCALE_OFF: tl.constexpr,
    HAS_CACHE: tl.constexpr,
    S2_MODE: tl.constexpr,
    SHARD_STEPS: tl.constexpr,
    HAS_PERM: tl.constexpr,
    CODED: tl.constexpr,
    WAIT: tl.constexpr,
    POLL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Gather + dequant of BLOCK ids per program into bf16 rows (see ``launch_lookup``).

    Length: one fused kernel (a Triton helper per format would not shorten it); 28 of its
    lines are the parameter list.
    """
    ready = 0
    # the ids (and the rows they name) are the host's once the flag reads 1. Waiting before
    # anything else is computed: with the wait after r (BLOCK = 64) ptxas kept 128 registers a
    # thread instead of 77 (2 programs an SM instead of 3: measured ~12% slower at T = 8192)
    if WAIT:
        ready = _wait_flag(flag_ptr, count_ptr, POLL)
    r = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    rmask = r < n_ids
    gid = tl.load(ids_ptr + r + ready, mask=rmask, other=-1).to(tl.int64)
    valid = (gid >= row_start) & (gid < row_end)
    local = tl.where(valid, gid - row_start, 0)
    base = rec_ptr + local * REC
    if HAS_CACHE:
        slot = tl.load(slot_ptr + local, mask=valid, other=-1)
        base = tl.where(slot >= 0, cache_ptr + slot.to(tl.int64) * REC, base)
    row_ok = valid
    if CODED:  # noqa: SIM108 (constexpr branch)  ids <= -2 are device-cache slots
        hit = gid <= -2
    else:
        hit = gid < gid  # never
    cslot = tl.where(hit, -gid - 2, 0)
    if CODED:
        base = tl.where(hit, cache_ptr + cslot * REC, base)
        valid = valid | hit
    c = tl.arange(0, BLOCK_W)
    cmask = c < WIDTH
    m2 = valid[:, None] & cmask[None, :]
    cols = base[:, None] + c[None, :]
    if FMT == 0:
        w = tl.load((base[:, None] + 2 * c[None, :]).to(tl.pointer_type(tl.uint16)), mask=m2)
        val = (w.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    elif FMT == 1:
        code = tl.load(cols, mask=m2, other=0)
        scale = tl.load((base + SCALE_OFF).to(tl.pointer_type(tl.float32)), mask=valid, other=0.0)
        val = tl.load(e4m3_ptr + code.to(tl.int32)) * scale[:, None]
    else:
        byte = tl.load(base[:, None] + (c // 2)[None, :], mask=m2, other=0)
        nib = (byte.to(tl.int32) >> ((c % 2) * 4)[None, :]) & 0xF
        if FMT == 2:
            sptr = base[:, None] + SCALE_OFF + (c // 16)[None, :] * 2
            scale = tl.load(sptr.to(tl.pointer_type(tl.float16)), mask=m2, other=0.0)
            val = (nib - 8).to(tl.float32) * scale.to(tl.float32)
        else:
            scode = tl.load(base[:, None] + SCALE_OFF + (c // 16)[None, :], mask=m2, other=0)
            val = tl.load(e2m1_ptr + nib) * tl.load(e4m3_ptr + scode.to(tl.int32))
            if S2_MODE == 1:
                s2 = tl.load(s2_ptr + _shard_of(gid, starts_ptr, n_shards, SHARD_STEPS))
            else:
                s2 = tl.load(s2_ptr + local, mask=row_ok, other=0.0)
                if CODED:
                    s2 = tl.where(hit, tl.load(cache_s2_ptr + cslot, mask=hit, other=0.0), s2)
            val = val * s2[:, None]
    val = tl.where(m2, val, 0.0)
    if HAS_PERM:  # noqa: SIM108 (constexpr branch)  ids were sorted: id r goes to row perm[r]
        orow = tl.load(perm_ptr + r, mask=rmask, other=0).to(tl.int64)
    else:
        orow = r
    optr = (out_ptr + orow[:, None] * WIDTH + c[None, :]).to(tl.pointer_type(tl.uint16))
    tl.store(optr, _bf16_bits(val), mask=rmask[:, None] & cmask[None, :])
    if WAIT:
        _hand_back(flag_ptr, count_ptr)


def launch_lookup(
    ids: Any,
    out: Any,
    records: Any,
    *,
    fmt: str,
    width: int,
    record_bytes: int,
    scale_offset: int,
    row_start: int,
    row_end: int,
    e2m1: Any,
    e4m3: Any,
    s2: Any,
    s2_mode: int,
    shard_starts: Any,
    slot_map: Any = None,
    cache: Any = None,
    perm: Any = None,
    coded_cache: Any = None,
    cache_s2: Any = None,
    flag: Any = None,
    counts: Any = None,
) -> None:
    """Launch the kernel on the current stream: ``out`` [n, width] bf16 from ``ids`` [n]
    (with ``perm`` int64 [n]: row ``perm[i]`` of ``out`` from ``ids[i]``; with ``coded_cache``
    uint8 [slots, record_bytes] (and ``cache_s2`` float32 [slots] for nvfp4): ids ``<= -2`` read
    slot ``-id - 2`` of it; the staged path's device cache, exclusive with ``slot_map``). With
    ``flag`` (int32 [1], pinned, as a UVA pointer) and ``counts`` (int32 [2] on the device,
    zeros; the kernel leaves them so): the graph-staged handover. The kernel first waits until
    the flag is not 0 (the host filled ``ids``, ``records`` and ``s2``), and its last program
    to finish writes the flag back to 0.

    All arguments are tensors (or UVA pointer wrappers) already on or mapped to the device;
    the launcher reads only shapes, so it is safe inside CUDA graph capture.

    Length: one keyword per kernel argument; splitting it would only move the list.
    """
    n = ids.numel()
    if n == 0:
        return
    n_shards = int(shard_starts.numel())
    has_cache = slot_map is not None
    # Few ids (decode): fewer rows per program, so more SMs issue loads (UVA reads are
    # latency-bound); many ids: BLOCK_R rows per program (measured fastest).
    block = min(BLOCK_R, max(MIN_BLOCK_R, triton.next_power_of_2(triton.cdiv(n, SPREAD))))
    _lookup_kernel[(triton.cdiv(n, block),)](
        ids,
        out,
        n,
        records,
        slot_map if has_cache else ids,
        cache if has_cache else (coded_cache if coded_cache is not None else records),
        e2m1,
        e4m3,
        s2,
        shard_starts,
        n_shards,
        row_start,
        row_end,
        perm if perm is not None else ids,
        cache_s2 if cache_s2 is not None else s2,
        flag if flag is not None else ids,
        counts if counts is not None else ids,
        FMT=FMT_CODES[fmt],
        WIDTH=width,
        BLOCK_W=triton.next_power_of_2(width),
        REC=record_bytes,
        SCALE_OFF=scale_offset,
        HAS_CACHE=has_cache,
        S2_MODE=s2_mode,
        SHARD_STEPS=max(1, n_shards.bit_length()),
        HAS_PERM=perm is not None,
        CODED=coded_cache is not None,
        WAIT=flag is not None,
        POLL=32 * NUM_WARPS,
        BLOCK=block,
        num_warps=NUM_WARPS,
    )

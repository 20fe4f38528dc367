"""Fused gather + dequantize kernels for :class:`flashnext.ple.table.PLETable` (numba, nogil).

One kernel per format reads each id's stored bytes straight from wherever the row lives (a
shard's memory map, a resident copy, or the hot-tier copy) and writes the dequantized row once,
as float32 or as bfloat16 (float32 rounded to nearest-even), with no intermediate arrays. A
generic kernel copies the stored bytes of one tensor (``gather_raw``).

Where a row lives (the *locator*, built once at open by the table):

- ``geo`` int64 [6]: rows per shard, first open shard, row_range start, row_range end, the
  table's row count, the format's group size.
- ``seg_start`` int64 [S]: global row held at ``bases[t, k]`` for open shard ``k``.
- ``bases`` int64 [T, S + 1]: address of tensor ``t``'s row ``seg_start[k]``; column ``S`` is
  the hot-tier copy, whose row ``j`` holds global row ``hot_ids[j]``; ``row_bytes`` int64 [T].
- ``hot_ids`` int64 [H], sorted ascending (empty without a hot tier).
- ``scalars`` float32 [S]: the per-shard scalar (nvfp4 ``weight_scale_2``; ones otherwise).

Every kernel takes ``ids`` int64 [n] and a slice ``[lo, hi)`` of it (callers split big batches
over threads; the GIL is released) and returns the index of the first id outside
``[-1, num_rows)``, or -1. Ids of padding (-1) or outside row_range give zero rows (raw:
the format's pad bytes). The constants (e2m1 codes, e4m3/fp16 decode tables, group size, pad
bytes) come from :mod:`flashnext.ple.formats` through the caller; nothing is restated here.

The addresses are only valid while the table holds its arrays: callers keep a reference to
them for the duration of a call.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, overload

_OUT = -1  # padding or outside row_range: a zero row
_BAD = -2  # not a row id of the table


@intrinsic
def _ptr(typingctx, address):  # type: ignore[no-untyped-def]
    """An integer address as a ``void*`` for :func:`numba.carray`."""
    if not isinstance(address, types.Integer):
        return None

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.inttoptr(args[0], cgutils.voidptr_t)

    return types.voidptr(address), codegen


@intrinsic
def _prefetch(typingctx, address):  # type: ignore[no-untyped-def]
    """Hint the CPU to load the cache line at ``address`` (never faults)."""
    if not isinstance(address, types.Integer):
        return None

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        ptr = builder.inttoptr(args[0], cgutils.voidptr_t)
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [cgutils.voidptr_t, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
        builder.call(fn, [ptr, i32(0), i32(3), i32(1)])  # read, keep in all levels, data
        return context.get_dummy_value()

    return types.none(address), codegen


@numba.njit(nogil=True, cache=True)
def _locate(row, geo, seg_start, hot_ids):  # type: ignore[no-untyped-def]
    """(column of ``bases``, local row, open shard) of global ``row``; column -1/-2 = pad/bad."""
    if row < -1 or row >= geo[4]:
        return _BAD, 0, 0
    if row < geo[2] or row >= geo[3]:  # padding (-1) included: geo[2] >= 0
        return _OUT, 0, 0
    shard = row // geo[0] - geo[1]
    n_hot = hot_ids.size
    if n_hot:
        lo, hi = 0, n_hot
        while lo < hi:
            mid = (lo + hi) >> 1
            if hot_ids[mid] < row:
                lo = mid + 1
            else:
                hi = mid
        if lo < n_hot and hot_ids[lo] == row:
            return seg_start.size, lo, shard
    return shard, row - seg_start[shard], shard


@numba.njit(nogil=True, cache=True)
def _resolve(ids, b0, b1, geo, seg_start, bases, row_bytes, hot_ids, where):  # type: ignore[no-untyped-def]
    """Fill ``where[i - b0]`` = (address of each tensor's row..., open shard) for ids
    ``[b0, b1)`` and prefetch the rows, so the decode loop finds them in cache. Padding gets
    address -1. Returns the first bad id's index or -1."""
    n_t = row_bytes.size
    for i in range(b0, b1):
        col, local, shard = _locate(ids[i], geo, seg_start, hot_ids)
        if col == _BAD:
            return i
        slot = where[i - b0]
        slot[n_t] = shard
        for t in range(n_t):
            if col == _OUT:
                slot[t] = -1
                continue
            address = bases[t, col] + local * row_bytes[t]
            slot[t] = address
            _prefetch(address)
            _prefetch(address + row_bytes[t] - 1)
    return -1


def _row_of(out, i, scratch):  # type: ignore[no-untyped-def]
    """Where row ``i`` is decoded: ``out[i]`` itself (float32 out) or ``scratch`` (bfloat16)."""


@overload(_row_of, jit_options={"nogil": True, "cache": True})  # type: ignore[typeddict-unknown-key]
def _row_of_impl(out, i, scratch):  # type: ignore[no-untyped-def]
    if out.dtype == types.float32:
        return lambda out, i, scratch: out[i]
    return lambda out, i, scratch: scratch


def _finish(out, i, scratch):  # type: ignore[no-untyped-def]
    """Round the decoded ``scratch`` into bfloat16 row ``i`` of ``out`` (uint16 bits) to
    nearest-even, NaN kept NaN; nothing to do for float32 out."""


@overload(_finish, jit_options={"nogil": True, "cache": True})  # type: ignore[typeddict-unknown-key]
def _finish_impl(out, i, scratch):  # type: ignore[no-untyped-def]
    if out.dtype == types.float32:
        return lambda out, i, scratch: None

    def to_bf16(out, i, scratch):  # type: ignore[no-untyped-def]
        bits = scratch.view(np.uint32)
        dst = out[i]
        for j in range(bits.size):
            b = bits[j]
            if (b & 0x7FFFFFFF) > 0x7F800000:
                dst[j] = (b >> 16) | 0x40
            else:
                dst[j] = (b + 0x7FFF + ((b >> 16) & 1)) >> 16

    return to_bf16


@numba.njit(nogil=True, cache=True)
def _zero(out, i):  # type: ignore[no-untyped-def]
    dst = out[i]
    for j in range(dst.size):
        dst[j] = 0


#: Ids resolved (and their rows prefetched) ahead of decoding: enough loads in flight to
#: hide memory latency, few enough that the rows are still in L1/L2 when decoded.
BLOCK = 32


@numba.njit(nogil=True, cache=True)
def lookup_bf16(ids, lo, hi, geo, seg_start, bases, row_bytes, hot_ids, scalars, out):  # type: ignore[no-untyped-def]
    """bf16 rows -> ``out``: float32 [n, w], or uint16 [n, w] holding bfloat16 bits."""
    w = out.shape[1]
    scratch = np.empty(w, np.float32)
    where = np.empty((BLOCK, row_bytes.size + 1), np.int64)
    for b0 in range(lo, hi, BLOCK):
        b1 = min(b0 + BLOCK, hi)
        bad = _resolve(ids, b0, b1, geo, seg_start, bases, row_bytes, hot_ids, where)
        if bad >= 0:
            return bad
        for i in range(b0, b1):
            slot = where[i - b0]
            if slot[0] < 0:
                _zero(out, i)
                continue
            row = _row_of(out, i, scratch)
            src = numba.carray(_ptr(slot[0]), w, np.uint16)
            bits = row.view(np.uint32)
            for j in range(w):
                bits[j] = np.uint32(src[j]) << 16
            _finish(out, i, scratch)
    return -1


@numba.njit(nogil=True, cache=True)
def lookup_fp8(ids, lo, hi, geo, seg_start, bases, row_bytes, hot_ids, scalars, e4m3, out):  # type: ignore[no-untyped-def]
    """fp8 rows (e4m3 codes x per-row float32 scale) -> ``out``; ``e4m3`` float32 [256]."""
    w = out.shape[1]
    scratch = np.empty(w, np.float32)
    where = np.empty((BLOCK, row_bytes.size + 1), np.int64)
    for b0 in range(lo, hi, BLOCK):
        b1 = min(b0 + BLOCK, hi)
        bad = _resolve(ids, b0, b1, geo, seg_start, bases, row_bytes, hot_ids, where)
        if bad >= 0:
            return bad
        for i in range(b0, b1):
            slot = where[i - b0]
            if slot[0] < 0:
                _zero(out, i)
                continue
            row = _row_of(out, i, scratch)
            codes = numba.carray(_ptr(slot[0]), w, np.uint8)
            scale = numba.carray(_ptr(slot[1]), 1, np.float32)[0]
            for j in range(w):
                row[j] = e4m3[codes[j]] * scale
            _finish(out, i, scratch)
    return -1


@numba.njit(nogil=True, cache=True)
def lookup_int4(ids, lo, hi, geo, seg_start, bases, row_bytes, hot_ids, scalars, fp16, out):  # type: ignore[no-untyped-def]
    """int4 rows ((nibble - 8) x fp16 group scale) -> ``out``; ``fp16`` float32 [65536]."""
    w = out.shape[1]
    group = geo[5]
    half, groups, pairs = w // 2, w // group, group // 2
    scratch = np.empty(w, np.float32)
    where = np.empty((BLOCK, row_bytes.size + 1), np.int64)
    for b0 in range(lo, hi, BLOCK):
        b1 = min(b0 + BLOCK, hi)
        bad = _resolve(ids, b0, b1, geo, seg_start, bases, row_bytes, hot_ids, where)
        if bad >= 0:
            return bad
        for i in range(b0, b1):
            slot = where[i - b0]
            if slot[0] < 0:
                _zero(out, i)
                continue
            row = _row_of(out, i, scratch)
            codes = numba.carray(_ptr(slot[0]), half, np.uint8)
            scales = numba.carray(_ptr(slot[1]), groups, np.uint16)
            for g in range(groups):
                s = fp16[scales[g]]
                for k in range(pairs):
                    b = codes[g * pairs + k]
                    row[g * group + 2 * k] = np.float32(np.int32(b & 15) - 8) * s
                    row[g * group + 2 * k + 1] = np.float32(np.int32(b >> 4) - 8) * s
            _finish(out, i, scratch)
    return -1


@numba.njit(nogil=True, cache=True)
def lookup_nvfp4(ids, lo, hi, geo, seg_start, bases, row_bytes, hot_ids, scalars, e2m1, e4m3, out):  # type: ignore[no-untyped-def]
    """nvfp4 rows (e2m1 code x e4m3 group scale x shard scale) -> ``out``.

    ``e2m1`` float32 [16] (sign included), ``e4m3`` float32 [256]. The product is taken as
    ``(code * scale) * scale_2`` in float32, the order of the numpy codec (the first is exact).
    """
    w = out.shape[1]
    group = geo[5]
    half, groups, pairs = w // 2, w // group, group // 2
    n_t = row_bytes.size
    scratch = np.empty(w, np.float32)
    where = np.empty((BLOCK, n_t + 1), np.int64)
    for b0 in range(lo, hi, BLOCK):
        b1 = min(b0 + BLOCK, hi)
        bad = _resolve(ids, b0, b1, geo, seg_start, bases, row_bytes, hot_ids, where)
        if bad >= 0:
            return bad
        for i in range(b0, b1):
            slot = where[i - b0]
            if slot[0] < 0:
                _zero(out, i)
                continue
            row = _row_of(out, i, scratch)
            s2 = scalars[slot[n_t]]
            codes = numba.carray(_ptr(slot[0]), half, np.uint8)
            scales = numba.carray(_ptr(slot[1]), groups, np.uint8)
            for g in range(groups):
                s = e4m3[scales[g]]
                for k in range(pairs):
                    b = codes[g * pairs + k]
                    row[g * group + 2 * k] = (e2m1[b & 15] * s) * s2
                    row[g * group + 2 * k + 1] = (e2m1[b >> 4] * s) * s2
            _finish(out, i, scratch)
    return -1


@numba.njit(nogil=True, cache=True)
def gather_tensor(
    ids, lo, hi, geo, seg_start, bases, row_bytes, hot_ids, scalars, t, pad, dst, dst_scalars
):  # type: ignore[no-untyped-def]
    """Stored bytes of tensor ``t`` -> ``dst`` uint8 [n, row_bytes[t]]; padding rows get byte
    ``pad``. When ``dst_scalars`` (float32 [n]) is not empty it receives each id's per-shard
    scalar (0 for padding)."""
    nbytes = row_bytes[t]
    n_t = row_bytes.size
    fill = dst_scalars.size > 0
    where = np.empty((BLOCK, n_t + 1), np.int64)
    for b0 in range(lo, hi, BLOCK):
        b1 = min(b0 + BLOCK, hi)
        bad = _resolve(ids, b0, b1, geo, seg_start, bases, row_bytes, hot_ids, where)
        if bad >= 0:
            return bad
        for i in range(b0, b1):
            slot = where[i - b0]
            row = dst[i]
            if slot[t] < 0:
                for j in range(nbytes):
                    row[j] = pad
                if fill:
                    dst_scalars[i] = 0.0
                continue
            src = numba.carray(_ptr(slot[t]), nbytes, np.uint8)
            for j in range(nbytes):
                row[j] = src[j]
            if fill:
                dst_scalars[i] = scalars[slot[n_t]]
    return -1


#: Batches smaller than this run on the calling thread (a thread hand-off costs ~20 us).
PARALLEL_MIN_IDS = 16_384
_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def default_threads() -> int:
    """Threads for big batches: ``FLASHNEXT_LOOKUP_THREADS`` or the CPUs this process may use."""
    env = os.environ.get("FLASHNEXT_LOOKUP_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def _pool() -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(
                max_workers=max(default_threads(), 1), thread_name_prefix="flashnext-lookup"
            )
        return _POOL


def run_split(kernel: Callable[..., int], ids: np.ndarray, args: tuple, threads: int) -> int:
    """Run ``kernel(ids, lo, hi, *args)`` over ``ids`` [n], split into ``threads`` slices when
    the batch is big; return the first bad id's index or -1 (kernels release the GIL)."""
    n = ids.shape[0]
    if threads <= 1 or n < PARALLEL_MIN_IDS:
        return int(kernel(ids, 0, n, *args))
    step = -(-n // threads)
    futures = [
        _pool().submit(kernel, ids, lo, min(lo + step, n), *args) for lo in range(step, n, step)
    ]
    bad = [int(kernel(ids, 0, step, *args))] + [int(f.result()) for f in futures]
    return min((b for b in bad if b >= 0), default=-1)

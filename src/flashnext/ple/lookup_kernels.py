"""Fused gather + dequantize kernels for :class:`flashnext.ple.table.PLETable` (numba, nogil).

One kernel per format reads each id's stored bytes straight from wherever the row lives (a
shard's memory map, a resident copy, or the hot-tier copy) and writes the dequantized row once,
as float32 or as bfloat16 (float32 rounded to nearest-even), with no intermediate arrays. A
generic kernel copies the stored bytes of one tensor (``gather_raw``).

Where a row lives (the *locator*, built once at open by the table):

- ``geo`` int64 [6]: rows per shard, first open shard, row_range start, row_range end, the
  table's row count, the format's group size.
- ``seg_start`` int64 [S]: global row held at ``bases[t, k]`` for open shard ``k``.
- ``bases`` uint64 [T, S + 1]: address of tensor ``t``'s row ``seg_start[k]``; column ``S`` is
  the hot-tier copy, whose row ``j`` holds global row ``hot_ids[j]``.
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
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

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


@numba.njit(nogil=True, cache=True, inline="always")
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


@numba.njit(nogil=True, cache=True, inline="always")
def _emit(out, i, bits):  # type: ignore[no-untyped-def]
    """Store float32 ``bits`` (uint32 [w]) in row ``i`` of ``out``: uint32 (float32) or uint16
    (bfloat16, rounded to nearest-even; NaN stays NaN)."""
    if out.itemsize == 4:
        for j in range(bits.size):
            out[i, j] = bits[j]
    else:
        for j in range(bits.size):
            b = bits[j]
            if (b & 0x7FFFFFFF) > 0x7F800000:
                out[i, j] = (b >> 16) | 0x40
            else:
                out[i, j] = (b + 0x7FFF + ((b >> 16) & 1)) >> 16


@numba.njit(nogil=True, cache=True, inline="always")
def _zero(out, i):  # type: ignore[no-untyped-def]
    for j in range(out.shape[1]):
        out[i, j] = 0


@numba.njit(nogil=True, cache=True)
def lookup_bf16(ids, lo, hi, geo, seg_start, bases, hot_ids, scalars, out):  # type: ignore[no-untyped-def]
    """bf16 rows -> ``out`` (uint32 view of float32 [n, w], or uint16 view of bfloat16)."""
    w = out.shape[1]
    bits = np.empty(w, np.uint32)
    for i in range(lo, hi):
        col, local, _ = _locate(ids[i], geo, seg_start, hot_ids)
        if col == _BAD:
            return i
        if col == _OUT:
            _zero(out, i)
            continue
        src = numba.carray(_ptr(bases[0, col] + local * 2 * w), w, np.uint16)
        for j in range(w):
            bits[j] = np.uint32(src[j]) << 16
        _emit(out, i, bits)
    return -1


@numba.njit(nogil=True, cache=True)
def lookup_fp8(ids, lo, hi, geo, seg_start, bases, hot_ids, scalars, e4m3, out):  # type: ignore[no-untyped-def]
    """fp8 rows (e4m3 codes x per-row float32 scale) -> ``out``; ``e4m3`` float32 [256]."""
    w = out.shape[1]
    row = np.empty(w, np.float32)
    bits = row.view(np.uint32)
    for i in range(lo, hi):
        col, local, _ = _locate(ids[i], geo, seg_start, hot_ids)
        if col == _BAD:
            return i
        if col == _OUT:
            _zero(out, i)
            continue
        codes = numba.carray(_ptr(bases[0, col] + local * w), w, np.uint8)
        scale = numba.carray(_ptr(bases[1, col] + local * 4), 1, np.float32)[0]
        for j in range(w):
            row[j] = e4m3[codes[j]] * scale
        _emit(out, i, bits)
    return -1


@numba.njit(nogil=True, cache=True)
def lookup_int4(ids, lo, hi, geo, seg_start, bases, hot_ids, scalars, fp16, out):  # type: ignore[no-untyped-def]
    """int4 rows ((nibble - 8) x fp16 group scale) -> ``out``; ``fp16`` float32 [65536]."""
    w = out.shape[1]
    group = geo[5]
    half, groups = w // 2, w // group
    row = np.empty(w, np.float32)
    bits = row.view(np.uint32)
    for i in range(lo, hi):
        col, local, _ = _locate(ids[i], geo, seg_start, hot_ids)
        if col == _BAD:
            return i
        if col == _OUT:
            _zero(out, i)
            continue
        codes = numba.carray(_ptr(bases[0, col] + local * half), half, np.uint8)
        scales = numba.carray(_ptr(bases[1, col] + local * 2 * groups), groups, np.uint16)
        for g in range(groups):
            s = fp16[scales[g]]
            for k in range(group // 2):
                b = codes[g * (group // 2) + k]
                row[g * group + 2 * k] = np.float32(np.int32(b & 15) - 8) * s
                row[g * group + 2 * k + 1] = np.float32(np.int32(b >> 4) - 8) * s
        _emit(out, i, bits)
    return -1


@numba.njit(nogil=True, cache=True)
def lookup_nvfp4(ids, lo, hi, geo, seg_start, bases, hot_ids, scalars, e2m1, e4m3, out):  # type: ignore[no-untyped-def]
    """nvfp4 rows (e2m1 code x e4m3 group scale x shard scale) -> ``out``.

    ``e2m1`` float32 [16] (sign included), ``e4m3`` float32 [256]. The product is taken as
    ``(code * scale) * scale_2`` in float32, the order of the numpy codec (the first is exact).
    """
    w = out.shape[1]
    group = geo[5]
    half, groups = w // 2, w // group
    row = np.empty(w, np.float32)
    bits = row.view(np.uint32)
    for i in range(lo, hi):
        col, local, shard = _locate(ids[i], geo, seg_start, hot_ids)
        if col == _BAD:
            return i
        if col == _OUT:
            _zero(out, i)
            continue
        s2 = scalars[shard]
        codes = numba.carray(_ptr(bases[0, col] + local * half), half, np.uint8)
        scales = numba.carray(_ptr(bases[1, col] + local * groups), groups, np.uint8)
        for g in range(groups):
            s = e4m3[scales[g]]
            for k in range(group // 2):
                b = codes[g * (group // 2) + k]
                row[g * group + 2 * k] = (e2m1[b & 15] * s) * s2
                row[g * group + 2 * k + 1] = (e2m1[b >> 4] * s) * s2
        _emit(out, i, bits)
    return -1


@numba.njit(nogil=True, cache=True)
def gather_tensor(ids, lo, hi, geo, seg_start, bases_t, hot_ids, scalars, pad, dst, dst_scalars):  # type: ignore[no-untyped-def]
    """Stored bytes of one per-row tensor -> ``dst`` uint8 [n, row_bytes] (``bases_t`` uint64
    [S + 1]); padding rows get byte ``pad``. When ``dst_scalars`` (float32 [n]) is not empty it
    receives each id's per-shard scalar (0 for padding)."""
    nbytes = dst.shape[1]
    fill = dst_scalars.size > 0
    for i in range(lo, hi):
        col, local, shard = _locate(ids[i], geo, seg_start, hot_ids)
        if col == _BAD:
            return i
        if col == _OUT:
            for j in range(nbytes):
                dst[i, j] = pad
            if fill:
                dst_scalars[i] = 0.0
            continue
        src = numba.carray(_ptr(bases_t[col] + local * nbytes), nbytes, np.uint8)
        for j in range(nbytes):
            dst[i, j] = src[j]
        if fill:
            dst_scalars[i] = scalars[shard]
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

"""Fused gather + dequantize kernels for :class:`flashnext.host.table.PLETable` (numba, nogil).

One entry point per format takes the ids and does everything in one pass with no Python per
shard: the range check, the shard of each id (a float64 multiply), the hot-tier probe (a
bitmap + rank index), a prefetch of the row's bytes one block of ids ahead, and the decode
of the row straight into ``out`` as float32 or as bfloat16 (float32 rounded to
nearest-even), with no intermediate arrays. :func:`gather_rows` copies the
stored bytes of every per-row tensor (``gather_raw``).

The decode works on a group of 16 columns at a time through small LLVM intrinsics on
``<16 x float>`` vectors (LLVM picks the instructions: AVX2, AVX-512, NEON), because numba's
loop vectoriser gives up on these loops (it cannot prove the row pointers do not alias).

Where a row lives (the *locator*, built once at open by the table with :func:`pack_locator`,
the one place that writes it) is one int64 array ``loc``:

- ``loc[0:8]``: rows per shard, first open shard, row_range start, row_range end, the table's
  row count, S (open shards), T (per-row tensors), H (hot-tier rows).
- ``loc[8:10]``: addresses of the format's decode tables (see :func:`decode_tables`).
- ``loc[10:12]``: addresses of the hot tier's index (see :func:`hot_index`), 0 without one.
- then ``seg_start`` [S] (global row held at ``bases[t, k]`` for open shard ``k``), ``bases``
  [T, S + 1] (address of tensor ``t``'s row ``seg_start[k]``; column ``S`` is the hot-tier copy,
  whose row ``j`` holds the ``j``-th hot-tier row in row order) and ``row_bytes`` [T].

``scalars`` float32 [S] is the per-shard scalar (nvfp4 ``weight_scale_2``; ones otherwise).

Every kernel takes ``ids`` int64 [n] and a slice ``[lo, hi)`` of it (callers split big batches
over threads; the GIL is released) and returns the index of the first id outside
``[-1, num_rows)``, or -1. Ids of padding (-1) or outside row_range give zero rows (raw: the
format's pad bytes). The constants (e2m1 codes, e4m3/fp16 decode tables, group size, pad bytes)
come from :mod:`flashnext.ple.formats`; nothing is restated here.

The addresses are only valid while the table holds its arrays: callers keep a reference to
them for the duration of a call.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import ml_dtypes
import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from flashnext.host.mapping import HUGE_PAGE
from flashnext.numba_intrinsics import memcpy as _copy
from flashnext.numba_intrinsics import popcount as _popcount
from flashnext.numba_intrinsics import prefetch as _prefetch
from flashnext.numba_intrinsics import ptr as _ptr
from flashnext.ple.formats import (
    E2M1_CODES,
    E4M3,
    F16,
    GROUP,
    INT4_BIAS,
    NIBBLE_BITS,
    NIBBLE_MASK,
)

__all__ = ["HUGE_PAGE", "decode_tables", "hot_index", "pack_locator"]  # and the kernels

_HEAD = 12  # int64 slots of ``loc`` before seg_start
_RANK_SHIFT = 9  # one rank entry per 512 rows: 8 bitmap words, one cache line

# -- decode tables (from the dtypes and codes formats.py names) ------------------------------
_E4M3_F32 = np.arange(256, dtype=np.uint8).view(E4M3).astype(np.float32)
_FP16_F32 = np.arange(1 << 16, dtype=np.uint16).view(F16).astype(np.float32)
# e4m3 decoded with vector arithmetic instead of 16 table loads per group: the layout comes
# from the dtype (ml_dtypes' finfo), the NaN from the table; tests check all 256 codes.
_E4M3_MANT = int(ml_dtypes.finfo(E4M3).nmant)  # mantissa bits
_E4M3_REBIAS = 127 - (1 - int(ml_dtypes.finfo(E4M3).minexp))  # float32 bias - e4m3 bias
_E4M3_NAN = int(np.flatnonzero(np.isnan(_E4M3_F32))[0])  # the NaN magnitude (no infinities)
# Each packed e2m1 byte -> the float32 pair of its two codes, low nibble (even column) first.
_BYTES = np.arange(256, dtype=np.uint8)
_E2M1_PAIRS = np.ascontiguousarray(
    np.stack([E2M1_CODES[_BYTES & NIBBLE_MASK], E2M1_CODES[_BYTES >> NIBBLE_BITS]], axis=1),
    dtype=np.float32,
)


def decode_tables(fmt: str) -> tuple[int, int]:
    """Addresses (``loc[8:10]``) of the tables format ``fmt``'s kernel reads (module-lifetime)."""
    return {
        "bf16": (0, 0),
        "fp8": (_E4M3_F32.ctypes.data, 0),
        "int4": (_FP16_F32.ctypes.data, 0),
        "nvfp4": (_E2M1_PAIRS.ctypes.data, _E4M3_F32.ctypes.data),
    }[fmt]


# -- LLVM helpers: 16 columns as one vector ----------------------------------------------------
_I8, _I16, _I32, _I64, _F32 = (
    ir.IntType(8),
    ir.IntType(16),
    ir.IntType(32),
    ir.IntType(64),
    ir.FloatType(),
)
_V = GROUP  # columns per vector


def _vt(elem: ir.Type, n: int = _V) -> ir.VectorType:
    return ir.VectorType(elem, n)


def _splat(builder: ir.IRBuilder, value: ir.Value, n: int = _V) -> ir.Value:
    vec = builder.insert_element(ir.Constant(_vt(value.type, n), ir.Undefined), value, _I32(0))
    return builder.shuffle_vector(vec, vec, ir.Constant(_vt(_I32, n), [0] * n))


def _const(elem: ir.Type, value: int | float, n: int = _V) -> ir.Constant:
    return ir.Constant(_vt(elem, n), [value] * n)


def _load(builder: ir.IRBuilder, address: ir.Value, ty: ir.Type) -> ir.Value:
    return builder.load(builder.inttoptr(address, ir.PointerType(ty)), align=1)


def _nibbles(builder: ir.IRBuilder, address: ir.Value) -> ir.Value:
    """``<16 x i8>`` 4-bit codes of the 8 packed bytes at ``address``, low nibble first."""
    packed = _load(builder, address, _vt(_I8, _V // 2))
    low = builder.and_(packed, _const(_I8, NIBBLE_MASK, _V // 2))
    high = builder.lshr(packed, _const(_I8, NIBBLE_BITS, _V // 2))
    order = [k // 2 + (_V // 2) * (k % 2) for k in range(_V)]
    return builder.shuffle_vector(low, high, ir.Constant(_vt(_I32), order))


def _gather(builder: ir.IRBuilder, table: ir.Value, index: ir.Value, elem: ir.Type) -> ir.Value:
    """``table[index[k]]`` for each lane of ``index`` (scalar loads; ``table`` an address)."""
    n = index.type.count
    size = 4 if isinstance(elem, ir.FloatType) else elem.width // 8
    vec = ir.Constant(_vt(elem, n), ir.Undefined)
    base = builder.inttoptr(table, ir.PointerType(elem))
    for k in range(n):
        at = builder.zext(builder.extract_element(index, _I32(k)), _I64)
        ptr = builder.gep(base, [at])
        vec = builder.insert_element(vec, builder.load(ptr, align=size), _I32(k))
    return vec


def _e4m3(builder: ir.IRBuilder, codes: ir.Value) -> ir.Value:
    """``<16 x i8>`` e4m3fn codes -> ``<16 x float>``, bit for bit the table's values: normal
    codes by moving exponent and mantissa into float32's fields, subnormal ones as
    ``mantissa * 2**(minexp - nmant)`` (exact), the NaN code as the table's NaN."""
    c = builder.zext(codes, _vt(_I32))
    sign = builder.shl(builder.and_(c, _const(_I32, 0x80)), _const(_I32, 24))
    mag = builder.and_(c, _const(_I32, 0x7F))
    normal = builder.add(
        builder.shl(mag, _const(_I32, 23 - _E4M3_MANT)), _const(_I32, _E4M3_REBIAS << 23)
    )
    tiny = float(2.0 ** (int(ml_dtypes.finfo(E4M3).minexp) - _E4M3_MANT))
    sub = builder.fmul(builder.uitofp(mag, _vt(_F32)), _const(_F32, tiny))
    is_sub = builder.icmp_unsigned("<", mag, _const(_I32, 1 << _E4M3_MANT))
    bits = builder.select(is_sub, builder.bitcast(sub, _vt(_I32)), normal)
    nan_bits = int(_E4M3_F32[_E4M3_NAN : _E4M3_NAN + 1].view(np.uint32)[0])
    is_nan = builder.icmp_unsigned("==", mag, _const(_I32, _E4M3_NAN))
    bits = builder.select(is_nan, _const(_I32, nan_bits), bits)
    return builder.bitcast(builder.or_(bits, sign), _vt(_F32))


def _store(
    builder: ir.IRBuilder, values: ir.Value, address: ir.Value, bf16: bool, finite: bool = False
) -> None:
    """Store ``<16 x float>`` at ``address`` as float32, or as bfloat16 rounded to nearest-even
    the way ``astype(ml_dtypes.bfloat16)`` does (a NaN becomes the quiet NaN of its sign).
    ``finite``: the caller knows no lane is NaN (infinities round correctly either way), so
    the NaN lanes' fix-up is left out: a quarter of the bfloat16 path's instructions."""
    if not bf16:
        builder.store(values, builder.inttoptr(address, ir.PointerType(values.type)), align=4)
        return
    bits = builder.bitcast(values, _vt(_I32))
    lsb = builder.and_(builder.lshr(bits, _const(_I32, 16)), _const(_I32, 1))
    rounded = builder.lshr(
        builder.add(builder.add(bits, _const(_I32, 0x7FFF)), lsb), _const(_I32, 16)
    )
    if finite:
        half = builder.trunc(rounded, _vt(_I16))
        builder.store(half, builder.inttoptr(address, ir.PointerType(half.type)), align=2)
        return
    magnitude = builder.and_(bits, _const(_I32, 0x7FFFFFFF))
    nan = builder.icmp_unsigned(">", magnitude, _const(_I32, 0x7F800000))
    sign = builder.and_(builder.lshr(bits, _const(_I32, 16)), _const(_I32, 0x8000))
    quiet = builder.or_(sign, _const(_I32, 0x7FC0))  # ml_dtypes' NaN: the sign kept, no payload
    half = builder.trunc(builder.select(nan, quiet, rounded), _vt(_I16))
    builder.store(half, builder.inttoptr(address, ir.PointerType(half.type)), align=2)


def _out_is_bf16(out: types.Type) -> bool | None:
    """float32 out -> False, uint16 (bfloat16 bits) -> True, anything else -> None."""
    if not isinstance(out, types.Array):
        return None
    return {types.float32: False, types.uint16: True}.get(out.dtype)


@intrinsic
def _peek(typingctx, address):  # type: ignore[no-untyped-def]
    """The int64 at ``address``: no array struct to build, unlike a :func:`numba.carray`."""
    if not isinstance(address, types.Integer):
        return None

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.load(builder.inttoptr(args[0], _I64.as_pointer()))

    return types.int64(address), codegen


def _int4_group_intrinsic(finite: bool):  # type: ignore[no-untyped-def]
    @intrinsic
    def group(typingctx, codes, scale, dst, out):  # type: ignore[no-untyped-def]
        bf16 = _out_is_bf16(out)
        if bf16 is None:
            return None

        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            codes_v, scale_v, dst_v, _ = args
            # nibble - 8 is exact in float32, and so is its product with an fp16 scale.
            q = builder.uitofp(_nibbles(builder, codes_v), _vt(_F32))
            q = builder.fsub(q, _const(_F32, float(INT4_BIAS)))
            _store(builder, builder.fmul(q, _splat(builder, scale_v)), dst_v, bf16, finite)
            return context.get_dummy_value()

        return types.none(types.int64, types.float32, types.int64, out), codegen

    return group


#: 16 int4 columns: ``(nibble - INT4_BIAS) * scale`` from 8 bytes at ``codes`` -> ``dst``;
#: the ``_finite`` one for a finite ``scale`` (no NaN can come out).
_group_int4 = _int4_group_intrinsic(finite=False)
_group_int4_finite = _int4_group_intrinsic(finite=True)


def _nvfp4_group_intrinsic(finite: bool):  # type: ignore[no-untyped-def]
    @intrinsic
    def group(typingctx, codes, pairs, scale, scale_2, dst, out):  # type: ignore[no-untyped-def]
        bf16 = _out_is_bf16(out)
        if bf16 is None:
            return None

        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            codes_v, pairs_v, scale_v, s2_v, dst_v, _ = args
            packed = _load(builder, codes_v, _vt(_I8, _V // 2))
            both = _gather(builder, pairs_v, packed, _I64)  # <8 x i64> = 16 float32, in order
            q = builder.bitcast(both, _vt(_F32))
            q = builder.fmul(q, _splat(builder, scale_v))  # exact: e2m1 x e4m3
            _store(builder, builder.fmul(q, _splat(builder, s2_v)), dst_v, bf16, finite)
            return context.get_dummy_value()

        sig = types.none(types.int64, types.int64, types.float32, types.float32, types.int64, out)
        return sig, codegen

    return group


#: 16 nvfp4 columns: ``(e2m1 * scale) * scale_2`` -> ``dst``; ``pairs`` is the address of the
#: float32 [256, 2] table of each byte's two codes (the order of the numpy codec). The
#: ``_finite`` one for finite ``scale`` and ``scale_2`` (no NaN can come out).
_group_nvfp4 = _nvfp4_group_intrinsic(finite=False)
_group_nvfp4_finite = _nvfp4_group_intrinsic(finite=True)


@intrinsic
def _group_fp8(typingctx, codes, scale, dst, out):  # type: ignore[no-untyped-def]
    """16 fp8 columns: ``e4m3(code) * scale`` -> ``dst``."""
    bf16 = _out_is_bf16(out)
    if bf16 is None:
        return None

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        codes_v, scale_v, dst_v, _ = args
        q = _e4m3(builder, _load(builder, codes_v, _vt(_I8)))
        _store(builder, builder.fmul(q, _splat(builder, scale_v)), dst_v, bf16)
        return context.get_dummy_value()

    return types.none(types.int64, types.float32, types.int64, out), codegen


@intrinsic
def _group_bf16(typingctx, src, dst, out):  # type: ignore[no-untyped-def]
    """16 bf16 columns at ``src`` -> ``dst`` as float32 (the bits shifted up) or bfloat16 (the
    same value, through :func:`_store` so that NaNs come out as the reference's)."""
    bf16 = _out_is_bf16(out)
    if bf16 is None:
        return None

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        src_v, dst_v, _ = args
        half = _load(builder, src_v, _vt(_I16))
        wide = builder.shl(builder.zext(half, _vt(_I32)), _const(_I32, 16))
        _store(builder, builder.bitcast(wide, _vt(_F32)), dst_v, bf16)
        return context.get_dummy_value()

    return types.none(types.int64, types.int64, out), codegen


# -- finding rows ------------------------------------------------------------------------------


def hot_index(hot_rel: np.ndarray, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """The hot tier's index over ``rows`` rows: ``(bitmap, rank)``.

    ``hot_rel`` int64 [H]: hot-tier rows relative to the first open row, sorted, unique. ``bitmap``
    uint64 [ceil(rows / 512) * 8]: bit ``r % 64`` of word ``r // 64`` set for a hot-tier row ``r``;
    ``rank`` int64 [ceil(rows / 512)]: hot-tier rows before row ``512 * b``. Row ``r``'s place in
    the hot copy is ``rank[r // 512]`` plus the set bits before it in its 512-row block.
    """
    blocks = (rows + (1 << _RANK_SHIFT) - 1) >> _RANK_SHIFT
    bitmap = _huge_zeros(blocks << (_RANK_SHIFT - 6), np.uint64)
    rank = _huge_zeros(blocks, np.int64)
    _fill_hot_index(hot_rel, bitmap, rank)
    return bitmap, rank


def pack_locator(
    rows_per_shard: int,
    first_shard: int,
    row_range: tuple[int, int],
    num_rows: int,
    fmt: str,
    seg_start: np.ndarray,
    bases: np.ndarray,
    row_bytes: np.ndarray,
    hot_ids: np.ndarray,
) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
    """The kernels' ``loc`` array, laid out as the module docstring says.

    Args:
        rows_per_shard: rows of every shard but the last (the table's layout).
        first_shard: index of the first open shard.
        row_range: ``(start, end)`` global rows open.
        num_rows: rows of the whole table.
        fmt: the format, for its decode tables.
        seg_start: int64 [S]: per open shard, the global row its ``bases`` column points at.
        bases: int64 [T, S + 1]: per row tensor and open shard, the address of that row;
            column ``S`` the hot copy's first row (0 without a hot tier).
        row_bytes: int64 [T]: bytes per row of each row tensor.
        hot_ids: int64 [H]: the hot tier's global rows, sorted and unique (empty: none).

    Returns:
        ``(loc, keep)``: ``loc`` int64, and the hot index's arrays whose addresses ``loc``
        holds (the caller keeps them alive as long as ``loc``).
    """
    start, end = int(row_range[0]), int(row_range[1])
    n_t, columns = np.shape(bases)
    n_s = int(np.size(seg_start))
    if columns != n_s + 1 or np.size(row_bytes) != n_t:
        raise ValueError(
            f"bases must be [T, S + 1] = [{np.size(row_bytes)}, {n_s + 1}], "
            f"found {list(np.shape(bases))}"
        )
    index: tuple[np.ndarray, ...] = ()
    if np.size(hot_ids):
        index = hot_index(np.asarray(hot_ids, np.int64) - start, end - start)
    head = [rows_per_shard, first_shard, start, end, num_rows, n_s, n_t, np.size(hot_ids)]
    head += [*decode_tables(fmt), *([a.ctypes.data for a in index] or [0, 0])]
    parts = [np.asarray(head, np.int64), np.asarray(seg_start, np.int64).reshape(-1)]
    parts += [np.asarray(bases, np.int64).reshape(-1), np.asarray(row_bytes, np.int64)]
    return np.concatenate(parts), index


def _huge_zeros(count: int, dtype: Any) -> np.ndarray:
    """Zeros ``[count]`` in private anonymous memory advised onto 2 MiB pages: every lookup
    reads the hot index at a random place, and on 4 KiB pages (numba's and small numpy
    allocations) that costs a TLB miss per id. Plain ``np.zeros`` where the OS lacks the
    advice."""
    nbytes = count * np.dtype(dtype).itemsize
    if nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return np.zeros(count, dtype)
    # a multiple of 2 MiB, so the kernel places the map on a 2 MiB boundary
    size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    anon = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    anon.madvise(mmap.MADV_HUGEPAGE)
    return np.frombuffer(anon, dtype, count)


@numba.njit(nogil=True, cache=True)
def _fill_hot_index(hot_rel, bitmap, rank):  # type: ignore[no-untyped-def]
    for j in range(hot_rel.size):
        r = hot_rel[j]
        bitmap[r >> 6] |= np.uint64(1) << np.uint64(r & 63)
    total = 0
    for b in range(rank.size):
        rank[b] = total
        for w in range(b << (_RANK_SHIFT - 6), (b + 1) << (_RANK_SHIFT - 6)):
            total += _popcount(bitmap[w])


@numba.njit(nogil=True, cache=True)
def _hot_slot(rel, loc):  # type: ignore[no-untyped-def]
    """Place in the hot copy of row ``rel`` (relative to row_range start), or -1 if it is not
    hot: its bit in the bitmap, then the block's rank plus the set bits before it. (int64
    words throughout: the bit operations are the same, and numba turns int64/uint64 mixes
    into floats.)"""
    word = rel >> 6
    bits = _peek(loc[10] + word * 8)
    bit = np.int64(1) << (rel & 63)
    if not bits & bit:
        return -1
    j = _peek(loc[11] + (rel >> _RANK_SHIFT) * 8)
    for w in range((rel >> _RANK_SHIFT) << (_RANK_SHIFT - 6), word):
        j += _popcount(_peek(loc[10] + w * 8))
    return j + _popcount(bits & (bit - 1))


@numba.njit(nogil=True, cache=True)
def _prefetch_hot(ids, b0, b1, loc):  # type: ignore[no-untyped-def]
    """Prefetch the hot index's bitmap word and rank of ids ``[b0, b1)``: which address a
    row is read from depends on them, so they are asked for a block before they are needed."""
    start, end = loc[2], loc[3]
    for i in range(b0, b1):
        rel = ids[i] - start
        if rel >= 0 and ids[i] < end:
            _prefetch(loc[10] + (rel >> 6) * 8)
            _prefetch(loc[11] + (rel >> _RANK_SHIFT) * 8)


@numba.njit(nogil=True, cache=True)
def _resolve(ids, b0, b1, loc, where):  # type: ignore[no-untyped-def]
    """Fill ``where[i - b0]`` = (address of each tensor's row..., open shard) for ids
    ``[b0, b1)`` and prefetch the rows, so the decode loop finds them in cache. Padding gets
    address -1. Returns the first bad id's index or -1.

    Plain integer arithmetic on ``loc`` and 2-D stores into ``where``: no array views or
    calls per id, which cost more than the row's copy when the rows are already cached."""
    n_s, n_t = loc[5], loc[6]
    bases = _HEAD + n_s
    sizes = bases + n_t * (n_s + 1)
    per, start, end = loc[0], loc[2], loc[3]
    inv = 1.0 / np.float64(per)
    if loc[7]:  # the next block's hot-index lines: in cache when that block is resolved
        _prefetch_hot(ids, b1, min(b1 + BLOCK, ids.size), loc)
    for i in range(b0, b1):
        row = ids[i]
        if row < start or row >= end:  # padding (-1) included: start >= 0
            if row < -1 or row >= loc[4]:
                return i
            for t in range(n_t):
                where[i - b0, t] = -1
            continue
        # row // rows_per_shard without an integer division (tens of cycles each): a float64
        # product, exact after one correction either way for any row below 2**52.
        q = np.int64(np.float64(row) * inv)
        if q * per > row:
            q -= 1
        elif (q + 1) * per <= row:
            q += 1
        shard = q - loc[1]
        col, local = shard, row - loc[_HEAD + shard]
        if loc[7]:
            j = _hot_slot(row - start, loc)
            if j >= 0:
                col, local = n_s, j
        where[i - b0, n_t] = shard
        for t in range(n_t):
            size = loc[sizes + t]
            address = loc[bases + t * (n_s + 1) + col] + local * size
            where[i - b0, t] = address
            _prefetch(address)  # a row of <= 64 bytes spans at most these two lines
            _prefetch(address + size - 1)
            for line in range((address & ~63) + 64, address + size - 1, 64):  # wider rows
                _prefetch(line)
    return -1


@numba.njit(nogil=True, cache=True)
def _zero(out, i):  # type: ignore[no-untyped-def]
    dst = out[i]
    for j in range(dst.size):
        dst[j] = 0


#: Ids resolved (and their rows prefetched) one block ahead of decoding: enough loads in
#: flight to hide memory latency, few enough that the rows are still in L1/L2 when decoded.
BLOCK = 32


@numba.njit(nogil=True, cache=True)
def _start(ids, lo, hi, loc):  # type: ignore[no-untyped-def]
    """Slots for two blocks, the first resolved: ``(where [2, BLOCK, T + 1], bad index or -1)``."""
    where = np.empty((2, BLOCK, loc[6] + 1), np.int64)
    if loc[7]:
        _prefetch_hot(ids, lo, min(lo + BLOCK, hi), loc)
    bad = _resolve(ids, lo, min(lo + BLOCK, hi), loc, where[0]) if lo < hi else -1
    return where, bad


@numba.njit(nogil=True, cache=True)
def _advance(ids, b0, hi, loc, where, k):  # type: ignore[no-untyped-def]
    """Before block ``k`` (ids from ``b0``) is decoded, resolve block ``k + 1`` so its rows are
    on their way from memory meanwhile; return block ``k``'s slots and a bad index or -1."""
    b1 = b0 + BLOCK
    bad = -1
    if b1 < hi:
        bad = _resolve(ids, b1, min(b1 + BLOCK, hi), loc, where[(k + 1) & 1])
    return where[k & 1], bad


# -- one entry point per format ----------------------------------------------------------------
# ``out`` is float32 [n, w] or uint16 [n, w] holding bfloat16 bits; numba compiles one version
# of each kernel per out dtype (both land in the on-disk cache at the first open).


@numba.njit(nogil=True, cache=True)
def lookup_bf16(ids, lo, hi, loc, scalars, out):  # type: ignore[no-untyped-def]
    """bf16 rows -> ``out``."""
    w = out.shape[1]
    step = out.strides[0]
    itemsize = out.itemsize
    base = out.ctypes.data
    full = w - w % GROUP
    scratch = np.empty(GROUP, np.float32)
    where, bad = _start(ids, lo, hi, loc)
    if bad >= 0:
        return bad
    for k, b0 in enumerate(range(lo, hi, BLOCK)):
        cur, bad = _advance(ids, b0, hi, loc, where, k)
        if bad >= 0:
            return bad
        for i in range(b0, min(b0 + BLOCK, hi)):
            src = cur[i - b0, 0]
            if src < 0:
                _zero(out, i)
                continue
            dst = base + i * step
            for c in range(0, full, GROUP):
                _group_bf16(src + 2 * c, dst + itemsize * c, out)
            if full < w:  # a width that is not a multiple of 16: the rest through scratch
                bits = numba.carray(_ptr(src), w, np.uint16)
                wide = scratch.view(np.uint32)
                for c in range(full, w):
                    wide[c - full] = np.uint32(bits[c]) << 16
                _group_tail(scratch, w - full, dst + itemsize * full, out)
    return -1


@numba.njit(nogil=True, cache=True)
def lookup_fp8(ids, lo, hi, loc, scalars, out):  # type: ignore[no-untyped-def]
    """fp8 rows (e4m3 codes x per-row float32 scale) -> ``out``."""
    w = out.shape[1]
    step = out.strides[0]
    itemsize = out.itemsize
    base = out.ctypes.data
    lut = numba.carray(_ptr(loc[8]), 256, np.float32)  # for a width's last columns
    full = w - w % GROUP
    scratch = np.empty(GROUP, np.float32)
    where, bad = _start(ids, lo, hi, loc)
    if bad >= 0:
        return bad
    for k, b0 in enumerate(range(lo, hi, BLOCK)):
        cur, bad = _advance(ids, b0, hi, loc, where, k)
        if bad >= 0:
            return bad
        for i in range(b0, min(b0 + BLOCK, hi)):
            codes = cur[i - b0, 0]
            if codes < 0:
                _zero(out, i)
                continue
            scale = numba.carray(_ptr(cur[i - b0, 1]), 1, np.float32)[0]
            dst = base + i * step
            for c in range(0, full, GROUP):
                _group_fp8(codes + c, scale, dst + itemsize * c, out)
            if full < w:  # a width that is not a multiple of 16: the rest through scratch
                src = numba.carray(_ptr(codes), w, np.uint8)
                for c in range(full, w):
                    scratch[c - full] = lut[src[c]] * scale
                _group_tail(scratch, w - full, dst + itemsize * full, out)
    return -1


@numba.njit(nogil=True, cache=True)
def _group_tail(values, n, dst, out):  # type: ignore[no-untyped-def]
    """The first ``n`` (< 16) of ``values`` float32 [16] -> ``dst`` in out's dtype."""
    full = np.empty(GROUP, out.dtype)
    _store_group(values, full.ctypes.data, full)
    tail = numba.carray(_ptr(dst), n, out.dtype)
    for c in range(n):
        tail[c] = full[c]


@intrinsic
def _store_values(typingctx, values, dst, out):  # type: ignore[no-untyped-def]
    """float32 [16] at address ``values`` -> ``dst`` in out's dtype (rounded for bfloat16)."""
    bf16 = _out_is_bf16(out)
    if bf16 is None:
        return None

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        vals = _load(builder, args[0], _vt(_F32))
        _store(builder, vals, args[1], bf16)
        return context.get_dummy_value()

    return types.none(types.int64, types.int64, out), codegen


@numba.njit(nogil=True, cache=True)
def _store_group(values, dst, out):  # type: ignore[no-untyped-def]
    _store_values(values.ctypes.data, dst, out)


@numba.njit(nogil=True, cache=True)
def lookup_int4(ids, lo, hi, loc, scalars, out):  # type: ignore[no-untyped-def]
    """int4 rows ((nibble - INT4_BIAS) x fp16 group scale) -> ``out``."""
    w = out.shape[1]
    step = out.strides[0]
    itemsize = out.itemsize
    base = out.ctypes.data
    fp16 = numba.carray(_ptr(loc[8]), 1 << 16, np.float32)
    groups = w // GROUP
    where, bad = _start(ids, lo, hi, loc)
    if bad >= 0:
        return bad
    for k, b0 in enumerate(range(lo, hi, BLOCK)):
        cur, bad = _advance(ids, b0, hi, loc, where, k)
        if bad >= 0:
            return bad
        for i in range(b0, min(b0 + BLOCK, hi)):
            codes = cur[i - b0, 0]
            if codes < 0:
                _zero(out, i)
                continue
            scales = numba.carray(_ptr(cur[i - b0, 1]), groups, np.uint16)
            dst = base + i * step
            for g in range(groups):
                s = fp16[scales[g]]
                if s - s == 0:  # finite (the usual case)
                    _group_int4_finite(codes + g * (GROUP // 2), s, dst + itemsize * GROUP * g, out)
                else:
                    _group_int4(codes + g * (GROUP // 2), s, dst + itemsize * GROUP * g, out)
    return -1


@numba.njit(nogil=True, cache=True)
def lookup_nvfp4(ids, lo, hi, loc, scalars, out):  # type: ignore[no-untyped-def]
    """nvfp4 rows (e2m1 code x e4m3 group scale x shard scale) -> ``out``.

    The product is taken as ``(code * scale) * scale_2`` in float32, the order of the numpy
    codec (the first is exact).
    """
    w = out.shape[1]
    step = out.strides[0]
    itemsize = out.itemsize
    base = out.ctypes.data
    pairs = loc[8]
    e4m3 = numba.carray(_ptr(loc[9]), 256, np.float32)
    groups = w // GROUP
    n_t = loc[6]
    where, bad = _start(ids, lo, hi, loc)
    if bad >= 0:
        return bad
    for k, b0 in enumerate(range(lo, hi, BLOCK)):
        cur, bad = _advance(ids, b0, hi, loc, where, k)
        if bad >= 0:
            return bad
        for i in range(b0, min(b0 + BLOCK, hi)):
            codes = cur[i - b0, 0]
            if codes < 0:
                _zero(out, i)
                continue
            s2 = scalars[cur[i - b0, n_t]]
            scales = numba.carray(_ptr(cur[i - b0, 1]), groups, np.uint8)
            dst = base + i * step
            for g in range(groups):
                s = e4m3[scales[g]]
                at, to = codes + g * (GROUP // 2), dst + itemsize * GROUP * g
                if s - s == 0 and s2 - s2 == 0:  # both finite (the usual case)
                    _group_nvfp4_finite(at, pairs, s, s2, to, out)
                else:
                    _group_nvfp4(at, pairs, s, s2, to, out)
    return -1


@numba.njit(nogil=True, cache=True)
def gather_rows(ids, lo, hi, loc, scalars, dst0, dst1, pads, dst_scalars):  # type: ignore[no-untyped-def]
    """Stored bytes of every per-row tensor -> ``dst0``/``dst1`` uint8 [n, row_bytes[t]]
    (``dst1`` [n, 0] for a one-tensor format); padding rows get byte ``pads[t]``. When
    ``dst_scalars`` (float32 [n]) is not empty it receives each id's per-shard scalar (0 for
    padding)."""
    n_t = loc[6]
    fill = dst_scalars.size > 0
    d0, s0 = dst0.ctypes.data, dst0.shape[1]
    d1, s1 = dst1.ctypes.data, dst1.shape[1]
    where, bad = _start(ids, lo, hi, loc)
    if bad >= 0:
        return bad
    for k, b0 in enumerate(range(lo, hi, BLOCK)):
        cur, bad = _advance(ids, b0, hi, loc, where, k)
        if bad >= 0:
            return bad
        for i in range(b0, min(b0 + BLOCK, hi)):
            src = cur[i - b0, 0]
            if src < 0:
                _fill(d0 + i * s0, s0, pads[0])
                if n_t > 1:
                    _fill(d1 + i * s1, s1, pads[1])
                if fill:
                    dst_scalars[i] = 0.0
                continue
            _copy_bytes(d0 + i * s0, src, s0)
            if n_t > 1:
                _copy_bytes(d1 + i * s1, cur[i - b0, 1], s1)
            if fill:
                dst_scalars[i] = scalars[cur[i - b0, n_t]]
    return -1


@numba.njit(nogil=True, cache=True)
def _copy_bytes(dst, src, n):  # type: ignore[no-untyped-def]
    """``memcpy`` of ``n`` bytes; the row sizes of the released width (160 columns) are
    spelled out so LLVM inlines them as a few vector moves instead of a libc call."""
    if n == 80:  # int4 and nvfp4 codes
        _copy(dst, src, 80)
    elif n == 20:  # int4 fp16 scales
        _copy(dst, src, 20)
    elif n == 10:  # nvfp4 e4m3 scales
        _copy(dst, src, 10)
    elif n == 160:  # fp8 codes
        _copy(dst, src, 160)
    elif n == 4:  # fp8 row scale
        _copy(dst, src, 4)
    elif n == 320:  # bf16 rows
        _copy(dst, src, 320)
    else:
        _copy(dst, src, n)


@numba.njit(nogil=True, cache=True)
def _fill(dst, n, byte):  # type: ignore[no-untyped-def]
    """``n`` bytes at address ``dst`` set to ``byte`` (a padding row's pad bytes)."""
    row = numba.carray(_ptr(dst), n, np.uint8)
    for j in range(n):
        row[j] = byte


#: Batches smaller than this run on the calling thread (a thread hand-off costs ~20 us).
PARALLEL_MIN_IDS = 16_384


def row_pages(ids: np.ndarray, loc: np.ndarray, page: int = mmap.PAGESIZE) -> np.ndarray:
    """int64 [P]: the distinct page addresses holding the stored bytes of rows ``ids`` (int64
    [n]; padding and other ranks' rows give none), every per-row tensor's, found through
    ``loc`` as the kernels find them. Empty when an id is out of bounds (the lookup reports it).
    """
    n_t = int(loc[6])
    sizes = loc[_HEAD + int(loc[5]) + n_t * (int(loc[5]) + 1) :][:n_t]
    where = np.empty((ids.size, n_t + 1), np.int64)
    if ids.size == 0 or _resolve(ids, 0, ids.size, loc, where) >= 0:
        return np.zeros(0, np.int64)
    addresses = where[:, :n_t]
    ends = addresses + sizes - 1
    used = addresses >= 0
    mask = np.int64(-page)
    return np.unique(np.concatenate([addresses[used] & mask, ends[used] & mask]))


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

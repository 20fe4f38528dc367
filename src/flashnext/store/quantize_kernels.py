"""Compiled quantizer kernels (numba, nogil): the codecs of :mod:`flashnext.ple.formats`, fused.

The numpy codecs stay the reference; these kernels produce the same bytes, one pass per block:

- int4 / nvfp4: per 16-column group, the 8 clip ratios of the scale search are tried in one
  pass over the group's values (the numpy codec makes 8 passes over the whole block, each
  writing several float32 temporaries). Every floating-point operation is the reference's, in
  its dtype (float32) and order: the candidate scale ``amax * float32(ratio / qmax) /
  global_scale``, rounded to the stored dtype (float16 / e4m3, nearest-even), ``s = stored *
  global_scale``, ``inv = 1 / s``, ``y = x * inv``, ``diff = round(y) * s - x``. The squared
  error is summed in the order numpy's ``einsum`` uses for a contiguous 16-value reduction
  (four 4-lane partial sums, then a horizontal add; see :func:`_group_error`); equal errors
  keep the earlier ratio, NaN errors never win, as in the reference.
- fp8 / bf16: the per-row absmax scale and the casts, with float32 -> e4m3 / bf16 rounding
  done on the bits (nearest-even, as ml_dtypes rounds).

Each kernel also returns the squared error of the stored values against the input and the
input's squared sum, in float64 (what a sidecar records as ``rel_rmse``); only the order of
those float64 sums differs from the numpy path, so recorded errors agree to ~1e-15, not bitwise.

Whether the platform's numpy sums in that order (it depends on numpy's SIMD build) is checked
by :func:`compiled_matches_reference`: a fixed block with edge rows is quantized both ways and
compared byte for byte, once per platform and version (the verdict is cached on disk); the
quantizer falls back to the numpy codecs when it differs. The constants (group size, clip ratios, e4m3 limit, int4 bias, the e2m1 code
values) come from :mod:`flashnext.ple.formats` through the caller.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import sys
from collections.abc import Mapping
from pathlib import Path

import numba
import numpy as np

from flashnext.ple import formats as F

__all__ = ["block_absmax", "compiled_matches_reference", "load_kernels", "quantize_block"]

_F32 = np.float32
_INT4, _NVFP4 = 0, 1  # kinds of group codec, for the one group kernel
#: Columns per group; :func:`_group_error` spells out numpy's order for exactly 16.
_G = 16
_OK, _SCALE_RANGE = 0, 1  # kernel status

_F16_MAX = _F32(np.finfo(np.float16).max)
_F16_MIN_NORMAL = _F32(2.0**-14)
_F16_SUBNORMAL_STEP_INV = _F32(2.0**24)
_F16_SUBNORMAL_STEP = _F32(2.0**-24)
_E4M3_MIN_NORMAL = _F32(2.0**-6)
_E4M3_SUBNORMAL_STEP_INV = _F32(2.0**9)
_E4M3_SUBNORMAL_STEP = _F32(2.0**-9)


# -- float32 -> stored dtype, on the bits (nearest-even) ------------------------------------


@numba.njit(nogil=True, cache=True, inline="always")
def _round_bits(bits, drop):  # type: ignore[no-untyped-def]
    """``bits >> drop`` rounded to nearest, ties to even (a carry may bump the exponent)."""
    kept = bits >> drop
    rem = bits & ((1 << drop) - 1)
    half = 1 << (drop - 1)
    if rem > half or (rem == half and (kept & 1) == 1):
        kept += 1
    return kept


@numba.njit(nogil=True, cache=True, inline="always")
def _f16_bits(v):  # type: ignore[no-untyped-def]
    """float32 ``v`` in [0, 65504] -> float16 bits."""
    if v < _F16_MIN_NORMAL:  # subnormal: multiples of 2^-24 (the scaling is exact)
        return np.int64(np.rint(v * _F16_SUBNORMAL_STEP_INV))
    b = np.int64(np.float32(v).view(np.uint32))
    return _round_bits(b - (112 << 23), 13)  # rebias the exponent (127 -> 15), keep 10 bits


@numba.njit(nogil=True, cache=True, inline="always")
def _f16_value(h):  # type: ignore[no-untyped-def]
    if h < 0x400:
        return np.float32(h) * _F16_SUBNORMAL_STEP
    return np.uint32((h + (112 << 10)) << 13).view(np.float32)


@numba.njit(nogil=True, cache=True, inline="always")
def _e4m3_bits(v):  # type: ignore[no-untyped-def]
    """float32 ``v`` >= 0 (at most 464: above 448 rounds to 448 or NaN) -> e4m3fn bits."""
    if v < _E4M3_MIN_NORMAL:
        return np.int64(np.rint(v * _E4M3_SUBNORMAL_STEP_INV))
    b = np.int64(np.float32(v).view(np.uint32))
    return _round_bits(b - (120 << 23), 20)  # rebias (127 -> 7), keep 3 bits


@numba.njit(nogil=True, cache=True, inline="always")
def _e4m3_value(c):  # type: ignore[no-untyped-def]
    if c < 8:
        return np.float32(c) * _E4M3_SUBNORMAL_STEP
    return np.uint32((c + (120 << 3)) << 20).view(np.float32)


# -- the 4-bit grids (the reference's operations, elementwise) ------------------------------


@numba.njit(nogil=True, cache=True, inline="always")
def _e2m1_round(y):  # type: ignore[no-untyped-def]
    """As ``formats._e2m1_round``: bits rounded to one mantissa bit, the grid below 1, +-6."""
    a = np.abs(y)
    q = np.uint32((np.float32(a).view(np.uint32) + np.uint32(1 << 21)) & np.uint32(0xFFC00000))
    q = np.uint32(q).view(np.float32)
    small = np.rint(a * _F32(2)) * _F32(0.5)
    q = small if a < _F32(1) else q
    if q > _F32(6):  # np.minimum(q, 6); NaN stays NaN (the comparison is False)
        q = _F32(6)
    return np.copysign(q, y)


@numba.njit(nogil=True, cache=True, inline="always")
def _e2m1_code(q):  # type: ignore[no-untyped-def]
    """As ``formats._e2m1_code`` (uint32 wrap-around and float -> uint8 cast included)."""
    a = np.abs(q)
    if a < _F32(1):
        mag = np.int64(a * _F32(2))
    else:
        bits = np.int64(np.float32(a).view(np.uint32))
        mag = ((((bits >> 23) - 126) & 0xFFFFFFFF) * 2 + ((bits >> 22) & 1)) & 0xFFFFFFFF
    sign = np.int64(np.float32(q).view(np.uint32) >> 31)
    return (mag & 0xFF) | (sign << 3)


@numba.njit(nogil=True, cache=True, inline="always")
def _int4_round(y):  # type: ignore[no-untyped-def]
    r = np.rint(y)
    r = _F32(-8) if r < _F32(-8) else r  # as np.clip: NaN stays NaN
    return _F32(7) if r > _F32(7) else r


@numba.njit(nogil=True, cache=True, inline="always")
def _group_error(p):  # type: ignore[no-untyped-def]
    """Sum of the 16 float32 ``p`` in numpy einsum's order (4 lanes x 4, then hadd)."""
    l0 = p[0] + (p[4] + (p[8] + p[12]))
    l1 = p[1] + (p[5] + (p[9] + p[13]))
    l2 = p[2] + (p[6] + (p[10] + p[14]))
    l3 = p[3] + (p[7] + (p[11] + p[15]))
    return (l0 + l1) + (l2 + l3)


# -- kernels --------------------------------------------------------------------------------


@numba.njit(nogil=True, cache=True)
def _absmax_scan(x):  # type: ignore[no-untyped-def]
    """(largest |value|, flat index of the first non-finite value or -1) of float32 [n, w].

    On the bits: magnitudes order like their bit patterns, NaN/inf above every finite value,
    and an integer max vectorizes where a float max (NaN rules) does not. After a non-finite
    value, the magnitude is the largest before it.
    """
    bits = x.reshape(-1).view(np.uint32)
    top = np.uint32(0)
    for i in range(bits.size):
        top = max(top, bits[i] & np.uint32(0x7FFFFFFF))
    if top < np.uint32(0x7F800000):
        return np.uint32(top).view(np.float32), -1
    top = np.uint32(0)
    for i in range(bits.size):
        b = bits[i] & np.uint32(0x7FFFFFFF)
        if b >= np.uint32(0x7F800000):
            return np.uint32(top).view(np.float32), i
        top = max(top, b)
    return np.uint32(top).view(np.float32), -1


@numba.njit(nogil=True, cache=True, inline="always")
def _stored_scale(kind, raw):  # type: ignore[no-untyped-def]
    """(stored bits, their float32 value) of a candidate scale, as the codec stores it."""
    if kind == _INT4:
        h = _f16_bits(raw)
        return h, _f16_value(h)
    c = _e4m3_bits(min(raw, _F32(448)))  # raw is never NaN here
    return c, _e4m3_value(c)


@numba.njit(nogil=True, cache=True, inline="always")
def _fit(kind, xs, s, out, p):  # type: ignore[no-untyped-def]
    """Rounded values of group ``xs`` at scale ``s`` into ``out``, squared errors into ``p``."""
    inv = _F32(1) / s if s > _F32(0) else _F32(0)
    for k in range(_G):
        y = xs[k] * inv
        q = _int4_round(y) if kind == _INT4 else _e2m1_round(y)
        out[k] = q
        d = q * s - xs[k]
        p[k] = d * d


@numba.njit(nogil=True, cache=True)
def _int4_kernel(x, ratios, codes, scales, deq_values, rows):  # type: ignore[no-untyped-def]
    """int4 search and encode of float32 [n, w]; (status, sq_err, sq_ref)."""
    return _group_kernel(x, _F32(1), ratios, _INT4, codes, scales, deq_values, rows)


@numba.njit(nogil=True, cache=True)
def _nvfp4_kernel(x, gs, ratios, codes, scales, deq_values, rows):  # type: ignore[no-untyped-def]
    """nvfp4 search and encode of float32 [n, w]; (status, sq_err, sq_ref)."""
    return _group_kernel(x, gs, ratios, _NVFP4, codes, scales, deq_values, rows)


@numba.njit(nogil=True, cache=True, inline="always")
def _group_kernel(x, gs, ratios, kind, codes, scales, deq_values, rows):  # type: ignore[no-untyped-def]
    """int4 / nvfp4 search and encode of float32 [n, w]; (status, sq_err, sq_ref), and each
    row's sums into ``rows`` (see :func:`quantize_block`).

    Inlined into one kernel per format, so ``kind`` is a constant there and its branches fold.
    """
    n, w = x.shape
    q = np.empty(_G, dtype=np.float32)
    p = np.empty(_G, dtype=np.float32)
    sq_err = 0.0
    sq_ref = 0.0
    for r in range(n):
        row_err = 0.0
        row_ref = 0.0
        row_nonzero = 0.0
        for g in range(w // _G):
            xs = x[r, g * _G : (g + 1) * _G]
            amax = _F32(0)
            for k in range(_G):
                amax = max(amax, np.abs(xs[k]))
            best_err = _F32(0)
            best_bits = 0
            best_value = _F32(0)
            for i in range(ratios.size):
                raw = amax * ratios[i] / gs
                if kind == _INT4 and raw > _F16_MAX:
                    return _SCALE_RANGE, 0.0, 0.0
                bits, value = _stored_scale(kind, raw)
                _fit(kind, xs, value * gs, q, p)
                err = _group_error(p)
                if i == 0 or err < best_err:
                    best_err, best_bits, best_value = err, bits, value
            scales[r, g] = best_bits
            _fit(kind, xs, best_value * gs, q, p)
            for k in range(0, _G, 2):
                c0 = _encode(kind, q[k])
                c1 = _encode(kind, q[k + 1])
                codes[r, (g * _G + k) // 2] = c0 | (c1 << 4)
                v0 = _decode(kind, c0, deq_values, best_value, gs)
                v1 = _decode(kind, c1, deq_values, best_value, gs)
                d0 = v0 - np.float64(xs[k])
                d1 = v1 - np.float64(xs[k + 1])
                e = d0 * d0 + d1 * d1
                f = np.float64(xs[k]) ** 2 + np.float64(xs[k + 1]) ** 2
                sq_err += e
                sq_ref += f
                row_err += e
                row_ref += f
                row_nonzero += (v0 != 0.0) + (v1 != 0.0)
        rows[r, 0] = row_err
        rows[r, 1] = row_ref
        rows[r, 2] = row_nonzero
    return _OK, sq_err, sq_ref


@numba.njit(nogil=True, cache=True, inline="always")
def _encode(kind, q):  # type: ignore[no-untyped-def]
    if kind == _INT4:
        return np.int64(q + _F32(8)) & 0xFF
    return _e2m1_code(q)


@numba.njit(nogil=True, cache=True, inline="always")
def _decode(kind, code, deq_values, scale, gs):  # type: ignore[no-untyped-def]
    """The dequantized value as the numpy codec computes it, widened to float64."""
    if kind == _INT4:
        return np.float64(np.float32(code - 8) * scale)
    return np.float64(deq_values[code & 15] * scale * gs)


@numba.njit(nogil=True, cache=True)
def _fp8_kernel(x, codes, scales, rows):  # type: ignore[no-untyped-def]
    """fp8: per-row absmax / 448 scale, values / scale cast to e4m3fn; (sq_err, sq_ref)."""
    n, w = x.shape
    sq_err = 0.0
    sq_ref = 0.0
    for r in range(n):
        row_err = 0.0
        row_ref = 0.0
        row_nonzero = 0.0
        amax = _F32(0)
        for c in range(w):
            amax = max(amax, np.abs(x[r, c]))
        s = amax / _F32(448)
        scales[r] = s
        for c in range(w):
            v = x[r, c] / s if s > _F32(0) else _F32(0)
            bits = _e4m3_bits(np.abs(v)) | (np.int64(np.float32(v).view(np.uint32) >> 31) << 7)
            codes[r, c] = bits
            deq = np.float64(np.copysign(_e4m3_value(bits & 0x7F), v) * s)
            d = deq - np.float64(x[r, c])
            sq_err += d * d
            sq_ref += np.float64(x[r, c]) ** 2
            row_err += d * d
            row_ref += np.float64(x[r, c]) ** 2
            row_nonzero += deq != 0.0
        rows[r, 0] = row_err
        rows[r, 1] = row_ref
        rows[r, 2] = row_nonzero
    return sq_err, sq_ref


@numba.njit(nogil=True, cache=True)
def _bf16_kernel(x, out, rows):  # type: ignore[no-untyped-def]
    """bf16 bits of float32 [n, w] (nearest-even); (sq_err, sq_ref)."""
    n, w = x.shape
    sq_err = 0.0
    sq_ref = 0.0
    for r in range(n):
        row_err = 0.0
        row_ref = 0.0
        row_nonzero = 0.0
        for c in range(w):
            h = _round_bits(np.int64(np.float32(x[r, c]).view(np.uint32)), 16)
            out[r, c] = h
            deq = np.float64(np.uint32(h << 16).view(np.float32))
            d = deq - np.float64(x[r, c])
            sq_err += d * d
            sq_ref += np.float64(x[r, c]) ** 2
            row_err += d * d
            row_ref += np.float64(x[r, c]) ** 2
            row_nonzero += deq != 0.0
        rows[r, 0] = row_err
        rows[r, 1] = row_ref
        rows[r, 2] = row_nonzero
    return sq_err, sq_ref


# -- Python entry points --------------------------------------------------------------------


def block_absmax(block: np.ndarray) -> tuple[float, int]:
    """float32 [n, w] -> (largest magnitude, flat index of the first non-finite value or -1)."""
    amax, bad = _absmax_scan(np.ascontiguousarray(block, dtype=np.float32))
    return float(amax), int(bad)


def quantize_block(
    codec: F.Codec,
    block: np.ndarray,
    scalars: Mapping[str, float] | None = None,
    *,
    finite: bool = False,
    row_sums: np.ndarray | None = None,
) -> tuple[dict[str, np.ndarray], float, float]:
    """float32 [n, width] -> (the codec's per-row tensors, squared error, squared sum).

    The tensors are byte-identical to ``codec.quantize(block, scalars)``'s (per-shard scalars
    are the caller's: nvfp4 needs ``scalars``). Squared error and squared sum are float64
    sums over the block of the stored values' error and of the input. ``finite=True`` skips
    the scan for NaN/inf (the caller has done it, e.g. with :func:`block_absmax`).
    ``row_sums`` (float64 [n, 3], optional) receives each row's squared error, squared sum
    and count of non-zero stored values (what :class:`~flashnext.store.row_error.RowErrors`
    needs), from the values the kernel already holds: no second dequantization.

    Raises:
        FormatError: as ``codec.quantize`` (the reference raises its own message): a width
            the format cannot hold, a non-finite value, a scale outside the stored range.
    """
    x = np.ascontiguousarray(block, dtype=np.float32)
    if x.ndim != 2 or not x.shape[0]:
        return codec.quantize(x, scalars), *_reference_sums(codec, x, scalars)
    codec.check_width(x.shape[1])
    if not finite and _absmax_scan(x)[1] >= 0:
        codec.quantize(x, scalars)  # raises the reference's message
    n, w = x.shape
    rows = _row_sums(row_sums, n)
    if isinstance(codec, F.BF16Codec):
        bits = np.empty((n, w), dtype=np.uint16)
        sums = _bf16_kernel(x, bits, rows)
        return {codec.weight.name: bits.view(F.BF16)}, *sums
    if isinstance(codec, F.FP8Codec):
        codes = np.empty((n, w), dtype=np.uint8)
        scale = np.empty(n, dtype=np.float32)
        sums = _fp8_kernel(x, codes, scale, rows)
        return {codec.weight.name: codes.view(F.E4M3), codec.scale.name: scale}, *sums
    return _group_block(codec, x, scalars, rows)


def _group_block(
    codec: F.Codec, x: np.ndarray, scalars: Mapping[str, float] | None, rows: np.ndarray
) -> tuple[dict[str, np.ndarray], float, float]:
    """:func:`quantize_block` for int4 / nvfp4 (finite, contiguous float32 ``x``)."""
    n, w = x.shape
    assert isinstance(codec, F._GroupCodec) and codec.group == _G
    gs = _F32(1)
    if isinstance(codec, F.NVFP4Codec):
        if scalars is None:
            raise F.FormatError("nvfp4: the compiled quantizer needs the shard's weight_scale_2")
        gs = _F32(scalars[codec.scale_2.name])
    codes = np.empty((n, w // 2), dtype=np.uint8)
    scales = np.empty(
        (n, w // codec.group), dtype=np.uint8 if codec.scale.dtype.itemsize == 1 else np.uint16
    )
    ratios = np.array([_F32(r / codec.qmax) for r in F.CLIP_RATIOS], dtype=np.float32)
    if isinstance(codec, F.Int4Codec):
        found = _int4_kernel(x, ratios, codes, scales, F.E2M1_CODES, rows)
    else:
        found = _nvfp4_kernel(x, gs, ratios, codes, scales, F.E2M1_CODES, rows)
    status, sq_err, sq_ref = found
    if status != _OK or not gs > 0:
        codec.quantize(x, scalars)  # raises the reference's message
        raise F.FormatError(f"{codec.name}: the block cannot be quantized")  # pragma: no cover
    return (
        {codec.codes.name: codes, codec.scale.name: scales.view(codec.scale.dtype)},
        sq_err,
        sq_ref,
    )


def _row_sums(row_sums: np.ndarray | None, n: int) -> np.ndarray:
    """The caller's float64 [n, 3] per-row sums (checked), or scratch for them."""
    if row_sums is None:
        return np.empty((n, 3))
    if row_sums.shape != (n, 3) or row_sums.dtype != np.float64:
        raise ValueError(
            f"row_sums is {row_sums.dtype} {list(row_sums.shape)}, expected float64 [{n}, 3]"
        )
    return row_sums


def _reference_sums(
    codec: F.Codec, x: np.ndarray, scalars: Mapping[str, float] | None
) -> tuple[float, float]:
    diff = codec.dequantize(codec.quantize(x, scalars)).astype(np.float64) - x
    return float((diff * diff).sum()), float(np.square(x, dtype=np.float64).sum())


#: Where :func:`compiled_matches_reference` keeps its verdicts (else ``$XDG_CACHE_HOME/flashnext``,
#: else ``~/.cache/flashnext``).
CACHE_DIR_ENV = "FLASHNEXT_CACHE_DIR"
#: What, besides the versions and CPU, could change how numba's or numpy's arithmetic comes out.
_VERDICT_ENV = ("NUMBA_CPU_NAME", "NUMBA_CPU_FEATURES", "NUMBA_OPT", "NPY_DISABLE_CPU_FEATURES")


@functools.cache
def compiled_matches_reference() -> bool:
    """Whether the kernels reproduce the numpy codecs byte for byte on this platform.

    Quantizes a fixed block (rows from 2^-30 to 2^12 in size, all-zero, tiny, signed zeros) with
    every codec both ways (also compiling the kernels), once per :func:`verdict_key`: the
    verdict is kept under :func:`verdict_dir`, so each small ``ple quantize`` does not pay again.
    """
    return cached_verdict(verdict_key(), verdict_dir())


def verdict_dir() -> Path:
    """The user cache directory for self-check verdicts (see :data:`CACHE_DIR_ENV`)."""
    root = os.environ.get(CACHE_DIR_ENV)
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME")
        root = os.path.join(xdg, "flashnext") if xdg else os.path.expanduser("~/.cache/flashnext")
    return Path(root) / "quantize-self-check"


def verdict_key() -> dict[str, str]:
    """Everything the self-check's outcome depends on: flashnext's version and the source of the
    kernels and the reference codecs, numba / llvmlite / numpy / ml_dtypes versions, Python,
    the CPU (name and features, as numba compiles for them) and the environment that overrides
    either."""
    import llvmlite
    import llvmlite.binding as llvm
    import ml_dtypes

    from flashnext import __version__

    sources = hashlib.sha256()
    for module in (__file__, F.__file__):
        sources.update(Path(module).read_bytes())
    key = {
        "flashnext": __version__,
        "sources": sources.hexdigest(),
        "numba": numba.__version__,
        "llvmlite": llvmlite.__version__,
        "numpy": np.__version__,
        "ml_dtypes": ml_dtypes.__version__,
        "python": sys.version,
        "machine": platform.machine(),
        "cpu": llvm.get_host_cpu_name(),
        "cpu_features": llvm.get_host_cpu_features().flatten(),
    }
    key.update({name: os.environ.get(name, "") for name in _VERDICT_ENV})
    return key


def cached_verdict(key: Mapping[str, str], directory: Path) -> bool:
    """The verdict stored for ``key`` in ``directory``, else the self-check's, then stored
    (temp name + rename). An entry that does not parse, or holds another key, is ignored; a
    directory that cannot be written only costs the next run its self-check."""
    blob = json.dumps(dict(key), sort_keys=True)
    path = directory / f"{hashlib.sha256(blob.encode()).hexdigest()[:32]}.json"
    try:
        entry = json.loads(path.read_text())
        if entry["key"] == dict(key) and isinstance(entry["matches"], bool):
            return bool(entry["matches"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    matches = _self_check()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"key": dict(key), "matches": matches}))
        os.replace(tmp, path)
    except OSError:
        pass
    return matches


def load_kernels() -> None:
    """Compile (or load from numba's cache) every kernel, so that a timing or a memory reading
    taken next holds none of it (a cached :func:`compiled_matches_reference` loads nothing)."""
    block = _probe_block()[:16]
    block_absmax(block)
    for codec in F.CODECS.values():
        quantize_block(codec, block, codec.shard_scalars(float(np.abs(block).max())) or None)


def _self_check() -> bool:
    x = _probe_block()
    for codec in F.CODECS.values():
        scalars = codec.shard_scalars(float(np.abs(x).max())) or None
        want = codec.quantize(x, scalars)
        got, _, _ = quantize_block(codec, x, scalars)
        for name, arr in got.items():
            if arr.dtype != want[name].dtype or arr.tobytes() != want[name].tobytes():
                return False
    return True


def _probe_block() -> np.ndarray:
    rng = np.random.default_rng(20261201)
    x = rng.standard_normal((512, 160), dtype=np.float32)
    x *= np.exp2(rng.integers(-30, 12, size=(512, 1))).astype(np.float32)
    x[0] = 0
    x[1, :16] = 1e-30
    x[2, ::3] = -0.0
    return x

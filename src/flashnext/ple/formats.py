"""PLE table formats: one codec per format, pure numpy, bit layouts spelled out.

A codec turns float32 rows into the tensors stored for them and back. It knows bytes, not
files (:mod:`flashnext.ple.sidecar` owns files). Tensor names and layouts are those of the
public quantized-PLE-tables card, so sidecars written by other tools read unchanged.

======  ====================================================  ===========================================
format  tensors (``n`` rows, width ``w``, ``g = w // 16``)       dequantized row
======  ====================================================  ===========================================
bf16    ``weight`` [n, w] bfloat16                            ``weight``
fp8     ``weight_fp8`` [n, w] float8_e4m3fn;                   ``weight_fp8 * weight_scale[row]``
        ``weight_scale`` [n] float32
int4    ``weight_i4`` [n, w/2] uint8, low nibble = even column; ``(nibble - 8) * weight_scale[row, c // 16]``
        ``weight_scale`` [n, g] float16
nvfp4   ``weight_e2m1`` [n, w/2] uint8, low nibble = even       ``E2M1[code] * weight_scale[row, c // 16]
        column, code = magnitude index | sign << 3;             * weight_scale_2``
        ``weight_scale`` [n, g] float8_e4m3fn;
        ``weight_scale_2`` [] float32 (one per shard)
======  ====================================================  ===========================================

E2M1 magnitudes by index: 0, 0.5, 1, 1.5, 2, 3, 4, 6 (:data:`E2M1_VALUES`).

Scales minimise squared error, not just absmax: fp8 uses the row absmax (e4m3's relative
precision is flat, so clipping buys nothing); int4 and nvfp4 try each clipping ratio in
:data:`CLIP_RATIOS` per 16-column group, with the scale rounded to its stored dtype first,
and keep the ratio with the smallest squared error.

Dequantization multiplies in float32 in the order written above; because every factor but the
last is exact, the result equals the float64 product rounded once to float32.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from flashnext.errors import FormatError

BF16 = np.dtype(ml_dtypes.bfloat16)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E4M3_MAX = 448.0
GROUP = 16
#: Magnitudes of the 8 E2M1 codes (index = low 3 bits of a code; bit 3 is the sign).
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)
#: All 16 E2M1 codes as float32, sign bit included (code 8 is -0.0).
E2M1_CODES = np.concatenate([E2M1_VALUES, -E2M1_VALUES]).astype(np.float32)
#: Clipping ratios tried per group for int4 and nvfp4 (1.0 = absmax).
CLIP_RATIOS = (1.0, 0.95, 0.9, 0.875, 0.85, 0.8, 0.75, 0.7)

# Lookup tables for dequantization. A gather from a 1-D table of 8-byte entries is numpy's
# fastest path, so each packed e2m1 byte (two nibbles, low = even column) maps to a uint64
# holding two float32, and fp8 bytes are read two at a time through a 65,536-entry table.
_E4M3_LUT = np.arange(256, dtype=np.uint8).view(E4M3).astype(np.float32)


def _pair_table(first: np.ndarray, second: np.ndarray) -> np.ndarray:
    return (
        np.ascontiguousarray(np.stack([first, second], axis=-1).astype(np.float32))
        .view(np.uint64)
        .reshape(-1)
    )


_E2M1_PAIRS = _pair_table(E2M1_CODES[np.arange(256) & 0xF], E2M1_CODES[np.arange(256) >> 4])
_E4M3_PAIRS = _pair_table(_E4M3_LUT[np.arange(65536) & 0xFF], _E4M3_LUT[np.arange(65536) >> 8])


@dataclass(frozen=True)
class TensorSpec:
    """One stored tensor: ``per_row`` tensors have shape [rows, *cols(width)], others shape []."""

    name: str
    dtype: np.dtype
    per_row: bool
    cols: int | None  # width // cols columns per row; None = one value per row (shape [rows])
    pad: int = 0  # byte that makes a padding row dequantize to +0.0 (int4: nibbles 8, 8)

    def shape(self, rows: int, width: int) -> tuple[int, ...]:
        if not self.per_row:
            return ()
        if self.cols is None:
            return (rows,)
        return (rows, width // self.cols)


class Codec:
    """Base of the four codecs. Subclasses set ``name`` and ``specs`` and implement the pair."""

    name: str = ""
    specs: tuple[TensorSpec, ...] = ()

    def bytes_per_row(self, width: int) -> int:
        """Stored bytes per row, per-shard scalars excluded (int4 at width 160: 100)."""
        total = 0
        for s in self.specs:
            if s.per_row:
                cols = 1 if s.cols is None else width // s.cols
                total += cols * s.dtype.itemsize
        return total

    @property
    def tensor_names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.specs)

    def check_width(self, width: int) -> None:
        if width <= 0 or (width % GROUP and self.name in ("int4", "nvfp4")):
            raise FormatError(f"{self.name}: width {width} is not a positive multiple of {GROUP}")

    def quantize(
        self, rows: np.ndarray, scalars: Mapping[str, float] | None = None
    ) -> dict[str, np.ndarray]:
        """float32 [n, width] -> the stored tensors (see the module table).

        ``scalars`` fixes the per-shard scalars (from :meth:`shard_scalars`) when a shard is
        quantized in blocks; by default they are computed from ``rows``.

        Raises:
            FormatError: ``rows`` is not 2-D, its width does not fit the format, or a value is
                not finite (the message names the row and column).
        """
        raise NotImplementedError

    def shard_scalars(self, absmax: float) -> dict[str, float]:
        """Per-shard scalars for a shard whose largest magnitude is ``absmax`` (none by default)."""
        return {}

    def dequantize(self, tensors: Mapping[str, np.ndarray]) -> np.ndarray:
        """Stored tensors of ``n`` rows -> float32 [n, width].

        Per-shard scalars (``weight_scale_2``) may also be given per row, shape [n].
        """
        raise NotImplementedError

    def _rows(self, rows: np.ndarray) -> np.ndarray:
        arr = np.asarray(rows)
        if arr.ndim != 2:
            raise FormatError(
                f"{self.name}: rows must be 2-D [n, width], found shape {list(arr.shape)}"
            )
        self.check_width(arr.shape[1])
        arr = arr.astype(np.float32, copy=False)
        if not np.all(np.isfinite(arr)):
            bad = np.argwhere(~np.isfinite(arr))[0]
            raise FormatError(
                f"{self.name}: row {int(bad[0])} column {int(bad[1])} is {arr[tuple(bad)]}; "
                "PLE rows must be finite"
            )
        return arr


def _safe_div(x: np.ndarray, s: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(s > 0, x / np.where(s > 0, s, 1), 0)


def _pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """uint8 [n, w] nibbles -> uint8 [n, w/2], low nibble = even column."""
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)


def _unpack_pairs(packed: np.ndarray, pairs: np.ndarray) -> np.ndarray:
    """uint8 [n, w/2] (or uint16 [n, w/2] for fp8) -> float32 [n, w] through a pair table."""
    n = packed.shape[0]
    return np.take(pairs, np.ascontiguousarray(packed).reshape(-1)).view(np.float32).reshape(n, -1)


class BF16Codec(Codec):
    name = "bf16"
    specs = (TensorSpec("weight", BF16, True, 1),)

    def quantize(
        self, rows: np.ndarray, scalars: Mapping[str, float] | None = None
    ) -> dict[str, np.ndarray]:
        return {"weight": self._rows(rows).astype(BF16)}

    def dequantize(self, tensors: Mapping[str, np.ndarray]) -> np.ndarray:
        w = np.asarray(tensors["weight"])
        bits = w.view(np.uint16).astype(np.uint32) << 16
        return bits.view(np.float32)


class FP8Codec(Codec):
    name = "fp8"
    specs = (
        TensorSpec("weight_fp8", E4M3, True, 1),
        TensorSpec("weight_scale", np.dtype(np.float32), True, None),
    )

    def quantize(
        self, rows: np.ndarray, scalars: Mapping[str, float] | None = None
    ) -> dict[str, np.ndarray]:
        x = self._rows(rows)
        scale = (np.abs(x).max(axis=1) / np.float32(E4M3_MAX)).astype(np.float32)
        q = _safe_div(x, scale[:, None]).astype(E4M3)
        return {"weight_fp8": q, "weight_scale": scale}

    def dequantize(self, tensors: Mapping[str, np.ndarray]) -> np.ndarray:
        q = np.ascontiguousarray(tensors["weight_fp8"]).view(np.uint8)
        scale = np.asarray(tensors["weight_scale"], dtype=np.float32).reshape(-1, 1)
        if q.shape[-1] % 2:
            return np.take(_E4M3_LUT, q) * scale
        out = _unpack_pairs(q.view(np.uint16), _E4M3_PAIRS)
        out *= scale
        return out


class _GroupCodec(Codec):
    """Shared search for the group-16 codecs: per group, the clip ratio with least error."""

    scale_dtype: np.dtype
    qmax: float

    def _round(self, y: np.ndarray) -> np.ndarray:
        """Values in units of the group scale -> the nearest representable value (float32)."""
        raise NotImplementedError

    def _codes(self, q: np.ndarray) -> np.ndarray:
        """Representable values from :meth:`_round` -> their 4-bit codes (uint8)."""
        raise NotImplementedError

    def _search(self, x: np.ndarray, global_scale: np.float32) -> tuple[np.ndarray, np.ndarray]:
        n, w = x.shape
        xg = x.reshape(n, w // GROUP, GROUP)
        amax = np.abs(xg).max(axis=2, keepdims=True)

        def scaled(stored: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            s = stored.astype(np.float32) * global_scale
            with np.errstate(divide="ignore"):
                inv = np.where(s > 0, np.float32(1) / s, np.float32(0))
            return s, xg * inv

        # The search compares errors only; codes are made once, for the winning scale.
        best_err = best_scale = None
        for ratio in CLIP_RATIOS:
            stored = self._store_scale(amax * np.float32(ratio / self.qmax) / global_scale)
            s, y = scaled(stored)
            diff = self._round(y) * s - xg
            err = np.einsum("ngk,ngk->ng", diff, diff)[:, :, None]
            if best_err is None or best_scale is None:
                best_err, best_scale = err, stored
            else:
                better = err < best_err
                best_err = np.where(better, err, best_err)
                best_scale = np.where(better, stored, best_scale)
        if best_scale is None:
            raise FormatError(f"{self.name}: CLIP_RATIOS is empty")
        _, y = scaled(best_scale)
        codes = self._codes(self._round(y))
        return _pack_nibbles(codes.reshape(n, w)), best_scale.reshape(n, w // GROUP)

    def _store_scale(self, raw: np.ndarray) -> np.ndarray:
        # Rounding can carry the top scale a hair past e4m3's 448, which would cast to NaN.
        return np.minimum(raw, np.float32(E4M3_MAX)).astype(self.scale_dtype)


class Int4Codec(_GroupCodec):
    name = "int4"
    specs = (
        TensorSpec("weight_i4", np.dtype(np.uint8), True, 2, pad=0x88),
        TensorSpec("weight_scale", np.dtype(np.float16), True, GROUP),
    )
    scale_dtype = np.dtype(np.float16)
    qmax = 7.0

    def _store_scale(self, raw: np.ndarray) -> np.ndarray:
        if np.any(raw > np.finfo(np.float16).max):
            raise FormatError(
                "int4: a group's scale exceeds float16's range (|value| > 458,528); "
                "rows this large are not an embedding table"
            )
        return raw.astype(np.float16)

    def _round(self, y: np.ndarray) -> np.ndarray:
        return np.clip(np.rint(y), -8, 7)

    def _codes(self, q: np.ndarray) -> np.ndarray:
        return (q + 8).astype(np.uint8)

    def quantize(
        self, rows: np.ndarray, scalars: Mapping[str, float] | None = None
    ) -> dict[str, np.ndarray]:
        packed, scale = self._search(self._rows(rows), np.float32(1.0))
        return {"weight_i4": packed, "weight_scale": scale}

    def dequantize(self, tensors: Mapping[str, np.ndarray]) -> np.ndarray:
        packed = np.asarray(tensors["weight_i4"])
        n, half = packed.shape
        # Integer unpacking beats a table gather here (no int64 index array); int8 x float32
        # products are exact, so this equals the float64 reference rounded to float32.
        q = np.empty((n, half, 2), dtype=np.int8)
        np.bitwise_and(packed, 0xF, out=q[..., 0], casting="unsafe")
        np.right_shift(packed, 4, out=q[..., 1], casting="unsafe")
        q -= 8
        scale = np.asarray(tensors["weight_scale"]).astype(np.float32)
        out = np.multiply(q.reshape(n, -1, GROUP), scale[:, :, None], dtype=np.float32)
        return out.reshape(n, 2 * half)


class NVFP4Codec(_GroupCodec):
    name = "nvfp4"
    specs = (
        TensorSpec("weight_e2m1", np.dtype(np.uint8), True, 2),
        TensorSpec("weight_scale", E4M3, True, GROUP),
        TensorSpec("weight_scale_2", np.dtype(np.float32), False, None),
    )
    scale_dtype = E4M3
    qmax = 6.0

    def _round(self, y: np.ndarray) -> np.ndarray:
        # From 1 up, E2M1 is float32 cut to one mantissa bit: round the bits (half away from
        # zero), clamp at 6. Below 1 the grid is 0, 0.5, 1. In place: this is the hot loop.
        a = np.abs(y)
        bits = a.view(np.uint32) + np.uint32(1 << 21)
        bits &= np.uint32(0xFFC00000)
        q = bits.view(np.float32)
        small = a * np.float32(2)
        np.rint(small, out=small)
        small *= np.float32(0.5)
        np.copyto(q, small, where=a < 1)
        np.minimum(q, np.float32(6), out=q)
        np.copysign(q, y, out=q)
        return q

    def _codes(self, q: np.ndarray) -> np.ndarray:
        # Magnitude index: 2a below 1; from 1 up, 2 * (exponent + 1) + the mantissa bit.
        a = np.abs(q)
        bits = a.view(np.uint32)
        mag = ((bits >> 23) - np.uint32(126)) * np.uint32(2) + ((bits >> 22) & np.uint32(1))
        mag = np.where(a < 1, a * 2, mag).astype(np.uint8)
        return mag | (np.signbit(q).astype(np.uint8) << 3)

    def shard_scalars(self, absmax: float) -> dict[str, float]:
        # The per-shard scale puts the largest group scale at e4m3's top (448).
        return {
            "weight_scale_2": float(np.float32(absmax / (6.0 * E4M3_MAX))) if absmax > 0 else 1.0
        }

    def quantize(
        self, rows: np.ndarray, scalars: Mapping[str, float] | None = None
    ) -> dict[str, np.ndarray]:
        x = self._rows(rows)
        if scalars is None:
            scalars = self.shard_scalars(float(np.abs(x).max()) if x.size else 0.0)
        scale_2 = np.float32(scalars["weight_scale_2"])
        if not scale_2 > 0:
            raise FormatError(f"nvfp4: weight_scale_2 must be positive, found {scale_2}")
        packed, scale = self._search(x, scale_2)
        return {"weight_e2m1": packed, "weight_scale": scale, "weight_scale_2": np.array(scale_2)}

    def dequantize(self, tensors: Mapping[str, np.ndarray]) -> np.ndarray:
        vals = _unpack_pairs(np.asarray(tensors["weight_e2m1"]), _E2M1_PAIRS)
        n, w = vals.shape
        scale = np.take(_E4M3_LUT, np.asarray(tensors["weight_scale"]).view(np.uint8))
        s2 = np.asarray(tensors["weight_scale_2"], dtype=np.float32).reshape(-1, 1, 1)
        grouped = vals.reshape(n, w // GROUP, GROUP)
        grouped *= scale[:, :, None]  # exact: e2m1 x e4m3 fits float32's mantissa
        grouped *= s2  # the one rounding
        return vals


CODECS: dict[str, Codec] = {c.name: c for c in (BF16Codec(), FP8Codec(), Int4Codec(), NVFP4Codec())}
FORMATS = tuple(CODECS)


def get_codec(name: str) -> Codec:
    """The codec named ``name`` (bf16, fp8, int4, nvfp4)."""
    try:
        return CODECS[name]
    except KeyError:
        raise FormatError(
            f"unknown PLE table format {name!r}; expected one of {list(CODECS)}"
        ) from None


def detect_format(tensor_names: object) -> Codec:
    """The codec whose tensor names are exactly ``tensor_names`` (order ignored)."""
    names = set(tensor_names)  # type: ignore[call-overload]
    for codec in CODECS.values():
        if names == set(codec.tensor_names):
            return codec
    raise FormatError(
        f"tensors {sorted(names)} match no PLE table format; expected one of "
        + "; ".join(f"{c.name}: {list(c.tensor_names)}" for c in CODECS.values())
    )


def quantize(fmt: str, rows: np.ndarray) -> dict[str, np.ndarray]:
    """float32 [n, width] -> the tensors of format ``fmt``."""
    return get_codec(fmt).quantize(rows)


def dequantize(fmt: str, tensors: Mapping[str, np.ndarray]) -> np.ndarray:
    """The tensors of format ``fmt`` for ``n`` rows -> float32 [n, width]."""
    return get_codec(fmt).dequantize(tensors)


def rel_rmse(reference: np.ndarray, approx: np.ndarray) -> float:
    """``sqrt(sum((approx - ref)^2) / sum(ref^2))`` in float64; 0.0 for an all-zero reference."""
    ref = np.asarray(reference, dtype=np.float64)
    diff = np.asarray(approx, dtype=np.float64) - ref
    denom = float((ref * ref).sum())
    return float(np.sqrt((diff * diff).sum() / denom)) if denom > 0 else 0.0

"""PLE table formats: THE contract. One codec per format, pure numpy, bit layouts spelled out.

Every format fact lives here and nowhere else: tensor names, dtypes, shapes as a function of the
row width, group size, per-shard scalars, pad values, and how a Hugging Face checkpoint spells
a table in the format. Everything that needs one (the sidecar reader and writer, ``PLETable``,
checkpoint discovery, the quantizer, the GPU kernels) reads it from here. A codec turns
float32 rows into the tensors stored for them and back; it knows bytes, not files
(:mod:`flashnext.store.sidecar` owns files).

Sidecar tensors (the public quantized-PLE-tables card: sidecars written by other tools read
unchanged). ``n`` rows, width ``w``, ``g = w / GROUP``:

======  ====================================================  ===========================================
format  tensors                                               dequantized row
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

Checkpoint spellings (vLLM 0.33.0; names relative to ``...ngram_embedding.`` plus the layout's
``shard_{k}.`` for per-row tensors, see :mod:`flashnext.checkpoint.ple_tensors`):

======  ==============================================  =============================================
format  per-row tensors                                 one per table
======  ==============================================  =============================================
bf16    ``weight`` BF16 [n, w]                          -
fp8     ``weight`` F8_E4M3 [n, w]                       ``weight_scale`` F32 [] (the fp8 codec's
                                                        per-row scale, the same for every row)
nvfp4   ``weight`` U8 [n, w/2] (the e2m1 codes);        ``weight_scale_2`` F32 []
        ``weight_scale`` F8_E4M3 [n, g]
======  ==============================================  =============================================

int4 has no checkpoint spelling. The row tensor's dtype alone tells the formats apart
(:func:`checkpoint_format`).

E2M1 magnitudes by index: 0, 0.5, 1, 1.5, 2, 3, 4, 6 (:data:`E2M1_VALUES`); the reference
pairs :func:`e2m1_encode` / :func:`e2m1_decode` and :func:`pack_nibbles` /
:func:`unpack_nibbles` are what GPU kernels are tested bit-exact against.

Scales minimise squared error, not just absmax: fp8 uses the row absmax (e4m3's relative
precision is flat, so clipping buys nothing); int4 and nvfp4 try each clipping ratio in
:data:`CLIP_RATIOS` per group, with the scale rounded to its stored dtype first, and keep the
ratio with the smallest squared error.

Dequantization multiplies in float32 in the order written above; because every factor but the
last is exact, the result equals the float64 product rounded once to float32.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from flashnext.errors import FormatError
from flashnext.safetensors_file import dtype_name

BF16 = np.dtype(ml_dtypes.bfloat16)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)
U8 = np.dtype(np.uint8)

#: Largest finite float8_e4m3fn value.
E4M3_MAX = 448.0
#: Table columns per scale in the group formats (int4, nvfp4).
GROUP = 16
#: Magnitudes of the 8 E2M1 codes (index = low 3 bits of a code; bit 3 is the sign).
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)
#: Largest E2M1 magnitude.
E2M1_MAX = float(E2M1_VALUES[-1])
#: Bit of an E2M1 code that holds the sign.
E2M1_SIGN_BIT = 3
#: All 16 E2M1 codes as float32, sign bit included (code 8 is -0.0).
E2M1_CODES = np.concatenate([E2M1_VALUES, -E2M1_VALUES]).astype(np.float32)
#: int4 values are integers in [INT4_MIN, INT4_MAX], stored as the nibble value + INT4_BIAS.
INT4_MIN, INT4_MAX, INT4_BIAS = -8, 7, 8
#: A 4-bit code occupies this many bits; two share a byte, the even column in the low nibble.
NIBBLE_BITS = 4
NIBBLE_MASK = (1 << NIBBLE_BITS) - 1
#: Clipping ratios tried per group for int4 and nvfp4 (1.0 = absmax).
CLIP_RATIOS = (1.0, 0.95, 0.9, 0.875, 0.85, 0.8, 0.75, 0.7)
#: What every checkpoint spelling calls the tensor holding the rows.
CHECKPOINT_ROWS = "weight"

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


_BYTE = np.arange(256)
_E2M1_PAIRS = _pair_table(E2M1_CODES[_BYTE & NIBBLE_MASK], E2M1_CODES[_BYTE >> NIBBLE_BITS])
_E4M3_PAIRS = _pair_table(_E4M3_LUT[np.arange(65536) & 0xFF], _E4M3_LUT[np.arange(65536) >> 8])


@dataclass(frozen=True)
class TensorSpec:
    """One stored tensor; its shape is an explicit function of the row count and width.

    ``span`` is how many table columns one stored value covers (1: one per column; 2: two
    4-bit codes per byte; :data:`GROUP`: one scale per group), so :meth:`shape` is:

    - ``per_row`` and ``span``: ``[rows, width / span]``;
    - ``per_row``, ``span`` None: ``[rows]`` (one value per row);
    - not ``per_row``: ``[]`` (one value per shard; per table in a checkpoint).

    ``pad`` is the value whose stored bytes make a padding row dequantize to +0.0 (int4: the
    byte 0x88, two zero nibbles; every other tensor: 0).
    """

    name: str
    dtype: np.dtype
    per_row: bool
    span: int | None
    pad: int = 0

    def cols(self, width: int) -> int | None:
        """Stored columns per row at ``width`` (None for ``[rows]`` and ``[]`` tensors)."""
        if not self.per_row or self.span is None:
            return None
        return width // self.span

    def shape(self, rows: int, width: int) -> tuple[int, ...]:
        """The tensor's shape for ``rows`` rows of ``width`` columns (see the class doc)."""
        if not self.per_row:
            return ()
        cols = self.cols(width)
        return (rows,) if cols is None else (rows, cols)

    def width_of(self, cols: int) -> int:
        """The table width that gives ``cols`` stored columns (inverse of :meth:`cols`)."""
        if self.span is None:
            raise FormatError(f"tensor {self.name} has no columns to read a width from")
        return cols * self.span

    def describe(self, width: str = "w") -> str:
        """``name DTYPE [shape]`` with the shape in terms of ``width``, e.g. ``weight U8 [n, w/2]``."""
        if not self.per_row:
            shape = "[]"
        elif self.span is None:
            shape = "[n]"
        else:
            shape = f"[n, {width}]" if self.span == 1 else f"[n, {width}/{self.span}]"
        return f"{self.name} {dtype_name(self.dtype)} {shape}"


@dataclass(frozen=True)
class CheckpointTensor(TensorSpec):
    """A tensor as a checkpoint stores it, and the codec tensor it becomes (``feeds``)."""

    feeds: str = ""


@dataclass(frozen=True)
class CheckpointSpelling:
    """How a Hugging Face checkpoint (vLLM 0.33.0) stores a table in one format.

    ``per_row`` tensors sit in every piece of the layout (``shard_{k}.<name>``), the rows first
    (named :data:`CHECKPOINT_ROWS`); ``table_scalars`` are F32 ``[]`` tensors (``[1]`` is
    accepted), one per table, beside the pieces.
    """

    per_row: tuple[CheckpointTensor, ...]
    table_scalars: tuple[CheckpointTensor, ...] = ()

    @property
    def rows(self) -> CheckpointTensor:
        return self.per_row[0]

    def describe(self) -> str:
        """E.g. ``weight U8 [n, w/2] + weight_scale F8_E4M3 [n, w/16] + weight_scale_2 F32 []``."""
        return " + ".join(t.describe() for t in (*self.per_row, *self.table_scalars))


class Codec:
    """Base of the four codecs: the declared tensors plus the quantize/dequantize pair.

    Subclasses set ``name``, ``specs`` (the rows tensor first), ``method`` (how scales are
    chosen; recorded in a sidecar's META.json), ``group`` (columns per scale, None when the
    format has no groups) and ``checkpoint`` (None when checkpoints never hold the format).
    """

    name: str = ""
    specs: tuple[TensorSpec, ...] = ()
    method: str = ""
    group: int | None = None
    checkpoint: CheckpointSpelling | None = None

    @property
    def tensor_names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.specs)

    @property
    def rows_spec(self) -> TensorSpec:
        """The tensor holding the row values; its shape gives the row count and width."""
        return self.specs[0]

    @property
    def row_specs(self) -> tuple[TensorSpec, ...]:
        return tuple(s for s in self.specs if s.per_row)

    @property
    def scalar_specs(self) -> tuple[TensorSpec, ...]:
        """Per-shard scalars (nvfp4 only): shape [] in a shard, float32 [S] in a table."""
        return tuple(s for s in self.specs if not s.per_row)

    def spec(self, name: str) -> TensorSpec:
        """The declared tensor ``name``.

        Raises:
            FormatError: the format has no such tensor.
        """
        for s in self.specs:
            if s.name == name:
                return s
        raise FormatError(f"{self.name}: no tensor {name!r}; tensors {list(self.tensor_names)}")

    @property
    def width_multiple(self) -> int:
        """Widths must be multiples of this: every span of every tensor divides the width."""
        spelled = self.checkpoint.per_row if self.checkpoint else ()
        return math.lcm(*(s.span for s in (*self.specs, *spelled) if s.span is not None))

    def check_width(self, width: int) -> None:
        """Raises FormatError unless ``width`` is a positive multiple of :attr:`width_multiple`."""
        if width <= 0 or width % self.width_multiple:
            raise FormatError(
                f"{self.name}: width {width} is not a positive multiple of {self.width_multiple}"
            )

    def width_of(self, rows_shape: tuple[int, ...]) -> int:
        """The width of a table whose rows tensor has shape ``rows_shape`` ([rows, cols])."""
        return self.rows_spec.width_of(rows_shape[1])

    def bytes_per_row(self, width: int) -> int:
        """Stored bytes per row, per-shard scalars excluded (int4 at width 160: 100)."""
        total = 0
        for s in self.row_specs:
            cols = s.cols(width)
            total += (1 if cols is None else cols) * s.dtype.itemsize
        return total

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

        Per-shard scalars may also be given per row, shape [n].
        """
        raise NotImplementedError

    def dequantize_into(self, tensors: Mapping[str, np.ndarray], out: np.ndarray) -> None:
        """:meth:`dequantize` written into ``out`` (float32 [n, width], e.g. rows of a block)."""
        out[...] = self.dequantize(tensors)

    def from_checkpoint(
        self, per_row: Mapping[str, np.ndarray], scalars: Mapping[str, float]
    ) -> dict[str, np.ndarray]:
        """A checkpoint's tensors for ``n`` rows -> this codec's tensors, for :meth:`dequantize`.

        Args:
            per_row: checkpoint name -> array [n, ...] (the spelling's ``per_row``).
            scalars: checkpoint name -> value (the spelling's ``table_scalars``), broadcast to
                the codec tensor each feeds (fp8: one scale per row; nvfp4: a shard scalar).

        Raises:
            FormatError: the format has no checkpoint spelling, or a tensor is missing.
        """
        if self.checkpoint is None:
            raise FormatError(f"{self.name}: checkpoints do not store this format")
        try:
            n = per_row[self.checkpoint.rows.name].shape[0]
            out = {t.feeds: per_row[t.name] for t in self.checkpoint.per_row}
            for t in self.checkpoint.table_scalars:
                target = self.spec(t.feeds)
                out[t.feeds] = np.full(target.shape(n, 0), scalars[t.name], dtype=target.dtype)
        except KeyError as exc:
            raise FormatError(f"{self.name}: checkpoint tensor {exc} missing") from None
        return out

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


# -- the reference pairs ------------------------------------------------------------------


def _check_codes(what: str, codes: np.ndarray) -> None:
    if not np.issubdtype(codes.dtype, np.integer):
        raise FormatError(f"{what}: codes must be integers, found {codes.dtype}")
    if codes.size and (codes.min() < 0 or codes.max() > NIBBLE_MASK):
        bad = (codes < 0) | (codes > NIBBLE_MASK)
        raise FormatError(
            f"{what}: codes must be 0..{NIBBLE_MASK}, found {codes[bad].reshape(-1)[0]}"
        )


def pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """4-bit codes uint8 [..., w] -> bytes uint8 [..., w/2]; the even column in the low nibble.

    Raises:
        FormatError: ``w`` is odd, or a code is not an integer in 0..15.
    """
    arr = np.asarray(codes)
    if arr.ndim == 0 or arr.shape[-1] % 2:
        raise FormatError(
            f"pack_nibbles: the last axis must be even, found shape {list(arr.shape)}"
        )
    _check_codes("pack_nibbles", arr)
    arr = arr.astype(np.uint8, copy=False)
    return (arr[..., 0::2] | (arr[..., 1::2] << NIBBLE_BITS)).astype(np.uint8)


def unpack_nibbles(packed: np.ndarray) -> np.ndarray:
    """Bytes uint8 [..., w/2] -> 4-bit codes uint8 [..., w] (inverse of :func:`pack_nibbles`).

    Raises:
        FormatError: ``packed`` is not uint8 or has no axes.
    """
    arr = np.asarray(packed)
    if arr.dtype != U8 or arr.ndim == 0:
        raise FormatError(
            f"unpack_nibbles: expected uint8 [..., w/2], found {arr.dtype} {list(arr.shape)}"
        )
    out = np.empty((*arr.shape, 2), dtype=np.uint8)
    np.bitwise_and(arr, NIBBLE_MASK, out=out[..., 0])
    np.right_shift(arr, NIBBLE_BITS, out=out[..., 1])
    return out.reshape(*arr.shape[:-1], 2 * arr.shape[-1])


def _e2m1_round(y: np.ndarray) -> np.ndarray:
    """float32 values -> the nearest E2M1 value (float32); see :func:`e2m1_encode`."""
    # From 1 up, E2M1 is float32 cut to one mantissa bit: round the bits (half away from
    # zero), clamp at E2M1_MAX. Below 1 the grid is 0, 0.5, 1. In place: this is the hot loop.
    a = np.abs(y)
    bits = a.view(np.uint32) + np.uint32(1 << 21)  # half of mantissa bit 22, the one kept
    bits &= np.uint32(0xFFC00000)  # sign, exponent and the top mantissa bit
    q = bits.view(np.float32)
    small = a * np.float32(2)
    np.rint(small, out=small)
    small *= np.float32(0.5)
    np.copyto(q, small, where=a < 1)
    np.minimum(q, np.float32(E2M1_MAX), out=q)
    np.copysign(q, y, out=q)
    return q


def _e2m1_code(q: np.ndarray) -> np.ndarray:
    """E2M1 values from :func:`_e2m1_round` -> their 4-bit codes (uint8)."""
    # Magnitude index: 2a below 1; from 1 up, 2 * (exponent + 1) + the mantissa bit.
    a = np.abs(q)
    bits = a.view(np.uint32)
    mag = ((bits >> 23) - np.uint32(126)) * np.uint32(2) + ((bits >> 22) & np.uint32(1))
    mag = np.where(a < 1, a * 2, mag).astype(np.uint8)
    return mag | (np.signbit(q).astype(np.uint8) << E2M1_SIGN_BIT)


def e2m1_encode(values: np.ndarray) -> np.ndarray:
    """float32 [...] (in units of the block scale) -> E2M1 codes uint8 [...].

    code = magnitude index | sign << 3. Rounds to the nearest value of the grid
    (:data:`E2M1_VALUES`) and saturates at +-6. Ties: below 1 to the even index (0.25 -> 0,
    0.75 -> 1); from 1 up away from zero (1.25 -> 1.5, 2.5 -> 3, 5 -> 6). The sign is kept
    for values that round to zero (-0.1 -> code 8, -0.0).

    Raises:
        FormatError: a value is not finite.
    """
    arr = np.asarray(values, dtype=np.float32)
    if not np.all(np.isfinite(arr)):
        raise FormatError("e2m1_encode: values must be finite")
    return _e2m1_code(_e2m1_round(arr))


def e2m1_decode(codes: np.ndarray) -> np.ndarray:
    """E2M1 codes uint8 [...] -> float32 [...] (:data:`E2M1_CODES`; code 8 is -0.0).

    Raises:
        FormatError: a code is not an integer in 0..15.
    """
    arr = np.asarray(codes)
    _check_codes("e2m1_decode", arr)
    return E2M1_CODES[arr]


# -- the codecs ---------------------------------------------------------------------------


def _safe_div(x: np.ndarray, s: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(s > 0, x / np.where(s > 0, s, 1), 0)


def _unpack_pairs(packed: np.ndarray, pairs: np.ndarray) -> np.ndarray:
    """uint8 [n, w/2] (or uint16 [n, w/2] for fp8) -> float32 [n, w] through a pair table."""
    n = packed.shape[0]
    return np.take(pairs, np.ascontiguousarray(packed).reshape(-1)).view(np.float32).reshape(n, -1)


def _checkpoint_tensor(name: str, dtype: np.dtype, feeds: TensorSpec) -> CheckpointTensor:
    """A checkpoint tensor with the codec tensor's layout (per row, span), renamed/retyped."""
    return CheckpointTensor(name, dtype, feeds.per_row, feeds.span, feeds=feeds.name)


def _table_scalar(name: str, feeds: TensorSpec) -> CheckpointTensor:
    return CheckpointTensor(name, F32, False, None, feeds=feeds.name)


class BF16Codec(Codec):
    name = "bf16"
    weight = TensorSpec("weight", BF16, True, 1)
    specs = (weight,)
    method = "round to nearest even"
    checkpoint = CheckpointSpelling(per_row=(_checkpoint_tensor(CHECKPOINT_ROWS, BF16, weight),))

    def quantize(
        self, rows: np.ndarray, scalars: Mapping[str, float] | None = None
    ) -> dict[str, np.ndarray]:
        return {self.weight.name: self._rows(rows).astype(BF16)}

    def dequantize(self, tensors: Mapping[str, np.ndarray]) -> np.ndarray:
        w = np.asarray(tensors[self.weight.name])
        out = np.empty(w.shape, dtype=np.float32)
        self.dequantize_into(tensors, out)
        return out

    def dequantize_into(self, tensors: Mapping[str, np.ndarray], out: np.ndarray) -> None:
        # bf16 -> float32 is the 16 bits shifted up; in place, because temporaries cost more
        # (fresh pages) than the shift itself.
        bits = out.view(np.uint32)
        bits[...] = np.asarray(tensors[self.weight.name]).view(np.uint16)
        bits <<= 16


class FP8Codec(Codec):
    name = "fp8"
    weight = TensorSpec("weight_fp8", E4M3, True, 1)
    scale = TensorSpec("weight_scale", F32, True, None)
    specs = (weight, scale)
    method = "per-row absmax scale, e4m3fn"
    checkpoint = CheckpointSpelling(
        per_row=(_checkpoint_tensor(CHECKPOINT_ROWS, E4M3, weight),),
        table_scalars=(_table_scalar("weight_scale", scale),),
    )

    def quantize(
        self, rows: np.ndarray, scalars: Mapping[str, float] | None = None
    ) -> dict[str, np.ndarray]:
        x = self._rows(rows)
        scale = (np.abs(x).max(axis=1) / np.float32(E4M3_MAX)).astype(np.float32)
        q = _safe_div(x, scale[:, None]).astype(E4M3)
        return {self.weight.name: q, self.scale.name: scale}

    def dequantize(self, tensors: Mapping[str, np.ndarray]) -> np.ndarray:
        q = np.ascontiguousarray(tensors[self.weight.name]).view(np.uint8)
        scale = np.asarray(tensors[self.scale.name], dtype=np.float32).reshape(-1, 1)
        if q.shape[-1] % 2:
            return np.take(_E4M3_LUT, q) * scale
        out = _unpack_pairs(q.view(np.uint16), _E4M3_PAIRS)
        out *= scale
        return out


class _GroupCodec(Codec):
    """Shared search for the group codecs: per group, the clip ratio with least error.

    Subclasses declare ``codes`` (packed 4-bit codes) and ``scale`` (one per group).
    """

    codes: TensorSpec
    scale: TensorSpec
    group = GROUP
    qmax: float  # the largest magnitude a code represents

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
        return pack_nibbles(codes.reshape(n, w)), best_scale.reshape(n, w // GROUP)

    def _store_scale(self, raw: np.ndarray) -> np.ndarray:
        # Rounding can carry the top scale a hair past e4m3's 448, which would cast to NaN.
        return np.minimum(raw, np.float32(E4M3_MAX)).astype(self.scale.dtype)


class Int4Codec(_GroupCodec):
    name = "int4"
    codes = TensorSpec("weight_i4", U8, True, 2, pad=INT4_BIAS * 0x11)  # nibbles 8, 8: 0.0
    scale = TensorSpec("weight_scale", F16, True, GROUP)
    specs = (codes, scale)
    method = "group-16 fp16 scale, clip ratio searched per group by squared error"
    qmax = float(INT4_MAX)

    def _store_scale(self, raw: np.ndarray) -> np.ndarray:
        if np.any(raw > np.finfo(self.scale.dtype).max):
            raise FormatError(
                "int4: a group's scale exceeds float16's range (|value| > 458,528); "
                "rows this large are not an embedding table"
            )
        return raw.astype(self.scale.dtype)

    def _round(self, y: np.ndarray) -> np.ndarray:
        return np.clip(np.rint(y), INT4_MIN, INT4_MAX)

    def _codes(self, q: np.ndarray) -> np.ndarray:
        return (q + INT4_BIAS).astype(np.uint8)

    def quantize(
        self, rows: np.ndarray, scalars: Mapping[str, float] | None = None
    ) -> dict[str, np.ndarray]:
        packed, scale = self._search(self._rows(rows), np.float32(1.0))
        return {self.codes.name: packed, self.scale.name: scale}

    def dequantize(self, tensors: Mapping[str, np.ndarray]) -> np.ndarray:
        # Integer unpacking beats a table gather here (no int64 index array); int8 x float32
        # products are exact, so this equals the float64 reference rounded to float32.
        q = unpack_nibbles(np.asarray(tensors[self.codes.name])).view(np.int8)
        q -= INT4_BIAS
        n, w = q.shape
        scale = np.asarray(tensors[self.scale.name]).astype(np.float32)
        out = np.multiply(q.reshape(n, -1, GROUP), scale[:, :, None], dtype=np.float32)
        return out.reshape(n, w)


class NVFP4Codec(_GroupCodec):
    name = "nvfp4"
    codes = TensorSpec("weight_e2m1", U8, True, 2)
    scale = TensorSpec("weight_scale", E4M3, True, GROUP)
    scale_2 = TensorSpec("weight_scale_2", F32, False, None)
    specs = (codes, scale, scale_2)
    method = "group-16 e4m3 scale x per-shard fp32 scale_2, clip ratio searched per group"
    qmax = E2M1_MAX
    checkpoint = CheckpointSpelling(
        per_row=(
            _checkpoint_tensor(CHECKPOINT_ROWS, U8, codes),
            _checkpoint_tensor("weight_scale", E4M3, scale),
        ),
        table_scalars=(_table_scalar("weight_scale_2", scale_2),),
    )

    def _round(self, y: np.ndarray) -> np.ndarray:
        return _e2m1_round(y)

    def _codes(self, q: np.ndarray) -> np.ndarray:
        return _e2m1_code(q)

    def shard_scalars(self, absmax: float) -> dict[str, float]:
        # The per-shard scale puts the largest group scale at e4m3's top.
        value = float(np.float32(absmax / (E2M1_MAX * E4M3_MAX))) if absmax > 0 else 1.0
        return {self.scale_2.name: value}

    def quantize(
        self, rows: np.ndarray, scalars: Mapping[str, float] | None = None
    ) -> dict[str, np.ndarray]:
        x = self._rows(rows)
        if scalars is None:
            scalars = self.shard_scalars(float(np.abs(x).max()) if x.size else 0.0)
        scale_2 = np.float32(scalars[self.scale_2.name])
        if not scale_2 > 0:
            raise FormatError(f"nvfp4: {self.scale_2.name} must be positive, found {scale_2}")
        packed, scale = self._search(x, scale_2)
        return {
            self.codes.name: packed,
            self.scale.name: scale,
            self.scale_2.name: np.array(scale_2),
        }

    def dequantize(self, tensors: Mapping[str, np.ndarray]) -> np.ndarray:
        vals = _unpack_pairs(np.asarray(tensors[self.codes.name]), _E2M1_PAIRS)
        n, w = vals.shape
        scale = np.take(_E4M3_LUT, np.asarray(tensors[self.scale.name]).view(np.uint8))
        s2 = np.asarray(tensors[self.scale_2.name], dtype=np.float32).reshape(-1, 1, 1)
        grouped = vals.reshape(n, w // GROUP, GROUP)
        grouped *= scale[:, :, None]  # exact: e2m1 x e4m3 fits float32's mantissa
        grouped *= s2  # the one rounding
        return vals


CODECS: dict[str, Codec] = {c.name: c for c in (BF16Codec(), FP8Codec(), Int4Codec(), NVFP4Codec())}
FORMATS = tuple(CODECS)
#: Formats a Hugging Face checkpoint may hold a table in.
CHECKPOINT_FORMATS = tuple(name for name, c in CODECS.items() if c.checkpoint is not None)


def _unique(names: Iterable[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(names))


#: Every name a checkpoint's per-row table tensors use, over all formats (rows first).
CHECKPOINT_PER_ROW_NAMES = _unique(
    t.name for c in CODECS.values() if c.checkpoint for t in c.checkpoint.per_row
)
#: Every name a checkpoint's one-per-table scalars use, over all formats.
CHECKPOINT_SCALAR_NAMES = _unique(
    t.name for c in CODECS.values() if c.checkpoint for t in c.checkpoint.table_scalars
)


def get_codec(name: str) -> Codec:
    """The codec named ``name`` (bf16, fp8, int4, nvfp4).

    Raises:
        FormatError: no format has that name.
    """
    try:
        return CODECS[name]
    except KeyError:
        raise FormatError(
            f"unknown PLE table format {name!r}; expected one of {list(CODECS)}"
        ) from None


def detect_format(tensor_names: Iterable[str]) -> Codec:
    """The codec whose sidecar tensor names are exactly ``tensor_names`` (order ignored).

    Raises:
        FormatError: no format has exactly these names (the message lists each format's).
    """
    names = set(tensor_names)
    for codec in CODECS.values():
        if names == set(codec.tensor_names):
            return codec
    raise FormatError(
        f"tensors {sorted(names)} match no PLE table format; expected one of "
        + "; ".join(f"{c.name}: {list(c.tensor_names)}" for c in CODECS.values())
    )


def checkpoint_format(row_dtype: np.dtype | str) -> Codec:
    """The codec of a checkpoint table whose rows tensor (:data:`CHECKPOINT_ROWS`) has this dtype.

    The row dtypes of the checkpoint spellings differ, so the rows alone tell the format; the
    other tensors are then checked against ``codec.checkpoint``.

    Raises:
        FormatError: no format stores its checkpoint rows in this dtype.
    """
    dtype = np.dtype(row_dtype)
    for codec in CODECS.values():
        if codec.checkpoint is not None and codec.checkpoint.rows.dtype == dtype:
            return codec
    raise FormatError(
        f"a PLE table's rows are never {dtype_name(dtype)}; the checkpoint formats are "
        + "; ".join(f"{c.name}: {c.checkpoint.describe()}" for c in CODECS.values() if c.checkpoint)
    )


def quantize(fmt: str, rows: np.ndarray) -> dict[str, np.ndarray]:
    """float32 [n, width] -> the tensors of format ``fmt``."""
    return get_codec(fmt).quantize(rows)


def dequantize(fmt: str, tensors: Mapping[str, np.ndarray]) -> np.ndarray:
    """The tensors of format ``fmt`` for ``n`` rows -> float32 [n, width]."""
    return get_codec(fmt).dequantize(tensors)


#: Stored float dtypes -> (bit mask, bits under it) of their NaN/inf encodings (e4m3fn has no
#: infinities; its NaN is every exponent and mantissa bit set).
_NON_FINITE_BITS = {
    E4M3: (0x7F, 0x7F),
    BF16: (0x7F80, 0x7F80),
    F16: (0x7C00, 0x7C00),
    F32: (0x7F800000, 0x7F800000),
}


def stored_non_finite(arr: np.ndarray) -> np.ndarray:
    """bool [same shape]: which stored values are NaN or inf, read from the bits (no float copy).

    Integer tensors (packed codes) are never non-finite.
    """
    arr = np.asarray(arr)
    bits = _NON_FINITE_BITS.get(arr.dtype)
    if bits is None:
        return np.zeros(arr.shape, dtype=bool)
    mask, value = bits
    return (arr.view(f"u{arr.dtype.itemsize}") & mask) == value


def rel_rmse(reference: np.ndarray, approx: np.ndarray) -> float:
    """``sqrt(sum((approx - ref)^2) / sum(ref^2))`` in float64; 0.0 for an all-zero reference."""
    ref = np.asarray(reference, dtype=np.float64)
    diff = np.asarray(approx, dtype=np.float64) - ref
    denom = float((ref * ref).sum())
    return float(np.sqrt((diff * diff).sum() / denom)) if denom > 0 else 0.0

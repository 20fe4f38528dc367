"""The format contract: golden code tables, reference pairs, declared tensors, codecs vs float64."""


import ml_dtypes
import numpy as np
import pytest

from flashnext.errors import FormatError
from flashnext.ple import formats as F
from flashnext.synthetic import embedding_rows

from .reference import E2M1, card_tensors, dequant64, nibbles

FORMATS = ["bf16", "fp8", "int4", "nvfp4"]


# -- golden tables, written from the card ---------------------------------------------------

# Every stored tensor at width 160 for n rows: name -> (dtype, shape).
CARD = {
    "bf16": {"weight": (ml_dtypes.bfloat16, ("n", 160))},
    "fp8": {
        "weight_fp8": (ml_dtypes.float8_e4m3fn, ("n", 160)),
        "weight_scale": (np.float32, ("n",)),
    },
    "int4": {"weight_i4": (np.uint8, ("n", 80)), "weight_scale": (np.float16, ("n", 10))},
    "nvfp4": {
        "weight_e2m1": (np.uint8, ("n", 80)),
        "weight_scale": (ml_dtypes.float8_e4m3fn, ("n", 10)),
        "weight_scale_2": (np.float32, ()),
    },
}
# How a Hugging Face checkpoint spells each format (FACTS.md): per-row names, then global scalars.
CHECKPOINT = {
    "bf16": ({"weight": (ml_dtypes.bfloat16, ("n", 160))}, {}),
    "fp8": ({"weight": (ml_dtypes.float8_e4m3fn, ("n", 160))}, {"weight_scale": np.float32}),
    "nvfp4": (
        {"weight": (np.uint8, ("n", 80)), "weight_scale": (ml_dtypes.float8_e4m3fn, ("n", 10))},
        {"weight_scale_2": np.float32},
    ),
}


def _shape(shape, n):
    return tuple(n if d == "n" else d for d in shape)


@pytest.mark.parametrize("fmt", FORMATS)
def test_declared_tensors_match_the_card(fmt):
    codec = F.get_codec(fmt)
    assert codec.tensor_names == tuple(CARD[fmt])
    for spec in codec.specs:
        dtype, shape = CARD[fmt][spec.name]
        assert spec.dtype == np.dtype(dtype)
        assert spec.shape(37, 160) == _shape(shape, 37)
        assert spec.per_row == (shape != ())
        if len(shape) == 2:
            assert spec.cols(160) == shape[1] and spec.width_of(shape[1]) == 160
    assert codec.width_of((37, CARD[fmt][codec.rows_spec.name][1][1])) == 160
    assert codec.group == {"bf16": None, "fp8": None, "int4": 16, "nvfp4": 16}[fmt]
    assert codec.width_multiple == {"bf16": 1, "fp8": 1, "int4": 16, "nvfp4": 16}[fmt]
    pad = {s.name: s.pad for s in codec.specs}
    assert pad == {n: (0x88 if n == "weight_i4" else 0) for n in CARD[fmt]}


@pytest.mark.parametrize("fmt", FORMATS)
def test_checkpoint_spelling(fmt):
    codec = F.get_codec(fmt)
    if fmt not in CHECKPOINT:
        assert codec.checkpoint is None and fmt not in F.CHECKPOINT_FORMATS
        with pytest.raises(FormatError, match="checkpoints do not store"):
            codec.from_checkpoint({}, {})
        return
    per_row, scalars = CHECKPOINT[fmt]
    spelling = codec.checkpoint
    assert spelling.rows.name == F.CHECKPOINT_ROWS == "weight"
    assert [t.name for t in spelling.per_row] == list(per_row)
    assert [t.name for t in spelling.table_scalars] == list(scalars)
    for t in spelling.per_row:
        dtype, shape = per_row[t.name]
        assert t.dtype == np.dtype(dtype) and t.shape(37, 160) == _shape(shape, 37)
        assert t.feeds in codec.tensor_names
    for t in spelling.table_scalars:
        assert t.dtype == np.dtype(scalars[t.name]) and t.shape(37, 160) == ()
        assert t.feeds in codec.tensor_names
    assert F.checkpoint_format(spelling.rows.dtype) is codec


def test_checkpoint_formats_and_names():
    assert F.CHECKPOINT_FORMATS == ("bf16", "fp8", "nvfp4")
    assert F.CHECKPOINT_PER_ROW_NAMES == ("weight", "weight_scale")
    assert F.CHECKPOINT_SCALAR_NAMES == ("weight_scale", "weight_scale_2")
    assert F.get_codec("nvfp4").checkpoint.describe() == (
        "weight U8 [n, w/2] + weight_scale F8_E4M3 [n, w/16] + weight_scale_2 F32 []"
    )
    with pytest.raises(FormatError, match=r"rows are never F32; .*nvfp4: weight U8 \[n, w/2\]"):
        F.checkpoint_format(np.float32)


def test_from_checkpoint_matches_float64(rng):
    """Checkpoint tensors -> codec tensors -> float32 rows, against the formulas in float64."""
    n = int(rng.integers(1, 50))
    fp8 = rng.integers(0, 0x7E, (n, 160), dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
    scale = float(np.float32(rng.uniform(1e-4, 1e-3)))
    got = F.get_codec("fp8").dequantize(
        F.get_codec("fp8").from_checkpoint({"weight": fp8}, {"weight_scale": scale})
    )
    np.testing.assert_array_equal(got, (fp8.astype(np.float64) * scale).astype(np.float32))
    codes = rng.integers(0, 256, (n, 80), dtype=np.uint8)
    bscale = rng.integers(0x08, 0x70, (n, 10), dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
    s2 = float(np.float32(rng.uniform(1e-4, 1e-3)))
    nv = F.get_codec("nvfp4")
    got = nv.dequantize(
        nv.from_checkpoint({"weight": codes, "weight_scale": bscale}, {"weight_scale_2": s2})
    )
    ref = dequant64("nvfp4", {"weight_e2m1": codes, "weight_scale": bscale, "weight_scale_2": s2})
    np.testing.assert_array_equal(got, ref.astype(np.float32))
    with pytest.raises(FormatError, match="checkpoint tensor 'weight_scale_2' missing"):
        nv.from_checkpoint({"weight": codes, "weight_scale": bscale}, {})


def test_golden_e2m1_decode_every_code():
    codes = np.arange(16, dtype=np.uint8)
    got = F.e2m1_decode(codes)
    assert got.dtype == np.float32
    assert got.tolist() == [E2M1[c] for c in range(16)]
    assert got.tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    assert np.signbit(got[8]) and not np.signbit(got[0])
    assert F.E2M1_MAX == 6.0


# value -> code: every grid point, every tie, saturation, signed zero.
E2M1_ENCODE_GOLDEN = [
    *((v, c) for c, v in E2M1.items()),
    (0.25, 0),
    (0.75, 2),
    (1.25, 3),
    (1.75, 4),
    (2.5, 5),
    (3.5, 6),
    (5.0, 7),  # ties
    (0.2, 0),
    (0.3, 1),
    (1.2, 2),
    (1.3, 3),
    (4.9, 6),
    (5.1, 7),  # either side of a tie
    (7.0, 7),
    (1e30, 7),
    (-1e30, 15),
    (-0.25, 8),
    (-0.1, 8),
    (-1.25, 11),
    (-5.0, 15),
]


@pytest.mark.parametrize(("value", "code"), E2M1_ENCODE_GOLDEN)
def test_golden_e2m1_encode(value, code):
    got = F.e2m1_encode(np.array([value], dtype=np.float32))
    assert got.dtype == np.uint8 and got.tolist() == [code]


def test_e2m1_round_trips_and_is_nearest(rng):
    codes = np.arange(16, dtype=np.uint8)
    assert F.e2m1_encode(F.e2m1_decode(codes)).tolist() == codes.tolist()
    y = np.concatenate([rng.uniform(-8, 8, 20000), rng.uniform(-1.5, 1.5, 5000)]).astype(np.float32)
    q = F.e2m1_decode(F.e2m1_encode(y)).astype(np.float64)
    grid = np.unique(F.E2M1_CODES).astype(np.float64)
    nearest = np.abs(y[:, None].astype(np.float64) - grid[None, :]).min(axis=1)
    assert np.all(np.abs(q - y) == nearest)
    # the codec's search rounds exactly as the public pair does
    codec = F.get_codec("nvfp4")
    np.testing.assert_array_equal(codec._codes(codec._round(y)), F.e2m1_encode(y))
    with pytest.raises(FormatError, match="finite"):
        F.e2m1_encode(np.array([1.0, np.nan], np.float32))
    with pytest.raises(FormatError, match=r"codes must be 0\.\.15, found 16"):
        F.e2m1_decode(np.array([3, 16], np.uint8))


def test_golden_pack_nibbles_low_first():
    codes = np.array([[0x1, 0x2, 0xF, 0x0], [0x8, 0x8, 0x0, 0xF]], dtype=np.uint8)
    assert F.pack_nibbles(codes).tolist() == [[0x21, 0x0F], [0x88, 0xF0]]
    every = np.arange(256, dtype=np.uint8).reshape(1, 256)
    unpacked = F.unpack_nibbles(every)
    assert unpacked.shape == (1, 512) and unpacked.dtype == np.uint8
    assert unpacked[0, 0::2].tolist() == [b & 0xF for b in range(256)]
    assert unpacked[0, 1::2].tolist() == [b >> 4 for b in range(256)]
    np.testing.assert_array_equal(unpacked, nibbles(every))  # the independent reference


def test_nibbles_round_trip_and_refuse_bad_input(rng):
    codes = rng.integers(0, 16, (3, 5, 32), dtype=np.uint8)
    packed = F.pack_nibbles(codes)
    assert packed.shape == (3, 5, 16)
    np.testing.assert_array_equal(F.unpack_nibbles(packed), codes)
    b = rng.integers(0, 256, (7, 80), dtype=np.uint8)
    np.testing.assert_array_equal(F.pack_nibbles(F.unpack_nibbles(b)), b)
    with pytest.raises(FormatError, match="last axis must be even"):
        F.pack_nibbles(np.zeros((2, 3), np.uint8))
    with pytest.raises(FormatError, match="found 16"):
        F.pack_nibbles(np.array([[1, 16]], np.int64))
    with pytest.raises(FormatError, match="found -1"):
        F.pack_nibbles(np.array([[-1, 2]], np.int64))
    with pytest.raises(FormatError, match="integers"):
        F.pack_nibbles(np.zeros((1, 2), np.float32))
    with pytest.raises(FormatError, match=r"expected uint8 \[\.\.\., w/2\]"):
        F.unpack_nibbles(np.zeros((1, 2), np.int16))


# -- codecs ---------------------------------------------------------------------------------


def test_golden_e2m1_codes_through_the_codec():
    # every code of the card's table, through a one-row nvfp4 tensor with unit scales
    codes = np.arange(16, dtype=np.uint8)
    row = np.concatenate([F.pack_nibbles(codes)] * 10).reshape(1, 80)
    t = {
        "weight_e2m1": row,
        "weight_scale": np.ones((1, 10), dtype=ml_dtypes.float8_e4m3fn),
        "weight_scale_2": np.array(1.0, dtype=np.float32),
    }
    got = F.dequantize("nvfp4", t)[0, :16]
    assert got.tolist() == [E2M1[c] for c in range(16)]


@pytest.mark.parametrize(
    ("code", "value"),
    [(0x00, 0.0), (0x38, 1.0), (0xB8, -1.0), (0x7E, 448.0), (0x01, 2.0**-9), (0x08, 2.0**-6)],
)
def test_golden_e4m3_codes(code, value):
    q = np.full((1, 160), code, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
    got = F.dequantize("fp8", {"weight_fp8": q, "weight_scale": np.ones(1, np.float32)})
    assert np.all(got == value)
    assert float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max) == F.E4M3_MAX


def test_golden_int4_nibbles_low_first():
    row = np.zeros((1, 80), dtype=np.uint8)
    row[0, 0] = 0x2F  # column 0 = 0xF -> +7, column 1 = 0x2 -> -6
    row[0, 1] = 0x80  # column 2 = 0x0 -> -8, column 3 = 0x8 -> 0
    t = {"weight_i4": row, "weight_scale": np.ones((1, 10), np.float16)}
    assert F.dequantize("int4", t)[0, :4].tolist() == [7.0, -6.0, -8.0, 0.0]


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_equals_float64_reference(fmt, rng):
    t = card_tensors(fmt, int(rng.integers(1, 300)), rng)
    got = F.dequantize(fmt, t)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, dequant64(fmt, t).astype(np.float32))
    # dequantize_into a block of a larger buffer gives the same rows
    n = got.shape[0]
    buf = np.full((n + 4, 160), np.nan, dtype=np.float32)
    F.get_codec(fmt).dequantize_into(t, buf[2 : 2 + n])
    np.testing.assert_array_equal(buf[2 : 2 + n], got)
    assert np.isnan(buf[:2]).all() and np.isnan(buf[2 + n :]).all()


@pytest.mark.parametrize("fmt", FORMATS)
def test_padding_values_dequantize_to_zero(fmt):
    codec = F.get_codec(fmt)
    t = {s.name: np.full(s.shape(3, 160), s.pad, dtype=s.dtype) for s in codec.specs}
    d = codec.dequantize(t)
    assert d.shape == (3, 160) and np.all(d == 0) and not np.signbit(d).any()


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_layout_and_error(fmt, rng):
    x = embedding_rows(2000, 160, rng)
    t = F.quantize(fmt, x)
    codec = F.get_codec(fmt)
    assert set(t) == set(codec.tensor_names)
    for spec in codec.specs:
        assert t[spec.name].dtype == spec.dtype
        assert t[spec.name].shape == spec.shape(2000, 160)
    err = F.rel_rmse(x, dequant64(fmt, t))
    bound = {"bf16": 0.005, "fp8": 0.04, "int4": 0.13, "nvfp4": 0.12}[fmt]
    assert 0 < err < bound
    assert codec.bytes_per_row(160) == {"bf16": 320, "fp8": 164, "int4": 100, "nvfp4": 90}[fmt]


@pytest.mark.parametrize("fmt", ["int4", "nvfp4"])
def test_clip_search_beats_absmax(fmt, monkeypatch, rng):
    x = embedding_rows(3000, 160, rng)
    searched = F.rel_rmse(x, F.dequantize(fmt, F.quantize(fmt, x)))
    monkeypatch.setattr(F, "CLIP_RATIOS", (1.0,))
    absmax = F.rel_rmse(x, F.dequantize(fmt, F.quantize(fmt, x)))
    assert searched < absmax * 0.97


def test_nvfp4_scales_fit_e4m3(rng):
    x = embedding_rows(500, 160, rng) * 1e4
    t = F.quantize("nvfp4", x)
    assert np.all(np.isfinite(t["weight_scale"].astype(np.float32)))
    assert t["weight_scale"].astype(np.float32).max() <= 448
    # the per-shard scale puts the largest group scale at e4m3's top: absmax / (6 * 448)
    amax = float(np.abs(x).max())
    assert float(t["weight_scale_2"]) == float(np.float32(amax / (6.0 * 448.0)))


def test_zero_rows_stay_zero(rng):
    x = np.zeros((4, 160), np.float32)
    x[1] = rng.standard_normal(160)
    for fmt in FORMATS:
        d = F.dequantize(fmt, F.quantize(fmt, x))
        assert np.all(d[[0, 2, 3]] == 0) and np.abs(d[1]).sum() > 0


def test_bad_inputs():
    with pytest.raises(FormatError, match="row 3 column 5 is nan"):
        x = np.ones((4, 160), np.float32)
        x[3, 5] = np.nan
        F.quantize("int4", x)
    with pytest.raises(FormatError, match="width 100 is not a positive multiple of 16"):
        F.quantize("nvfp4", np.ones((2, 100), np.float32))
    with pytest.raises(FormatError, match="bf16: width 0 is not a positive multiple of 1"):
        F.get_codec("bf16").check_width(0)
    F.get_codec("fp8").check_width(161)  # fp8 and bf16 take any positive width
    with pytest.raises(FormatError, match="unknown PLE table format 'int8'"):
        F.get_codec("int8")
    with pytest.raises(FormatError, match="match no PLE table format"):
        F.detect_format(["weight_i4"])
    assert F.detect_format(["weight_scale", "weight_i4"]).name == "int4"
    with pytest.raises(FormatError, match="nvfp4: no tensor 'weight'"):
        F.get_codec("nvfp4").spec("weight")


@pytest.mark.parametrize("dtype", [F.E4M3, F.BF16, F.F16, F.F32])
def test_stored_non_finite_reads_the_bits(rng, dtype):
    """Every bit pattern of the 1- and 2-byte dtypes, random float32: the mask equals
    isfinite of the values, without a float copy."""
    if dtype.itemsize <= 2:
        values = np.arange(1 << (8 * dtype.itemsize), dtype=f"u{dtype.itemsize}").view(dtype)
    else:
        values = rng.standard_normal(4096).astype(np.float32)
        values[rng.integers(0, 4096, 5)] = [np.nan, np.inf, -np.inf, np.nan, 3e38]
    want = ~np.isfinite(values.astype(np.float32))
    np.testing.assert_array_equal(F.stored_non_finite(values), want)
    assert F.stored_non_finite(values.reshape(-1, 2 if dtype.itemsize <= 2 else 4)).shape[1] > 1
    assert not F.stored_non_finite(np.full(7, 0xFF, dtype=np.uint8)).any()

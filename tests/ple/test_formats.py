import ml_dtypes
import numpy as np
import pytest

from flashnext.errors import FormatError
from flashnext.ple import formats as F
from flashnext.synthetic import embedding_rows

from .reference import E2M1, card_tensors, dequant64

FORMATS = ["bf16", "fp8", "int4", "nvfp4"]


def test_golden_e2m1_codes():
    # every code of the card's table, through a one-row nvfp4 tensor with unit scales
    codes = np.arange(16, dtype=np.uint8)
    packed = (codes[0::2] | (codes[1::2] << 4)).astype(np.uint8)
    row = np.concatenate([packed] * 10).reshape(1, 80)
    t = {
        "weight_e2m1": row,
        "weight_scale": np.ones((1, 10), dtype=ml_dtypes.float8_e4m3fn),
        "weight_scale_2": np.array(1.0, dtype=np.float32),
    }
    got = F.dequantize("nvfp4", t)[0, :16]
    assert got.tolist() == [E2M1[c] for c in range(16)]
    assert got.tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]


@pytest.mark.parametrize(
    ("code", "value"),
    [(0x00, 0.0), (0x38, 1.0), (0xB8, -1.0), (0x7E, 448.0), (0x01, 2.0**-9), (0x08, 2.0**-6)],
)
def test_golden_e4m3_codes(code, value):
    q = np.full((1, 160), code, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
    got = F.dequantize("fp8", {"weight_fp8": q, "weight_scale": np.ones(1, np.float32)})
    assert np.all(got == value)


def test_golden_int4_nibbles_low_first():
    row = np.zeros((1, 80), dtype=np.uint8)
    row[0, 0] = 0x2F  # column 0 = 0xF -> +7, column 1 = 0x2 -> -6
    row[0, 1] = 0x80  # column 2 = 0x0 -> -8, column 3 = 0x8 -> 0
    t = {"weight_i4": row, "weight_scale": np.ones((1, 10), np.float16)}
    assert F.dequantize("int4", t)[0, :4].tolist() == [7.0, -6.0, -8.0, 0.0]


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_equals_float64_reference(fmt):
    rng = np.random.default_rng()
    t = card_tensors(fmt, int(rng.integers(1, 300)), rng)
    got = F.dequantize(fmt, t)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, dequant64(fmt, t).astype(np.float32))


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_layout_and_error(fmt):
    rng = np.random.default_rng()
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
def test_clip_search_beats_absmax(fmt, monkeypatch):
    rng = np.random.default_rng()
    x = embedding_rows(3000, 160, rng)
    searched = F.rel_rmse(x, F.dequantize(fmt, F.quantize(fmt, x)))
    monkeypatch.setattr(F, "CLIP_RATIOS", (1.0,))
    absmax = F.rel_rmse(x, F.dequantize(fmt, F.quantize(fmt, x)))
    assert searched < absmax * 0.97


def test_nvfp4_scales_fit_e4m3():
    rng = np.random.default_rng()
    x = embedding_rows(500, 160, rng) * 1e4
    t = F.quantize("nvfp4", x)
    assert np.all(np.isfinite(t["weight_scale"].astype(np.float32)))
    assert t["weight_scale"].astype(np.float32).max() <= 448


def test_zero_rows_stay_zero():
    x = np.zeros((4, 160), np.float32)
    x[1] = np.random.default_rng().standard_normal(160)
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
    with pytest.raises(FormatError, match="unknown PLE table format 'int8'"):
        F.get_codec("int8")
    with pytest.raises(FormatError, match="match no PLE table format"):
        F.detect_format(["weight_i4"])
    assert F.detect_format(["weight_scale", "weight_i4"]).name == "int4"


def test_e2m1_rounding_is_nearest_and_codes_round_trip():
    codec = F.get_codec("nvfp4")
    rng = np.random.default_rng()
    y = np.concatenate([rng.uniform(-8, 8, 20000), F.E2M1_CODES, [0.24, 0.26, 0.74, 5.01, 1e-9]])
    y = y.astype(np.float32)
    q = codec._round(y)
    grid = np.unique(F.E2M1_CODES)
    nearest = np.abs(y[:, None].astype(np.float64) - grid[None, :]).min(axis=1)
    assert np.all(np.abs(q.astype(np.float64) - y) <= nearest + 1e-7)
    assert np.array_equal(F.E2M1_CODES[codec._codes(q)], q)

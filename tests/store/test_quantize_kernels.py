"""The compiled quantizer (store/quantize_kernels.py) against the numpy codecs, byte for byte.

Fresh random rows every run (the ``rng`` fixture prints its seed): several distributions over
~30 binary decades, all-zero rows, rows of tiny and huge values, signed zeros, exact ties of
the roundings, every clip ratio, NaN/inf handling.
"""

from __future__ import annotations

import json

import ml_dtypes
import numba
import numpy as np
import pytest

from flashnext.checkpoint.sources import SidecarSource
from flashnext.errors import FormatError
from flashnext.ple import formats as F
from flashnext.store import quantize_kernels as K
from flashnext.store.destination import write_sidecar
from flashnext.store.quantize import quantize_table


def _rows(rng: np.random.Generator, n: int = 96, width: int = 160) -> np.ndarray:
    """Gaussian, uniform, heavy-tailed and outlier groups, each row at its own magnitude."""
    kinds = [
        rng.standard_normal((n, width)),
        rng.uniform(-1, 1, (n, width)),
        np.clip(rng.standard_cauchy((n, width)), -50, 50),
        rng.laplace(size=(n, width)),
    ]
    outliers = rng.uniform(-0.6, 0.6, (n, width))
    outliers[:, :: F.GROUP] = 1.0
    x = np.concatenate([*kinds, outliers]).astype(np.float32)
    x *= np.exp2(rng.integers(-24, 8, (len(x), 1))).astype(np.float32)
    x[0] = 0.0
    x[1] = -0.0
    x[2, ::2] = -0.0
    x[3] = np.float32(rng.uniform(1e-38, 1e-36))  # float32 subnormals, one group scale
    x[4, :16] = np.float32(2.0**-149)  # the smallest subnormal
    x[5] = rng.standard_normal(width).astype(np.float32) * np.float32(1e4)
    return rng.permutation(x)


def _same(codec: F.Codec, x: np.ndarray, scalars=None) -> None:
    want = codec.quantize(x, scalars)
    got, sq_err, sq_ref = K.quantize_block(codec, x, scalars)
    assert set(got) == {s.name for s in codec.row_specs}
    for name, arr in got.items():
        assert arr.dtype == want[name].dtype and arr.shape == want[name].shape, name
        diff = arr.view(np.uint8) != want[name].view(np.uint8)
        assert not diff.any(), (codec.name, name, np.argwhere(diff)[:5])
    # the sums are those of the numpy path up to summation order
    deq = codec.dequantize({**want, **{k: np.float32(v) for k, v in (scalars or {}).items()}})
    diff = deq.astype(np.float64) - x
    assert sq_err == pytest.approx(float((diff * diff).sum()), rel=1e-9, abs=1e-300)
    assert sq_ref == pytest.approx(float(np.square(x, dtype=np.float64).sum()), rel=1e-9)


def _scalars(codec: F.Codec, x: np.ndarray):
    return codec.shard_scalars(float(np.abs(x).max())) or None


def test_the_compiled_path_is_used_here():
    # CI's numpy sums like this machine's; if this fails, the quantizer silently runs numpy
    assert K.compiled_matches_reference()


def test_the_self_check_verdict_is_cached_per_key(tmp_path, monkeypatch):
    """A verdict is stored per key; a changed key runs the self-check again; a stored "differs"
    is honoured; a corrupt or foreign entry is ignored and replaced."""
    runs: list[bool] = []
    real = K._self_check
    monkeypatch.setattr(K, "_self_check", lambda: runs.append(real()) or runs[-1])
    key = K.verdict_key()
    assert key["numba"] == numba.__version__ and "+" in key["cpu_features"]
    assert K.cached_verdict(key, tmp_path) is True and runs == [True]
    (entry,) = tmp_path.iterdir()
    assert json.loads(entry.read_text()) == {"key": key, "matches": True}
    assert K.cached_verdict(key, tmp_path) is True and len(runs) == 1
    for field in ("sources", "numba", "numpy", "cpu_features", "NUMBA_CPU_NAME"):
        assert K.cached_verdict({**key, field: key[field] + "-other"}, tmp_path) is True
    assert len(runs) == 6 and len(list(tmp_path.iterdir())) == 6
    entry.write_text(json.dumps({"key": key, "matches": False}))
    assert K.cached_verdict(key, tmp_path) is False and len(runs) == 6
    corrupt = ["", "{half", "[]", json.dumps({"key": key, "matches": "yes"}),
               json.dumps({"key": {**key, "numba": "0"}, "matches": False})]  # fmt: skip
    for n, text in enumerate(corrupt, start=7):
        entry.write_text(text)
        assert K.cached_verdict(key, tmp_path) is True and len(runs) == n, text
        assert json.loads(entry.read_text()) == {"key": key, "matches": True}
    entry.write_bytes(b"\xff\xfe\x00")
    assert K.cached_verdict(key, tmp_path) is True and len(runs) == 12


def test_the_verdict_key_names_the_environment_and_the_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("NUMBA_CPU_NAME", "generic")
    assert K.verdict_key()["NUMBA_CPU_NAME"] == "generic"
    monkeypatch.setenv(K.CACHE_DIR_ENV, str(tmp_path))
    assert K.verdict_dir() == tmp_path / "quantize-self-check"
    monkeypatch.delenv(K.CACHE_DIR_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert K.verdict_dir() == tmp_path / "xdg" / "flashnext" / "quantize-self-check"


@pytest.mark.parametrize("fmt", F.FORMATS)
def test_byte_identical_on_fresh_random_rows(rng, fmt):
    codec = F.get_codec(fmt)
    x = _rows(rng)
    _same(codec, x, _scalars(codec, x))
    # another shard scale than the block's own absmax (nvfp4 blocks of a larger shard)
    if codec.scalar_specs:
        _same(codec, x, {"weight_scale_2": float(np.float32(rng.uniform(1e-9, 1e-3)))})


@pytest.mark.parametrize("fmt", F.FORMATS)
def test_row_sums_match_a_float64_reference(rng, fmt):
    """Each row's squared error, squared sum and non-zero count, from the kernel's own values,
    against the numpy codec's dequantized rows in float64 (nvfp4's tiny shard scale zeroes
    rows: the count must say so)."""
    codec = F.get_codec(fmt)
    x = _rows(rng)
    scalars = _scalars(codec, x)
    if codec.scalar_specs:
        scalars = {"weight_scale_2": float(np.float32(np.abs(x).max() / 2.0**-20))}
    sums = np.full((len(x), 3), np.nan)
    q, err, ref = K.quantize_block(codec, x, scalars, row_sums=sums)
    restored = codec.dequantize(
        {**q, **{k: np.array(v, np.float32) for k, v in (scalars or {}).items()}}
    ).astype(np.float64)
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(sums[:, 0], ((restored - x64) ** 2).sum(axis=1), rtol=1e-12)
    np.testing.assert_allclose(sums[:, 1], (x64**2).sum(axis=1), rtol=1e-12)
    np.testing.assert_array_equal(sums[:, 2], (restored != 0).sum(axis=1))
    assert err == pytest.approx(sums[:, 0].sum(), rel=1e-12)
    assert ref == pytest.approx(sums[:, 1].sum(), rel=1e-12)
    if codec.scalar_specs:
        assert (sums[:, 2] == 0).sum() > (np.abs(x).max(axis=1) == 0).sum()  # rows zeroed


@pytest.mark.parametrize("fmt", ["int4", "nvfp4"])
@pytest.mark.parametrize("ratio", F.CLIP_RATIOS)
def test_every_clip_ratio_alone_gives_the_same_scales_and_codes(rng, monkeypatch, fmt, ratio):
    """Natural rows rarely pick 0.75 or 0.7; searching one ratio at a time checks each
    candidate's scale, rounding and codes on their own (both paths read CLIP_RATIOS)."""
    monkeypatch.setattr(F, "CLIP_RATIOS", (ratio,))
    codec = F.get_codec(fmt)
    x = _rows(rng, n=24)
    _same(codec, x, _scalars(codec, x))


@pytest.mark.parametrize("fmt", ["int4", "nvfp4"])
def test_ratios_in_another_order_still_match(rng, monkeypatch, fmt):
    """Ties and the first-wins rule: the search order is the reference's, whatever it is."""
    monkeypatch.setattr(F, "CLIP_RATIOS", tuple(rng.permutation(F.CLIP_RATIOS).tolist()))
    codec = F.get_codec(fmt)
    x = _rows(rng, n=24)
    _same(codec, x, _scalars(codec, x))


def test_winners_cover_the_usual_ratios(rng):
    """The random rows make the search choose among the ratios, not always absmax."""
    codec = F.get_codec("int4")
    x = _rows(rng)
    got, _, _ = K.quantize_block(codec, x)
    amax = np.abs(x.reshape(len(x), -1, F.GROUP)).max(axis=2)
    cands = np.stack([(amax * np.float32(r / 7)).astype(np.float16) for r in F.CLIP_RATIOS], -1)
    live = amax > 1e-3
    won = (cands == got["weight_scale"][..., None]).argmax(-1)[live]
    assert len(np.unique(won)) >= 5, np.bincount(won)


def test_tiny_shard_scale_takes_the_reference_nan_path(rng):
    """nvfp4 with a subnormal weight_scale_2: 1/s overflows, y is inf or NaN (0 * inf); the
    reference's rounding, clamping and codes of those are reproduced too."""
    codec = F.get_codec("nvfp4")
    x = (rng.standard_normal((8, 160)) * 1e-39).astype(np.float32)
    x[:, ::7] = 0.0
    _same(codec, x, _scalars(codec, x))


def test_huge_values_int4_limit_and_fp8_saturation(rng):
    int4 = F.get_codec("int4")
    x = rng.uniform(-1, 1, (4, 160)).astype(np.float32)
    x[:, 0] = np.float32(4.58e5)  # group scales near float16's largest, 65504
    _same(int4, x)
    x[2, 40] = np.float32(5e5)
    with pytest.raises(FormatError, match="exceeds float16's range"):
        K.quantize_block(int4, x)
    big = (rng.uniform(-1, 1, (4, 160)) * 3.4e38).astype(np.float32)
    for fmt in ("fp8", "bf16", "nvfp4"):
        codec = F.get_codec(fmt)
        _same(codec, big, _scalars(codec, big))


@pytest.mark.parametrize("fmt", F.FORMATS)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_rows_raise_the_reference_error(rng, fmt, bad):
    codec = F.get_codec(fmt)
    x = rng.standard_normal((6, 160)).astype(np.float32)
    x[4, 33] = bad
    with pytest.raises(FormatError, match=r"row 4 column 33 is -?(nan|inf)"):
        K.quantize_block(codec, x, {"weight_scale_2": 1.0})
    first = 4 * 160 + 33  # the scan stops at the first non-finite value
    assert K.block_absmax(x) == (float(np.abs(x.reshape(-1)[:first]).max()), first)


def test_bf16_ties_round_to_even(rng):
    """float32 values exactly halfway between two bf16 values, both parities, both signs."""
    hi = rng.integers(0, 0x7F7F, 4096, dtype=np.uint32) << 16
    bits = hi | np.uint32(0x8000)
    bits[::2] |= np.uint32(0x80000000)
    x = bits.view(np.float32).reshape(-1, 16)
    _same(F.get_codec("bf16"), x)


def _grid_and_midpoints(values: np.ndarray) -> np.ndarray:
    """Every value, every midpoint of neighbours, and the float32 on either side of each."""
    v = np.unique(values.astype(np.float64))
    mids = ((v[:-1] + v[1:]) / 2).astype(np.float32)
    pts = np.concatenate([v.astype(np.float32), mids])
    return np.concatenate(
        [pts, np.nextafter(pts, np.float32(np.inf)), np.nextafter(pts, np.float32(0))]
    )


@pytest.mark.parametrize(
    ("dtype", "to_bits", "top", "bits_dtype"),
    [
        (np.dtype(np.float16), K._f16_bits, 65504.0, np.uint16),
        (F.E4M3, K._e4m3_bits, F.E4M3_MAX, np.uint8),
    ],
)
def test_scale_rounding_matches_numpy_at_every_tie(dtype, to_bits, top, bits_dtype):
    """The bit-level float32 -> float16 / e4m3fn rounding at every value and midpoint."""
    values = np.arange(1 << (8 * dtype.itemsize), dtype=bits_dtype).view(dtype).astype(np.float64)
    values = values[np.isfinite(values) & ~np.signbit(values) & (values <= top)]
    pts = _grid_and_midpoints(values)
    pts = pts[(pts >= 0) & (pts <= np.float32(top))]
    want = pts.astype(dtype).view(bits_dtype)
    got = np.array([to_bits(p) for p in pts], dtype=np.int64)
    np.testing.assert_array_equal(got, want.astype(np.int64))


def test_quantize_table_engines_write_the_same_shards(tmp_path, rng):
    x = _rows(rng, n=40)
    write_sidecar(tmp_path / "src", "bf16", x, 64)
    for fmt in F.FORMATS:
        a = quantize_table(SidecarSource(tmp_path / "src"), tmp_path / f"a-{fmt}", fmt, 50)
        b = quantize_table(
            SidecarSource(tmp_path / "src"), tmp_path / f"b-{fmt}", fmt, 50, engine="numpy"
        )
        for shard in a.sidecar.shards:
            other = tmp_path / f"b-{fmt}" / shard.path.name
            assert shard.path.read_bytes() == other.read_bytes(), (fmt, shard.path.name)
        assert a.rel_rmse == pytest.approx(b.rel_rmse, rel=1e-9)


def test_probe_block_is_hard_enough():
    """The self-check's block holds the edge rows it claims (zero, tiny, signed zeros)."""
    x = K._probe_block()
    assert not x[0].any() and np.signbit(x[2, ::3]).all() and x[1, 0] == np.float32(1e-30)
    assert ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max == F.E4M3_MAX

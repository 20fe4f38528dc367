"""The fused kernels against the numpy reference on the edges the embedding fixture never hits:
widths that are not a multiple of 16, NaN and infinite stored values, ``out=`` and id shapes."""

import ml_dtypes
import numpy as np
import pytest

from flashnext.host import open_table
from flashnext.ple.formats import BF16, E4M3, F16
from flashnext.store.destination import SidecarWriter


def _stored(fmt: str, rows: int, width: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Random stored tensors with some NaN / infinite values among them."""
    if fmt == "fp8":
        codes = rng.integers(0, 256, size=(rows, width), dtype=np.uint8)  # 0x7F, 0xFF: NaN
        return {
            "weight_fp8": codes.view(E4M3),
            "weight_scale": rng.standard_normal(rows, dtype=np.float32),
        }
    if fmt == "bf16":
        bits = rng.integers(0, 1 << 16, size=(rows, width), dtype=np.uint16)
        bits[rng.random(bits.shape) < 0.05] |= 0x7F80  # NaN or inf
        nan = (bits & 0x7F80) == 0x7F80
        bits[nan] |= 0x0040  # quiet NaNs (a signalling one would be quieted by the reference)
        return {"weight": bits.view(BF16)}
    if fmt == "int4":
        scale = (rng.random((rows, width // 16), dtype=np.float32) * 0.02).astype(F16)
        scale.view(np.uint16)[rng.random(scale.shape) < 0.05] = 0x7C00  # +inf
        scale.view(np.uint16)[rng.random(scale.shape) < 0.05] = 0x7E01  # NaN
        return {
            "weight_i4": rng.integers(0, 256, size=(rows, width // 2), dtype=np.uint8),
            "weight_scale": scale,
        }
    raise ValueError(fmt)


@pytest.mark.parametrize(("fmt", "width"), [("fp8", 40), ("bf16", 40), ("bf16", 7), ("int4", 48)])
def test_odd_widths_and_nonfinite_values_match_reference(fmt, width, tmp_path, rng):
    rows, shard_rows = 150, 50
    writer = SidecarWriter(tmp_path, fmt, width, rows, shard_rows)
    for i in range(writer.num_shards):
        start, end = writer.shard_rows(i)
        writer.write_shard(i, _stored(fmt, end - start, width, rng))
    writer.finish()
    table = open_table(tmp_path, "mmap", hot_tier=rng.choice(rows, size=20, replace=False))
    ids = rng.integers(-1, rows, size=(5, 60))
    with np.errstate(invalid="ignore"):  # inf scale x 0 is NaN, on purpose
        ref = table.reference_lookup(ids)
    assert np.isnan(ref).any()  # the edge is really exercised
    got = table.lookup(ids)
    np.testing.assert_array_equal(got.view(np.uint32), ref.view(np.uint32))
    bf = table.lookup(ids, dtype=ml_dtypes.bfloat16)
    np.testing.assert_array_equal(bf.view(np.uint16), ref.astype(BF16).view(np.uint16))


def test_out_is_filled_in_place_and_checked(rng, tmp_path):
    x = rng.standard_normal((300, 160), dtype=np.float32)
    from flashnext.store import write_sidecar

    write_sidecar(tmp_path, "nvfp4", x, 100)
    table = open_table(tmp_path)
    ids = rng.integers(-1, 300, size=(2, 3, 4))
    out = np.full((2, 3, 4, 160), np.nan, np.float32)
    assert table.lookup(ids, out=out) is out
    np.testing.assert_array_equal(out, table.reference_lookup(ids))
    bf = np.empty((2, 3, 4, 160), ml_dtypes.bfloat16)
    assert table.lookup(ids, out=bf, dtype=ml_dtypes.bfloat16) is bf
    np.testing.assert_array_equal(bf.view(np.uint16), out.astype(BF16).view(np.uint16))
    np.testing.assert_array_equal(table.lookup(ids, dtype="float32"), out)
    scalar = table.lookup(np.int64(5))
    assert scalar.shape == (160,)
    np.testing.assert_array_equal(scalar, table.lookup([5])[0])
    with pytest.raises(ValueError, match=r"out must be a C-contiguous float32 array of shape"):
        table.lookup(ids, out=np.empty((2, 3, 4, 161), np.float32))
    with pytest.raises(ValueError, match="lookup dtype must be float32 or bfloat16, found float64"):
        table.lookup(ids, dtype=np.float64)
    raw = table.gather_raw(ids)
    assert table.gather_raw(ids, out=raw) is not None
    with pytest.raises(ValueError, match=r"out\['weight_scale'\] must be a C-contiguous"):
        table.gather_raw(ids, out={**raw, "weight_scale": raw["weight_scale"][:1]})


def test_hot_rows_are_served_from_the_hot_copy(tmp_path, rng):
    from flashnext.store import write_sidecar

    rows = 3000  # several 512-row blocks of the hot index, 30 shards
    write_sidecar(tmp_path, "int4", rng.standard_normal((rows, 160), dtype=np.float32), 100)
    hot = rng.choice(rows, size=300, replace=False)
    start, end = 250, 2900
    table = open_table(tmp_path, "mmap", row_range=(start, end), hot_tier=hot)
    in_range = np.sort(hot[(hot >= start) & (hot < end)])
    assert table.hot_rows == in_range.size
    # Fault injected: each row of the hot copy is overwritten with its own row id, so a row
    # served from the copy shows where the index placed it (the files keep their bytes).
    codes = table._state.keep[1]["weight_i4"]
    codes[:, :8] = in_range.astype("<i8").view(np.uint8).reshape(-1, 8)
    ids = np.concatenate([in_range, rng.integers(-1, rows, size=4000)])
    got = table.gather_raw(ids)["weight_i4"]
    is_hot = np.isin(ids, in_range)
    np.testing.assert_array_equal(got[is_hot, :8].copy().view("<i8").reshape(-1), ids[is_hot])
    want = table.reference_gather_raw(ids)["weight_i4"]
    np.testing.assert_array_equal(got[~is_hot], want[~is_hot])


@pytest.mark.parametrize("residency", ["mmap", "resident"])
def test_every_fp8_code_decodes_as_the_format_table(residency, tmp_path, rng):
    codes = rng.permutation(256).astype(np.uint8).reshape(8, 32)  # every code once
    scale = np.ones(8, np.float32)
    scale[1::2] = rng.standard_normal(4, dtype=np.float32)
    writer = SidecarWriter(tmp_path, "fp8", 32, 8, 8)
    writer.write_shard(0, {"weight_fp8": codes.view(E4M3), "weight_scale": scale})
    writer.finish()
    table = open_table(tmp_path, residency)
    got = table.lookup(np.arange(8))
    want = codes.view(E4M3).astype(np.float32) * scale[:, None]  # ml_dtypes' decode
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    np.testing.assert_array_equal(
        got.view(np.uint32), table.reference_lookup(np.arange(8)).view(np.uint32)
    )


def test_pack_locator_is_the_layout_the_kernels_read(rng):
    """pack_locator owns ``loc``: its fields sit where the module docstring puts them (the
    bit-exact tests above read every table through it)."""
    from flashnext.host import lookup_kernels as kern

    seg_start = np.array([100, 150, 200], np.int64)
    bases = rng.integers(1, 1 << 40, size=(2, 4), dtype=np.int64)
    row_bytes = np.array([80, 20], np.int64)
    hot = np.array([120, 151, 230], np.int64)
    loc, keep = kern.pack_locator(50, 2, (100, 240), 1000, "int4", seg_start, bases, row_bytes, hot)
    assert loc.dtype == np.int64
    assert loc[:8].tolist() == [50, 2, 100, 240, 1000, 3, 2, 3]
    assert tuple(loc[8:10]) == kern.decode_tables("int4")
    assert loc[10:12].tolist() == [a.ctypes.data for a in keep]
    np.testing.assert_array_equal(loc[12:15], seg_start)
    np.testing.assert_array_equal(loc[15:23], bases.reshape(-1))
    np.testing.assert_array_equal(loc[23:], row_bytes)
    bitmap, _ = keep
    assert [int(bitmap[r >> 6] >> np.uint64(r & 63)) & 1 for r in (20, 51, 130, 21)] == [1, 1, 1, 0]
    no_hot, none = kern.pack_locator(50, 0, (0, 150), 150, "fp8", seg_start, bases, row_bytes,
                                     np.zeros(0, np.int64))  # fmt: skip
    assert none == () and no_hot[7] == 0 and no_hot[10:12].tolist() == [0, 0]
    with pytest.raises(ValueError, match="bases must be"):
        kern.pack_locator(50, 0, (0, 150), 150, "int4", seg_start, bases[:, :3], row_bytes, hot)

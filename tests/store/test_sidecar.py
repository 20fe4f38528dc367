"""Sidecar reader: other tools' files, and every kind of damage named precisely."""

import json
import os

import numpy as np
import pytest
import safetensors.numpy

from flashnext.errors import SidecarError
from flashnext.host import open_table
from flashnext.store import open_sidecar, write_sidecar
from flashnext.synthetic import embedding_rows
from tests.ple.reference import card_tensors, dequant64

from ..seeding import current_test_rng

FORMATS = ["bf16", "fp8", "int4", "nvfp4"]


def write_card_sidecar(root, fmt, shard_rows, rng, meta=None):
    """A sidecar as another tool writes it: safetensors' own writer, the card's names only."""
    root.mkdir(parents=True, exist_ok=True)
    shards = []
    for i, rows in enumerate(shard_rows):
        t = card_tensors(fmt, rows, rng)
        safetensors.numpy.save_file(t, str(root / f"shard_{i}.safetensors"))
        shards.append(t)
    if meta is not None:
        (root / "META.json").write_text(json.dumps(meta))
    return shards


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("meta", [None, "card"])
def test_reads_sidecars_written_by_other_tools(tmp_path, fmt, meta, rng):
    sizes = [64, 64, 64, 23]
    card_meta = {"variant": f"ples_{fmt}", "shard_rows": 64, "group_size": 16, "built_from": "x"}
    shards = write_card_sidecar(tmp_path / fmt, fmt, sizes, rng, card_meta if meta else None)
    sc = open_sidecar(tmp_path / fmt)
    assert (sc.format, sc.num_rows, sc.width, sc.rows_per_shard) == (fmt, 215, 160, 64)
    ids = rng.integers(-1, 215, size=(9, 13))
    ids[0, 0] = -1
    ref_rows = []
    for t in shards:
        if fmt == "nvfp4":
            t = {**t, "weight_scale_2": np.full(len(t["weight_e2m1"]), t["weight_scale_2"])}
        ref_rows.append(dequant64(fmt, t))
    ref = np.concatenate(ref_rows)
    for residency in ("mmap", "resident"):
        table = open_table(tmp_path / fmt, residency)
        got = table.lookup(ids)
        assert got.shape == (9, 13, 160) and got.dtype == np.float32
        expect = np.where((ids >= 0)[..., None], ref[np.maximum(ids, 0)], 0.0)
        np.testing.assert_array_equal(got, expect.astype(np.float32))


def test_writer_roundtrip_and_meta(tmp_path, rng):
    x = embedding_rows(1000, 160, rng)
    sc = write_sidecar(tmp_path / "t", "int4", x, 300, source={"k": 1})
    meta = json.loads((tmp_path / "t" / "META.json").read_text())
    assert meta["format"] == "int4" and meta["num_shards"] == 4 and meta["rows_per_shard"] == 300
    assert [s["rows"] for s in meta["shards"]] == [300, 300, 300, 100]
    assert all(len(s["sha256"]) == 64 for s in meta["shards"])
    assert meta["flashnext_version"] and meta["source"] == {"k": 1}
    assert sc.verify_checksums() == []
    assert not [p for p in os.listdir(tmp_path / "t") if ".tmp" in p]
    # our files open with the safetensors library too
    with safetensors.safe_open(str(tmp_path / "t" / "shard_1.safetensors"), "np") as f:
        assert f.get_tensor("weight_i4").shape == (300, 80)


def _good(tmp_path, fmt="int4", sizes=(50, 50, 50, 20)):
    rng = current_test_rng("_good")
    write_card_sidecar(tmp_path, fmt, list(sizes), rng)
    return rng


def test_truncated_shard(tmp_path):
    _good(tmp_path)
    path = tmp_path / "shard_2.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    with pytest.raises(
        SidecarError,
        match=r"shard_2\.safetensors: file is \d+ bytes but its header describes \d+ \(truncated\)",
    ):
        open_sidecar(tmp_path)


def test_wrong_dtype(tmp_path):
    rng = _good(tmp_path)
    t = card_tensors("int4", 50, rng)
    t["weight_scale"] = t["weight_scale"].astype(np.float32)
    safetensors.numpy.save_file(t, str(tmp_path / "shard_1.safetensors"))
    with pytest.raises(
        SidecarError,
        match=r"shard_1\.safetensors: tensor weight_scale has dtype F32, expected F16 \(int4 format\)",
    ):
        open_sidecar(tmp_path)


@pytest.mark.parametrize("scale_2", [0.0, -1e-3, float("nan"), float("inf")])
def test_non_positive_or_non_finite_scale_2(tmp_path, scale_2):
    """A zero, negative or NaN per-shard scale would zero, flip or poison every row of the
    shard; the writer never makes one, so the reader refuses it by name."""
    rng = _good(tmp_path, "nvfp4")
    t = card_tensors("nvfp4", 50, rng)
    t["weight_scale_2"] = np.array(scale_2, np.float32)
    safetensors.numpy.save_file(t, str(tmp_path / "shard_2.safetensors"))
    with pytest.raises(
        SidecarError,
        match=r"shard_2\.safetensors: weight_scale_2 is (0\.0|-0\.001|nan|inf), expected a "
        r"finite positive scale",
    ):
        open_sidecar(tmp_path)


def test_wrong_width(tmp_path):
    rng = _good(tmp_path)
    t = card_tensors("int4", 50, rng)
    t["weight_i4"] = t["weight_i4"][:, :72].copy()
    safetensors.numpy.save_file(t, str(tmp_path / "shard_3.safetensors"))
    with pytest.raises(
        SidecarError,
        match=r"shard_3\.safetensors: tensor weight_i4 has shape \[50, 72\], expected \[50, 80\]",
    ):
        open_sidecar(tmp_path)


def test_wrong_row_count(tmp_path):
    rng = _good(tmp_path)
    safetensors.numpy.save_file(
        card_tensors("int4", 49, rng), str(tmp_path / "shard_1.safetensors")
    )
    with pytest.raises(
        SidecarError,
        match=r"shard_1\.safetensors: tensor weight_i4 has 49 rows, expected 50 .*Re-run `flashnext ple quantize`",
    ):
        open_sidecar(tmp_path)


def test_wrong_row_count_against_meta(tmp_path):
    _good(tmp_path, sizes=(50, 50))
    (tmp_path / "META.json").write_text(json.dumps({"rows_per_shard": 64}))
    with pytest.raises(
        SidecarError,
        match=r"shard_0\.safetensors: tensor weight_i4 has 50 rows, expected 64 \(rows per shard from META.json",
    ):
        open_sidecar(tmp_path)


def test_missing_shard_in_middle(tmp_path):
    _good(tmp_path)
    (tmp_path / "shard_1.safetensors").unlink()
    with pytest.raises(
        SidecarError,
        match=r"not consecutive from 0 \(shard_0\.safetensors, then shard_2\.safetensors, "
        r"shard_3\.safetensors\): either shard_1\.safetensors is missing \(restore it\) or",
    ):
        open_sidecar(tmp_path)
    (tmp_path / "META.json").write_text(json.dumps({"num_shards": 4}))
    with pytest.raises(SidecarError, match=r"missing shard_1\.safetensors \(1 of 4 shards\)"):
        open_sidecar(tmp_path)


def test_missing_last_shard_per_meta(tmp_path):
    _good(tmp_path)
    (tmp_path / "META.json").write_text(json.dumps({"num_shards": 5}))
    with pytest.raises(SidecarError, match=r"missing shard_4\.safetensors"):
        open_sidecar(tmp_path)


def test_mixed_formats_and_meta_disagreement(tmp_path):
    rng = _good(tmp_path)
    safetensors.numpy.save_file(card_tensors("fp8", 50, rng), str(tmp_path / "shard_1.safetensors"))
    with pytest.raises(
        SidecarError,
        match=r"shard_1\.safetensors: tensors \['weight_fp8', 'weight_scale'\], expected \['weight_i4', 'weight_scale'\]",
    ):
        open_sidecar(tmp_path)
    other = tmp_path / "other"
    _good(other)
    (other / "META.json").write_text(json.dumps({"format": "nvfp4"}))
    with pytest.raises(
        SidecarError, match=r"META\.json says format 'nvfp4' but the shards hold int4"
    ):
        open_sidecar(other)


def test_not_safetensors_and_empty(tmp_path):
    (tmp_path / "shard_0.safetensors").write_bytes(
        b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}......"
    )
    with pytest.raises(SidecarError, match="header is not valid JSON"):
        open_sidecar(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SidecarError, match=r"no shard_N\.safetensors files"):
        open_sidecar(empty)


def test_two_files_for_one_shard(tmp_path):
    rng = _good(tmp_path)
    safetensors.numpy.save_file(
        card_tensors("int4", 50, rng), str(tmp_path / "shard_01.safetensors")
    )
    with pytest.raises(
        SidecarError,
        match=r"shard_0?1\.safetensors and shard_0?1\.safetensors both claim shard 1",
    ):
        open_sidecar(tmp_path)


def test_scalar_tensors_keep_shape_empty(tmp_path, rng):
    from safetensors import safe_open

    x = rng.standard_normal((40, 160)).astype(np.float32)
    write_sidecar(tmp_path, "nvfp4", x, 16)
    for i in range(3):
        with safe_open(str(tmp_path / f"shard_{i}.safetensors"), "np") as f:
            assert f.get_slice("weight_scale_2").get_shape() == []  # the card: [] fp32


def test_checksum_mismatch(tmp_path, rng):
    write_sidecar(tmp_path, "fp8", embedding_rows(100, 160, rng), 40)
    path = tmp_path / "shard_1.safetensors"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # same size, different bytes: only the checksum can tell
    path.write_bytes(bytes(data))
    problems = open_sidecar(tmp_path).verify_checksums()
    assert len(problems) == 1 and problems[0].startswith("shard_1.safetensors: sha256")


#: A non-finite value per float dtype, as stored bits (e4m3fn has NaN only: 0x7F / 0xFF).
_BAD_BITS = {"float16": [0x7C00, 0xFE00], "float32": [0x7F800000, 0xFFC00000],
             "bfloat16": [0x7F80, 0xFFC1], "float8_e4m3fn": [0x7F, 0xFF]}  # fmt: skip


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "int4", "nvfp4"])
def test_info_finds_inf_and_nan_values(tmp_path, fmt, rng):
    """``ple info``'s scan reads every floating-point value of every shard (bf16/fp8 weights,
    scales) and names the shard, tensor, count and first row of inf/NaN ones."""
    from flashnext.host.inspect import inspect_sidecar, value_bytes

    shards = write_card_sidecar(tmp_path, fmt, [40, 40, 40], rng)  # every value finite
    clean = inspect_sidecar(open_sidecar(tmp_path))
    assert clean.values == "ok" and clean.problems == []
    k = int(rng.integers(0, 3))
    name = next(n for n, v in shards[k].items() if v.dtype.name in _BAD_BITS and v.ndim)
    arr = shards[k][name]
    row, bits = int(rng.integers(0, 40)), _BAD_BITS[arr.dtype.name]
    flat = arr.view(np.dtype(f"u{arr.dtype.itemsize}")).reshape(arr.shape[0], -1)
    cols = rng.choice(flat.shape[1], size=min(2, flat.shape[1]), replace=False)
    flat[row, cols] = bits[: cols.size]
    safetensors.numpy.save_file(shards[k], str(tmp_path / f"shard_{k}.safetensors"))
    seen = []
    found = inspect_sidecar(open_sidecar(tmp_path), progress=seen.append)
    assert found.values == "1 tensor with inf/NaN"
    assert found.problems == [
        f"shard_{k}.safetensors: {name} holds {cols.size} inf/NaN value{'s' * (cols.size > 1)} "
        f"(first in row "
        f"{40 * k + row:,}); the rows that read them dequantize to inf/NaN: re-create this "
        "shard from its source"
    ]
    assert sum(seen) == value_bytes(open_sidecar(tmp_path)) > 0
    skipped = inspect_sidecar(open_sidecar(tmp_path), verify=False)
    assert skipped.values == "not checked (--no-verify)" and skipped.problems == []


def test_info_keeps_checksums_and_values_apart(tmp_path, rng):
    """A NaN written into a shard whose recorded sha256 was updated with it (a tool that
    re-hashes what it damaged): the checksums are ok, the values are not."""
    from flashnext.host.inspect import inspect_sidecar
    from flashnext.safetensors_file import sha256_file

    x = embedding_rows(300, 160, rng)
    write_sidecar(tmp_path / "t", "bf16", x, rows_per_shard=100)
    shard = tmp_path / "t" / "shard_1.safetensors"
    t = safetensors.numpy.load_file(str(shard))
    bits = t["weight"].view(np.uint16)
    bits[int(rng.integers(0, 100)), int(rng.integers(0, 160))] = 0x7FC0  # bf16 NaN
    safetensors.numpy.save_file(t, str(shard))
    meta = json.loads((tmp_path / "t" / "META.json").read_text())
    meta["shards"][1]["sha256"] = sha256_file(shard)
    (tmp_path / "t" / "META.json").write_text(json.dumps(meta))
    found = inspect_sidecar(open_sidecar(tmp_path / "t"))
    assert found.checksums == "ok" and found.values == "1 tensor with inf/NaN"
    assert len(found.problems) == 1 and found.problems[0].startswith("shard_1.safetensors: weight")


def _break_meta(root, change):
    meta = json.loads((root / "META.json").read_text())
    change(meta)
    (root / "META.json").write_text(json.dumps(meta))


def _rename(meta, old, new):
    for rec in meta["shards"]:
        if rec["file"] == old:
            rec["file"] = new


#: META.json "shards" values that cannot vouch for the files: each refused at open, naming it.
_BAD_SHARDS = {
    "text": lambda m: m.update(shards="oops"),
    "empty list": lambda m: m.update(shards=[]),
    "number": lambda m: m.update(shards=5),
    "object": lambda m: m.update(shards={}),
    "false": lambda m: m.update(shards=False),
    "record not an object": lambda m: m["shards"].__setitem__(1, "shard_1.safetensors"),
    "no sha256": lambda m: m["shards"][0].pop("sha256"),
    "short sha256": lambda m: m["shards"][0].update(sha256="ab" * 8),
    "file a number": lambda m: m["shards"][2].update(file=2),
    "renamed entry": lambda m: _rename(m, "shard_1.safetensors", "shard_9.safetensors"),
    "two entries swapped names": lambda m: (
        _rename(m, "shard_1.safetensors", "x"), _rename(m, "shard_2.safetensors", "shard_1.safetensors"),
        _rename(m, "x", "shard_1.safetensors")),
    "entry missing": lambda m: m["shards"].pop(1),
    "extra entry": lambda m: m["shards"].append({**m["shards"][0], "file": "shard_7.safetensors"}),
    "wrong rows": lambda m: m["shards"][1].update(rows=39),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(_BAD_SHARDS))
def test_meta_shards_must_vouch_for_these_files(tmp_path, rng, case, capsys):
    """A META.json whose shards list is malformed, or names other files than the shards here,
    is refused when read: by open_sidecar and by `ple info`, which hash nothing unvouched."""
    from tests.cli.runner import run_in_process

    write_sidecar(tmp_path / "s", "fp8", embedding_rows(100, 160, rng), 40)
    path = tmp_path / "s" / "shard_1.safetensors"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # a corrupted shard, that a renamed entry used to let pass
    path.write_bytes(bytes(data))
    _break_meta(tmp_path / "s", _BAD_SHARDS[case])
    with pytest.raises(SidecarError, match=r"META\.json: shards"):
        open_sidecar(tmp_path / "s")
    code, out, err = run_in_process(["ple", "info", tmp_path / "s"], capsys)
    assert code == 1 and out == "" and err.count("\n") == 1, (code, out, err)
    assert "META.json: shards" in err


def test_meta_without_shards_opens_as_unrecorded(tmp_path, rng):
    """No ``shards`` key (or null): no checksums recorded, said so; the sidecar still opens."""
    write_sidecar(tmp_path / "s", "int4", embedding_rows(100, 160, rng), 40)
    sc = open_sidecar(tmp_path / "s")
    assert set(sc.expected_checksums()) == {0, 1, 2}
    for change in (lambda m: m.update(shards=None), lambda m: m.pop("shards")):
        _break_meta(tmp_path / "s", change)
        sc = open_sidecar(tmp_path / "s")
        assert sc.expected_checksums() == {} and sc.verify_checksums() == []

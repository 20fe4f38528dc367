"""PLE table discovery in every layout x prefix x format, TP row maps, and bad tables."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest

from flashnext.checkpoint import find_ple_tables, open_table_source
from flashnext.errors import CheckpointError
from flashnext.ple.geometry import PLEGeometry
from flashnext.safetensors_file import read_header, read_tensor

from .builder import PREFIXES, build_checkpoint, decode, rewrite

LAYOUTS = ("shards", "whole", "empty-shard")
FORMATS = ("bf16", "fp8", "nvfp4")


def _rtol(fmt):
    # bf16 decodes exactly; fp8/nvfp4 multiply in float32 (one rounding per product).
    return 0.0 if fmt == "bf16" else 3e-7


@pytest.mark.parametrize("prefix", list(PREFIXES))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_discovery_and_rows(tmp_path, fmt, layout, prefix):
    built = build_checkpoint(
        tmp_path / "ck",
        fmt=fmt,
        layout=layout,
        prefix=prefix,
        ple_layer_ids=(5, 2),  # unsorted on purpose: ordinals follow sorted(set(ids))
        base=1000,
        nested=(prefix == "vl"),
    )
    tables = find_ple_tables(built.root)
    assert [t.layer_id for t in tables] == [2, 5]
    for d, t in enumerate(tables):
        geo = PLEGeometry.from_config(built.config, layer_ordinal=d)
        assert (t.ordinal, t.layer_index, t.prefix, t.layout, t.format) == (
            d,
            t.layer_id - 1,
            prefix,
            layout,
            fmt,
        )
        assert t.num_rows == geo.num_rows and t.width == 160
        assert len(t.weights) == (4 if layout == "shards" else 1)
        assert (
            t.name_prefix == f"{PREFIXES[prefix]}{t.layer_id - 1}.ple.ple_embedding.ngram_embedding"
        )
        if fmt == "fp8":
            assert t.scalars == {
                "weight_scale": float(built.tensors[f"{t.name_prefix}.weight_scale"])
            }
        if fmt == "nvfp4":
            assert t.scalars == {
                "weight_scale_2": float(built.tensors[f"{t.name_prefix}.weight_scale_2"])
            }
        if fmt == "bf16":
            assert t.scalars == {}
    # the rows, dequantized, against float64 references from the stored bytes
    src = open_table_source(built.root, 1)
    ref = built.refs[5]
    got = src.read_rows(0, src.num_rows)
    assert got.dtype == np.float32 and got.shape == ref.shape
    np.testing.assert_allclose(got, ref, rtol=_rtol(fmt), atol=0)
    # a block straddling shard boundaries
    S = tables[1].rows_per_shard
    lo, hi = S - 7, min(2 * S + 11, src.num_rows)
    np.testing.assert_allclose(src.read_rows(lo, hi), ref[lo:hi], rtol=_rtol(fmt), atol=0)


def _assemble(table, start, end, fmt):
    """Rows [start, end) built only from the row map and the files (no flashnext decoding)."""
    bufs = {}
    copies = table.row_map(start, end)
    for c in copies:
        header = read_header(c.file)
        src = read_tensor(header.tensors[c.tensor], c.file)
        kind = c.tensor.rsplit(".", 1)[1]
        if kind not in bufs:
            bufs[kind] = np.zeros((end - start, src.shape[1]), dtype=src.dtype)
        bufs[kind][c.dst_offset : c.dst_offset + c.rows] = src[c.src_offset : c.src_offset + c.rows]
    covered = np.zeros(end - start, dtype=np.int64)
    for c in copies:
        if c.tensor.endswith(".weight"):
            covered[c.dst_offset : c.dst_offset + c.rows] += 1
    assert (covered == 1).all()  # every destination row written exactly once
    gscale = table.scalars.get("weight_scale" if fmt == "fp8" else "weight_scale_2")
    return decode(fmt, bufs["weight"], bufs.get("weight_scale"), gscale)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_tp_row_mapping(tmp_path, fmt, layout):
    built = build_checkpoint(tmp_path / "ck", fmt=fmt, layout=layout, base=2000, parts=8)
    (table,) = find_ple_tables(built.root)
    ref = built.refs[2]
    for tp in (1, 2, 4):
        per = table.num_rows // tp
        parts_seen = []
        for rank in range(tp):
            copies = table.tp_row_map(tp, rank)
            got = _assemble(table, rank * per, (rank + 1) * per, fmt)
            np.testing.assert_array_equal(got, ref[rank * per : (rank + 1) * per])
            parts_seen.append(copies)
            if layout != "shards":
                assert [c.src_offset for c in copies if c.tensor.endswith(".weight")] == [
                    rank * per
                ]
        if layout == "shards":
            # 8 shards over tp ranks: each rank copies exactly 8 / tp whole shards at offset 0
            for copies in parts_seen:
                w = [c for c in copies if c.tensor.endswith(".weight")]
                assert len(w) == 8 // tp and all(c.src_offset == 0 for c in w)
    # an unaligned range crossing shards: partial first and last shard
    S = table.rows_per_shard
    start, end = S // 2, 3 * S + 5
    w = [c for c in table.row_map(start, end) if c.tensor.endswith(".weight")]
    if layout == "shards":
        assert [(c.src_offset, c.dst_offset, c.rows) for c in w] == [
            (S // 2, 0, S - S // 2),
            (0, S - S // 2, S),
            (0, 2 * S - S // 2, S),
            (0, 3 * S - S // 2, 5),
        ]
    else:
        assert [(c.src_offset, c.dst_offset, c.rows) for c in w] == [(start, 0, end - start)]
    np.testing.assert_array_equal(_assemble(table, start, end, fmt), ref[start:end])
    with pytest.raises(CheckpointError, match="not inside"):
        table.row_map(0, table.num_rows + 1)
    with pytest.raises(CheckpointError, match="does not split evenly"):
        table.tp_row_map(next(t for t in range(3, 1000) if table.num_rows % t), 0)


def test_uneven_last_shard(tmp_path):
    """split_ngram_parts that does not divide the rows: the last shard is shorter."""
    built = build_checkpoint(tmp_path / "ck", fmt="bf16", base=1000, parts=5)
    (table,) = find_ple_tables(built.root)
    S = table.rows_per_shard
    assert table.num_rows != S * 5 and table.weights[-1].rows == table.num_rows - 4 * S
    src = open_table_source(built.root)
    np.testing.assert_array_equal(src.read_rows(0, src.num_rows), built.refs[2])


def test_geometry_buffers_win(tmp_path):
    built = build_checkpoint(tmp_path / "ck", fmt="bf16", base=1000, buffers=True)
    (table,) = find_ple_tables(built.root)
    assert sorted(table.buffers) == ["layer_multipliers", "ngram_heads_vocab_sizes"]
    # buffers that describe a bigger table than the one stored: the shape check must use them
    name = "model.language_model.layers.1.ple.ple_embedding.ngram_heads_vocab_sizes"
    built.tensors[name] = built.tensors[name] + 1000
    rewrite(built)
    with pytest.raises(CheckpointError, match=r"has shape \[\d+, 160\], expected \[\d+, 160\]"):
        find_ple_tables(built.root)


# -- bad tables ---------------------------------------------------------------------------


@pytest.fixture
def shards_ckpt(tmp_path):
    return build_checkpoint(tmp_path / "ck", fmt="nvfp4", layout="shards", base=1000)


BASE = "model.language_model.layers.1.ple.ple_embedding.ngram_embedding"


def test_config_without_split_ngram_parts_is_named(shards_ckpt):
    cfg_path = shards_ckpt.root / "config.json"
    cfg = json.loads(cfg_path.read_text())
    for part in (cfg, cfg.get("text_config") or {}):
        part.pop("split_ngram_parts", None)
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(
        CheckpointError,
        match=r"config.json has no split_ngram_parts, so the released checkpoints' 128 shards "
        r"were assumed, but 4 shard tensors are stored",
    ):
        find_ple_tables(shards_ckpt.root)


def test_wrong_row_count(shards_ckpt):
    b = shards_ckpt
    name = f"{BASE}.shard_1.weight"
    rows = b.tensors[name].shape[0]
    b.tensors[name] = b.tensors[name][:-3].copy()
    rewrite(b)
    with pytest.raises(CheckpointError) as exc:
        find_ple_tables(b.root)
    msg = str(exc.value)
    assert name in msg and b.files[name] in msg
    assert f"[{rows - 3}, 80]" in msg and f"expected [{rows}, 80]" in msg
    assert "shard 1 of 4" in msg


def test_wrong_width(shards_ckpt):
    b = shards_ckpt
    name = f"{BASE}.shard_2.weight_scale"
    b.tensors[name] = b.tensors[name][:, :8].copy()
    rewrite(b)
    with pytest.raises(
        CheckpointError, match=r"weight_scale has shape \[\d+, 8\], expected \[\d+, 10\]"
    ):
        find_ple_tables(b.root)


def test_bf16_wrong_width(tmp_path):
    b = build_checkpoint(tmp_path / "ck", fmt="bf16", layout="whole", base=1000)
    name = f"{BASE}.weight"
    b.tensors[name] = np.ascontiguousarray(b.tensors[name][:, :128])
    rewrite(b)
    with pytest.raises(
        CheckpointError, match=r"expected \[\d+, 160\].*ple_embed_dim / heads = 160"
    ):
        find_ple_tables(b.root)


@pytest.mark.parametrize("bad", ["shard_x.weight", "shard_01.weight", "shard_3.bias", "extra"])
def test_unknown_shard_suffix_is_an_error(shards_ckpt, bad):
    b = shards_ckpt
    b.tensors[f"{BASE}.{bad}"] = np.ones((4, 80), dtype=np.uint8)
    rewrite(b)
    with pytest.raises(
        CheckpointError, match=f"fits no known layout.*{bad}|{bad}.*fits no known layout"
    ):
        find_ple_tables(b.root)


def test_missing_table_shard(shards_ckpt):
    b = shards_ckpt
    del b.tensors[f"{BASE}.shard_2.weight"], b.tensors[f"{BASE}.shard_2.weight_scale"]
    rewrite(b)
    with pytest.raises(
        CheckpointError, match=r"missing 1 of 4 table shards, e\.g\. .*shard_2\.weight"
    ):
        find_ple_tables(b.root)


def test_shard_beyond_split_parts(shards_ckpt):
    b = shards_ckpt
    b.tensors[f"{BASE}.shard_4.weight"] = b.tensors[f"{BASE}.shard_3.weight"]
    rewrite(b)
    with pytest.raises(CheckpointError, match="beyond split_ngram_parts=4"):
        find_ple_tables(b.root)


def test_nvfp4_without_scale_2(shards_ckpt):
    b = shards_ckpt
    del b.tensors[f"{BASE}.weight_scale_2"]
    rewrite(b)
    with pytest.raises(CheckpointError, match=r"no global scale .*weight_scale_2"):
        find_ple_tables(b.root)


def test_fp8_without_global_scale(tmp_path):
    b = build_checkpoint(tmp_path / "ck", fmt="fp8", layout="empty-shard", base=1000)
    del b.tensors[f"{BASE}.weight_scale"]
    rewrite(b)
    with pytest.raises(CheckpointError, match="no global scale"):
        find_ple_tables(b.root)


def test_two_layouts_at_once(tmp_path):
    b = build_checkpoint(tmp_path / "ck", fmt="bf16", layout="shards", base=1000)
    b.tensors[f"{BASE}.weight"] = np.zeros((4, 160), dtype=ml_dtypes.bfloat16)
    rewrite(b)
    with pytest.raises(CheckpointError, match="2 layouts at once"):
        find_ple_tables(b.root)


def test_table_for_layer_not_in_config(tmp_path):
    b = build_checkpoint(
        tmp_path / "ck", fmt="bf16", layout="whole", base=1000, ple_layer_ids=(2, 4)
    )
    cfg = json.loads((b.root / "config.json").read_text())
    cfg["ple_layer_ids"] = [2]
    (b.root / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        CheckpointError, match=r"layer index 3 \(decoder layer 4\).*ple_layer_ids \[2\]"
    ):
        find_ple_tables(b.root)
    cfg["ple_layer_ids"] = [2, 4, 6]
    (b.root / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="no PLE table for decoder layer 6"):
        find_ple_tables(b.root)


def test_truncated_file_is_named(shards_ckpt):
    b = shards_ckpt
    p = b.root / "model-00002-of-00003.safetensors"
    with open(p, "r+b") as fh:
        fh.truncate(p.stat().st_size - 1)
    with pytest.raises(
        CheckpointError, match=r"model-00002-of-00003\.safetensors.*truncated.*checkpoint verify"
    ):
        find_ple_tables(b.root)


def test_layer_choice(tmp_path):
    b = build_checkpoint(tmp_path / "ck", fmt="bf16", base=400, ple_layer_ids=(2, 3))
    with pytest.raises(CheckpointError, match="choose one with --layer"):
        open_table_source(b.root)
    with pytest.raises(CheckpointError, match="out of range"):
        open_table_source(b.root, 2)
    assert open_table_source(b.root, 1).info.layer_id == 3


def test_cli_ple_json(tmp_path, capsys):
    from ..cli.runner import run_in_process

    b = build_checkpoint(tmp_path / "ck", fmt="fp8", layout="empty-shard", prefix="short", base=400)
    code, out, _ = run_in_process(["checkpoint", "ple", str(b.root), "--json", "--tp", "2"], capsys)
    doc = json.loads(out)
    (t,) = doc["tables"]
    assert (
        code == 0
        and t["layout"] == "empty-shard"
        and t["format"] == "fp8"
        and t["prefix"] == "short"
    )
    ranks = t["tp"]["ranks"]
    assert [r[0]["src_offset"] for r in ranks] == [0, t["num_rows"] // 2]
    code, out, _ = run_in_process(["checkpoint", "ple", str(b.root)], capsys)
    assert code == 0 and "vLLM 0.33.0 rejects" in out
    # a bad checkpoint: one `error:` line and exit 1
    (b.root / "config.json").write_text(json.dumps({**b.config, "ple_layer_ids": [3]}))
    code, _, err = run_in_process(["checkpoint", "ple", str(b.root)], capsys)
    assert code == 1 and err.startswith("error: ")


def test_missing_weight_file_is_named(tmp_path):
    b = build_checkpoint(tmp_path / "ck", fmt="bf16", base=400)
    (b.root / "model-00003-of-00003.safetensors").unlink()
    with pytest.raises(
        CheckpointError, match=r"model-00003-of-00003\.safetensors: missing .*checkpoint verify"
    ):
        find_ple_tables(b.root)


def test_hub_cache_layout(tmp_path):
    from .builder import to_hf_cache

    b = build_checkpoint(tmp_path / "ck", fmt="nvfp4", layout="whole", prefix="short", base=400)
    repo = to_hf_cache(b, tmp_path / "hub")
    (table,) = find_ple_tables(repo)
    assert (table.layout, table.format, table.prefix) == ("whole", "nvfp4", "short")
    src = open_table_source(repo)
    np.testing.assert_allclose(src.read_rows(0, src.num_rows), b.refs[2], rtol=3e-7, atol=0)


def test_invalid_geometry_buffer(tmp_path):
    b = build_checkpoint(tmp_path / "ck", fmt="bf16", base=400, buffers=True)
    name = "model.language_model.layers.1.ple.ple_embedding.layer_multipliers"
    b.tensors[name] = b.tensors[name][:2].copy()
    rewrite(b)
    with pytest.raises(CheckpointError, match=r"layer_multipliers has shape \[2\], expected \[3\]"):
        find_ple_tables(b.root)


# -- the format contract's checkpoint spellings, as discovery reads them ----------------------


def test_rows_of_no_format_are_named(tmp_path):
    b = build_checkpoint(tmp_path / "ck", fmt="bf16", layout="whole", base=400)
    b.tensors[f"{BASE}.weight"] = b.tensors[f"{BASE}.weight"].astype(np.float32)
    rewrite(b)
    with pytest.raises(
        CheckpointError, match=r"tensor .*ngram_embedding\.weight: a PLE table's rows are never F32"
    ):
        find_ple_tables(b.root)


def test_nvfp4_without_block_scale(shards_ckpt):
    b = shards_ckpt
    del b.tensors[f"{BASE}.shard_1.weight_scale"]
    rewrite(b)
    with pytest.raises(
        CheckpointError, match=r"nvfp4 tensor .*shard_1\.weight has no .*shard_1\.weight_scale"
    ):
        find_ple_tables(b.root)


def test_block_scale_of_the_wrong_dtype(shards_ckpt):
    b = shards_ckpt
    name = f"{BASE}.shard_3.weight_scale"
    b.tensors[name] = b.tensors[name].astype(np.float32)
    rewrite(b)
    with pytest.raises(
        CheckpointError, match=r"shard_3\.weight_scale has dtype F32, expected F8_E4M3"
    ):
        find_ple_tables(b.root)


@pytest.mark.parametrize(
    ("fmt", "stray"),
    [
        ("bf16", "shard_1.weight_scale"),
        ("bf16", "weight_scale"),
        ("fp8", "weight_scale_2"),
        ("nvfp4", "weight_scale"),
    ],
)
def test_tensor_outside_the_spelling_is_refused(tmp_path, fmt, stray):
    b = build_checkpoint(tmp_path / "ck", fmt=fmt, layout="shards", base=400)
    b.tensors[f"{BASE}.{stray}"] = np.ones((), dtype=np.float32)
    rewrite(b)
    with pytest.raises(CheckpointError, match=f"{stray} is not part of a {fmt} table"):
        find_ple_tables(b.root)


@pytest.mark.parametrize("fmt", FORMATS)
def test_json_keeps_the_global_scale_keys(tmp_path, fmt):
    b = build_checkpoint(tmp_path / "ck", fmt=fmt, layout="whole", base=400)
    (t,) = find_ple_tables(b.root)
    d = t.to_dict()
    keys = list(d)
    assert keys[keys.index("nbytes") + 1 : keys.index("buffers")] == [
        "weight_scale",
        "weight_scale_2",
    ]
    for name in ("weight_scale", "weight_scale_2"):
        assert d[name] == t.scalars.get(name)
    assert [p.kind for p in t.parts] == (
        ["weight", "weight_scale"] if fmt == "nvfp4" else ["weight"]
    )

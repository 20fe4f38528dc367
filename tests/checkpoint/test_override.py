"""`flashnext checkpoint override`: patched copies and --hf-overrides, reason recorded,
original config.json untouched; --dense-attention nulls the indexer fields and reports the
indexer tensors left in the checkpoint."""

from __future__ import annotations

import hashlib
import json

import pytest

from flashnext.checkpoint import find_ple_tables, verify_snapshot
from flashnext.checkpoint.override import (
    OVERRIDES_FILE,
    OVERRIDES_KEY,
    indexer_layer,
    is_indexer_tensor,
    override_layer_types,
    parse_mapping,
)
from flashnext.errors import CheckpointError
from flashnext.records import check_record

from ..cli.runner import run_in_process
from ..seeding import current_test_rng
from .builder import (
    INDEXER_FIELDS,
    add_indexer_fields,
    build_checkpoint,
    indexer_bytes,
    indexer_tensors,
    make_config,
)

MAPPING = ["--layer-type", "qwen_sparse_attention=full_attention"]


@pytest.mark.parametrize("nested", [False, True])
def test_override_to_out_dir(tmp_path, capsys, nested):
    built = build_checkpoint(tmp_path / "ck", base=400, nested=nested, files=2)
    original = (built.root / "config.json").read_bytes()
    out = tmp_path / "patched"
    code, printed, _ = run_in_process(
        [
            "checkpoint",
            "override",
            str(built.root),
            *MAPPING,
            "--out",
            str(out),
            "--reason",
            "runtime X",
        ],
        capsys,
    )
    assert code == 0
    assert (built.root / "config.json").read_bytes() == original  # never edited in place
    doc = json.loads((out / "config.json").read_text())
    text = doc["text_config"] if nested else doc
    before = json.loads(original)
    before_types = (before["text_config"] if nested else before)["layer_types"]
    assert text["layer_types"] == [
        "full_attention" if t == "qwen_sparse_attention" else t for t in before_types
    ]
    record = check_record(doc[OVERRIDES_KEY], kind="flashnext.checkpoint.override")
    n_changed = before_types.count("qwen_sparse_attention")
    assert len(record["changes"]) == n_changed == 3
    where = "text_config." if nested else ""
    assert record["changes"][0] == {
        "field": f"{where}layer_types[1]",
        "old": "qwen_sparse_attention",
        "new": "full_attention",
    }
    assert record["reason"] == "runtime X" and record["equivalence"] == "not shown"
    assert "NOT shown to be computationally equivalent" in record["caveat"]
    assert record["source_sha256"] == hashlib.sha256(original).hexdigest()
    assert json.loads((out / OVERRIDES_FILE).read_text()) == record
    # each change and the caveat are the summary on stdout
    assert f"changed {where}layer_types[1]" in printed and "NOT" in printed
    # the patched copy is a servable snapshot: weights symlinked, nothing else differs
    assert (out / "model-00001-of-00002.safetensors").is_symlink()
    assert verify_snapshot(out).ok
    assert find_ple_tables(out)[0].num_rows == find_ple_tables(built.root)[0].num_rows
    # running it again refreshes our own copy; it still refuses a config.json it did not write
    code, _, _ = run_in_process(
        ["checkpoint", "override", str(built.root), *MAPPING, "--out", str(out)], capsys
    )
    assert code == 0
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "config.json").write_text("{}")
    code, _, err = run_in_process(
        ["checkpoint", "override", str(built.root), *MAPPING, "--out", str(foreign)], capsys
    )
    assert code == 2 and "which this command did not write" in err
    # the same --out for another checkpoint (or revision) would serve one's weights with the
    # other's config: refused before anything changes, naming the link
    other = build_checkpoint(tmp_path / "ck2", base=400, nested=nested, files=2)
    before = {q.name: q.read_bytes() for q in out.iterdir() if not q.is_symlink()}
    code, _, err = run_in_process(
        ["checkpoint", "override", str(other.root), *MAPPING, "--out", str(out)], capsys
    )
    assert code == 1 and "model-00001-of-00002.safetensors links to" in err, err
    assert "would mix two checkpoints" in err
    assert {q.name: q.read_bytes() for q in out.iterdir() if not q.is_symlink()} == before
    # and a file where a link belongs (a user's own copy of a shard) the same way
    (out / "model-00002-of-00002.safetensors").unlink()
    (out / "model-00002-of-00002.safetensors").write_bytes(b"mine")
    code, _, err = run_in_process(
        ["checkpoint", "override", str(built.root), *MAPPING, "--out", str(out)], capsys
    )
    assert code == 2 and "holds model-00002-of-00002.safetensors, which this command" in err, err


@pytest.mark.parametrize("nested", [False, True])
def test_hf_overrides_json(tmp_path, capsys, nested):
    built = build_checkpoint(tmp_path / "ck", base=400, nested=nested)
    original = (built.root / "config.json").read_bytes()
    rename = ["--layer-type", "qwen_sparse_attention=indexed_attention"]
    code, out, err = run_in_process(
        ["checkpoint", "override", str(built.root), *rename, "--hf-overrides"], capsys
    )
    assert code == 0 and (built.root / "config.json").read_bytes() == original
    doc = json.loads(out)
    types = doc["text_config"]["layer_types"] if nested else doc["layer_types"]
    assert types == ["linear_attention", "indexed_attention"] * 3
    assert set(doc) == ({"text_config"} if nested else {"layer_types"})
    assert "NOT shown to be computationally equivalent" in " ".join(err.split())


@pytest.mark.parametrize("nested", [False, True])
def test_full_attention_through_hf_overrides_is_refused(tmp_path, capsys, nested):
    # vLLM applies --hf-overrides after transformers renamed full_attention to
    # indexed_attention, so the entry reaches Qwen4ExpDecoderLayer, which raises.
    built = build_checkpoint(tmp_path / "ck", base=400, nested=nested)
    code, out, err = run_in_process(
        ["checkpoint", "override", str(built.root), *MAPPING, "--hf-overrides"], capsys
    )
    assert code == 1 and out == ""
    assert "ValueError: Invalid layer_type full_attention" in err and "--dense-attention" in err


def qsa_checkpoint(tmp_path, nested=False, layers=(1, 3, 5)):
    """A checkpoint whose QSA layers carry indexer fields and indexer tensors."""
    rng = current_test_rng("qsa_checkpoint")
    built = build_checkpoint(
        tmp_path / "ck",
        base=400,
        nested=nested,
        hf_metadata=False,
        extra_tensors=indexer_tensors(list(layers), rng),
    )
    add_indexer_fields(built.root, nested)
    return built


@pytest.mark.parametrize("nested", [False, True])
def test_dense_attention_to_out_dir(tmp_path, capsys, nested):
    built = qsa_checkpoint(tmp_path, nested)
    original = (built.root / "config.json").read_bytes()
    out = tmp_path / "dense"
    argv = ["checkpoint", "override", str(built.root), "--dense-attention", "--out", str(out)]
    code, printed, err = run_in_process(argv, capsys)
    assert code == 0 and (built.root / "config.json").read_bytes() == original
    doc = json.loads((out / "config.json").read_text())
    text = doc["text_config"] if nested else doc
    assert all(text[name] is None for name in INDEXER_FIELDS)
    assert (
        text["layer_types"]
        == json.loads(original).get("text_config", json.loads(original))["layer_types"]
    )  # vLLM does not choose QSA by the layer type's name: left alone
    record = check_record(doc[OVERRIDES_KEY], kind="flashnext.checkpoint.override")
    where = "text_config." if nested else ""
    assert {c["field"] for c in record["changes"]} == {where + n for n in INDEXER_FIELDS}
    assert record["dense_attention"] is True
    held = record["indexer_tensors"]
    assert held["count"] == 9 and held["layers"] == [1, 3, 5]
    assert held["bytes"] == 3 * indexer_bytes()
    assert "FLASHNEXT_DROP_INDEXER=1" in held["handling"]
    holding = sorted({built.files[n] for n in built.tensors if ".self_attn.indexer." in n})
    assert held["files"] == holding
    assert held["files_bytes"] == sum((built.root / f).stat().st_size for f in holding)
    # the weights are links, not copies; the warning names the switch and what vLLM says
    assert all((out / f).is_symlink() for f in built.files.values())
    assert f"changed {where}indexer_n_heads: 4 -> None" in printed
    assert "FLASHNEXT_DROP_INDEXER=1" in err and "self_attn.indexer" in err


@pytest.mark.parametrize("nested", [False, True])
def test_dense_attention_hf_overrides_nulls_the_fields(tmp_path, capsys, nested):
    built = qsa_checkpoint(tmp_path, nested)
    argv = ["checkpoint", "override", str(built.root), "--dense-attention", "--hf-overrides"]
    code, out, err = run_in_process(argv, capsys)
    assert code == 0
    nulls = dict.fromkeys(INDEXER_FIELDS)
    assert json.loads(out) == ({"text_config": nulls} if nested else nulls)
    assert "FLASHNEXT_DROP_INDEXER=1" in err


def test_renaming_qsa_layers_alone_warns_that_vllm_still_builds_qsa(tmp_path, capsys):
    built = qsa_checkpoint(tmp_path)
    argv = ["checkpoint", "override", str(built.root), *MAPPING, "--out", str(tmp_path / "o")]
    code, _, err = run_in_process(argv, capsys)
    assert code == 0 and "still builds QSA" in err and "--dense-attention" in err


def test_dense_attention_without_indexer_fields_is_refused(tmp_path, capsys):
    built = build_checkpoint(tmp_path / "ck", base=400)
    argv = ["checkpoint", "override", str(built.root), "--dense-attention", "--hf-overrides"]
    code, out, err = run_in_process(argv, capsys)
    assert code == 1 and out == "" and "dense already" in err
    code, _, err = run_in_process(["checkpoint", "override", str(built.root), "--hf-overrides"], capsys)
    assert code == 2 and "--dense-attention" in err


def test_indexer_tensor_names():
    assert is_indexer_tensor("model.language_model.layers.3.self_attn.indexer.index_qk_proj.weight")
    assert is_indexer_tensor("layers.3.self_attn.indexer.k_layernorm.weight")
    assert is_indexer_tensor("mtp.layers.0.self_attn.indexer.index_qk_proj.weight_scale")
    assert indexer_layer("model.layers.12.self_attn.indexer.q_layernorm.weight") == 12
    assert not is_indexer_tensor("model.layers.3.self_attn.q_proj.weight")
    assert not is_indexer_tensor("model.layers.3.mlp.indexer.weight")
    assert indexer_layer("model.layers.3.self_attn.o_proj.weight") is None


def test_bad_override_requests(tmp_path, capsys):
    built = build_checkpoint(tmp_path / "ck", base=400)
    root = str(built.root)
    code, _, err = run_in_process(
        ["checkpoint", "override", root, "--layer-type", "mamba=full_attention", "--hf-overrides"],
        capsys,
    )
    assert code == 1 and "no layer_types entry equals ['mamba']" in err
    # the destination rule every writing command shares (exit 2, before any work)
    code, _, err = run_in_process(["checkpoint", "override", root, *MAPPING, "--out", root], capsys)
    assert code == 2 and "is the input" in err
    inside = str(built.root / "patched")
    code, _, err = run_in_process(["checkpoint", "override", root, *MAPPING, "--out", inside], capsys)
    assert code == 2 and "lies inside the input" in err
    assert not (built.root / "patched").exists()
    code, _, err = run_in_process(["checkpoint", "override", root, *MAPPING], capsys)
    assert code == 2 and "exactly one of" in err
    with pytest.raises(CheckpointError, match="expected OLD=NEW"):
        parse_mapping(["qwen_sparse_attention"])
    cfg = make_config()
    del cfg["layer_types"]
    with pytest.raises(CheckpointError, match="no layer_types list"):
        override_layer_types(cfg, {"a": "b"})

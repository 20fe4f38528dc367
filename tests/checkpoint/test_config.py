"""`flashnext checkpoint override`: patched copies and --hf-overrides, reason recorded,
original config.json untouched."""

from __future__ import annotations

import hashlib
import json

import pytest

from flashnext.checkpoint import find_ple_tables, verify_snapshot
from flashnext.checkpoint.config import (
    OVERRIDES_FILE,
    OVERRIDES_KEY,
    override_layer_types,
    parse_mapping,
)
from flashnext.errors import CheckpointError
from flashnext.records import check_record

from ..cli.runner import run_in_process
from .builder import build_checkpoint, make_config

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
    assert code == 1 and "not written by flashnext" in err


@pytest.mark.parametrize("nested", [False, True])
def test_hf_overrides_json(tmp_path, capsys, nested):
    built = build_checkpoint(tmp_path / "ck", base=400, nested=nested)
    original = (built.root / "config.json").read_bytes()
    code, out, err = run_in_process(
        ["checkpoint", "override", str(built.root), *MAPPING, "--hf-overrides"], capsys
    )
    assert code == 0 and (built.root / "config.json").read_bytes() == original
    doc = json.loads(out)
    types = doc["text_config"]["layer_types"] if nested else doc["layer_types"]
    assert types == ["linear_attention", "full_attention"] * 3
    assert set(doc) == ({"text_config"} if nested else {"layer_types"})
    assert "NOT shown to be computationally equivalent" in " ".join(err.split())


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

"""Download plans from real index files: PLE-only shard files are skippable, mixed ones not."""

import json

import pytest
from safetensors.numpy import save_file

from flashnext.checkpoint.download_plan import check_sidecar, plan_download
from flashnext.errors import CheckpointError
from flashnext.ple.geometry import PLEGeometry
from flashnext.store.destination import write_sidecar
from tests.checkpoint.builder import build_checkpoint, to_hf_cache


def split_ple_into_own_file(built):
    """Rewrite the snapshot as the released checkpoint is laid out: the table in its own file."""
    root = built.root
    for f in root.glob("*.safetensors"):
        f.unlink()
    ple = {n: t for n, t in built.tensors.items() if ".ngram_embedding." in n}
    rest = {n: t for n, t in built.tensors.items() if n not in ple}
    save_file(ple, str(root / "model-ple.safetensors"))
    save_file(rest, str(root / "model-00001.safetensors"))
    weight_map = {n: "model-ple.safetensors" for n in ple}
    weight_map.update({n: "model-00001.safetensors" for n in rest})
    total = sum(int(t.nbytes) for t in built.tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    return ple


def test_ple_only_file_is_excluded_from_the_hf_command(tmp_path):
    built = build_checkpoint(tmp_path / "ckpt", fmt="bf16", parts=4, hf_metadata=False)
    ple = split_ple_into_own_file(built)
    plan = plan_download(tmp_path / "ckpt", repo_id="org/flash-next")
    roles = {f.name: f.role for f in plan.files}
    assert roles == {"model-ple.safetensors": "ple-only", "model-00001.safetensors": "weights"}
    ple_file = next(f for f in plan.files if f.name == "model-ple.safetensors")
    assert ple_file.tensors == len(ple)
    assert ple_file.size == (tmp_path / "ckpt" / "model-ple.safetensors").stat().st_size
    cmd = plan.hf_download_command(local_dir="/models/fn")
    assert cmd == [
        "hf", "download", "org/flash-next", "--exclude", "model-ple.safetensors",
        "--local-dir", "/models/fn",
    ]


def test_mixed_files_are_kept_and_said(tmp_path):
    build_checkpoint(tmp_path / "ckpt", fmt="nvfp4", parts=4, files=3, hf_metadata=False)
    plan = plan_download(tmp_path / "ckpt" / "model.safetensors.index.json")
    assert plan.skippable == [] and plan.mixed
    assert "--exclude" not in plan.hf_download_command()
    assert any("must be downloaded even with a sidecar" in n for n in plan.notes)
    assert any("--repo" in n for n in plan.notes)  # no hub cache path, no repo id


def test_repo_id_from_hub_cache_and_sizes_unknown_before_download(tmp_path):
    built = build_checkpoint(tmp_path / "ckpt", parts=4, hf_metadata=False)
    split_ple_into_own_file(built)
    repo = to_hf_cache(built, tmp_path / "cache", repo="acme--fn-mini")
    snap = next((repo / "snapshots").iterdir())
    plan = plan_download(snap)
    assert plan.repo_id == "acme/fn-mini"
    index_only = tmp_path / "just-index"
    index_only.mkdir()
    (index_only / "model.safetensors.index.json").write_bytes(
        (snap / "model.safetensors.index.json").read_bytes()
    )
    assert all(f.size is None for f in plan_download(index_only).files)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{", "not valid JSON"),
        ("[]", "no 'weight_map'"),
        ('{"weight_map": {"a.weight": "../../etc/passwd"}}', "not a plain file name"),
    ],
)
def test_bad_index_is_named(tmp_path, content, message):
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(content)
    with pytest.raises(CheckpointError, match=message):
        plan_download(index)


def test_missing_index_is_named(tmp_path):
    with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json: not found"):
        plan_download(tmp_path)


def test_sidecar_checked_against_config_geometry(tmp_path, rng):
    built = build_checkpoint(tmp_path / "ckpt", parts=4, hf_metadata=False)
    split_ple_into_own_file(built)
    geo = PLEGeometry.from_config(built.config, layer_ordinal=0)
    rows = rng.standard_normal((geo.num_rows, geo.width)).astype("float32")
    write_sidecar(tmp_path / "good", "int4", rows, rows_per_shard=geo.shard_rows())
    write_sidecar(tmp_path / "short", "int4", rows[:-128], rows_per_shard=geo.shard_rows())
    plan = plan_download(tmp_path / "ckpt")
    good = check_sidecar(plan, tmp_path / "good")
    assert good.ok and good.rows == geo.num_rows and "matches config.json" in good.message
    bad = check_sidecar(plan, tmp_path / "short")
    assert not bad.ok and f"describes {geo.num_rows} rows" in bad.message

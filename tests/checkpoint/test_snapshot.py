"""`flashnext checkpoint verify` on real snapshots: complete, truncated, missing, leftovers,
index/header disagreement, hash mismatches, hub-cache layout."""

from __future__ import annotations

import json
import os
import struct

import pytest

from flashnext.checkpoint.snapshot import file_digest, verify_snapshot

from ..cli.runner import run_in_process
from .builder import build_checkpoint, git_blob_sha1, to_hf_cache


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """A complete 3-file local-dir snapshot; tests copy it before breaking it."""
    return build_checkpoint(tmp_path_factory.mktemp("pristine") / "ck", fmt="bf16", base=400)


@pytest.fixture
def snap(pristine, tmp_path):
    import shutil

    dst = tmp_path / "ck"
    shutil.copytree(pristine.root, dst)
    # copytree keeps mtimes, so the hf metadata timestamps stay valid
    return dst


def _errors(report):
    return [(f.file, f.message) for f in report.errors]


def test_complete_snapshot_passes_with_hashes(snap, capsys):
    report = verify_snapshot(snap, hash=True)
    assert report.ok, _errors(report)
    assert report.layout == "local-dir" and report.weights == "index"
    by_name = {f.file: f for f in report.files}
    assert by_name["model-00001-of-00003.safetensors"].algorithm == "sha256"
    assert by_name["config.json"].algorithm == "git-sha1"  # small non-LFS file: git blob sha1
    assert all(f.hash_ok for f in report.files)
    code, out, _ = run_in_process(["checkpoint", "verify", str(snap), "--hash", "--json"], capsys)
    doc = json.loads(out)
    assert code == 0 and doc["ok"] and doc["schema_version"] == 1 and doc["hashed"]


def test_git_blob_sha1_matches_git():
    # `printf 'hello\n' | git hash-object --stdin`
    assert git_blob_sha1(b"hello\n") == "ce013625030ba8dba906f756967f9e9ca394464a"


def test_truncated_shard(snap, capsys):
    p = snap / "model-00002-of-00003.safetensors"
    with open(p, "r+b") as fh:
        fh.truncate(p.stat().st_size - 1000)
    report = verify_snapshot(snap)
    errs = _errors(report)
    assert not report.ok
    assert errs[0][0] == "model-00002-of-00003.safetensors" and "truncated" in errs[0][1]
    code, out, _ = run_in_process(["checkpoint", "verify", str(snap)], capsys)
    assert code == 1 and "INCOMPLETE" in out and "truncated" in out


def test_missing_shard(snap):
    (snap / "model-00003-of-00003.safetensors").unlink()
    report = verify_snapshot(snap)
    files = {f for f, _ in _errors(report)}
    assert "model-00003-of-00003.safetensors" in files
    msgs = " ".join(m for _, m in _errors(report))
    assert "missing" in msgs and "re-download" in msgs


def test_incomplete_leftover(snap):
    # where `hf download --local-dir` keeps a partial file: <metadata path minus .metadata>.<etag>.incomplete
    partial = (
        snap / ".cache/huggingface/download/model-00001-of-00003.safetensors.0123abcd.incomplete"
    )
    partial.write_bytes(b"x" * 100)
    report = verify_snapshot(snap)
    assert not report.ok
    assert any(f.endswith(".incomplete") and "partial download" in m for f, m in _errors(report))
    partial.unlink()
    (snap / "stray.bin.incomplete").write_bytes(b"y")
    assert not verify_snapshot(snap).ok


def test_index_header_disagreement(snap):
    index_path = snap / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    wm = index["weight_map"]
    moved = next(t for t, f in wm.items() if f == "model-00001-of-00003.safetensors")
    wm[moved] = "model-00002-of-00003.safetensors"  # the index sends it to the wrong file
    wm["model.language_model.norm.weight"] = "model-00003-of-00003.safetensors"  # in no file
    index_path.write_text(json.dumps(index))
    report = verify_snapshot(snap)
    msgs = _errors(report)
    assert not report.ok
    # the misplaced tensor is reported both ways, and the phantom tensor too
    assert any(f == "model-00002-of-00003.safetensors" and "model-00001" in m for f, m in msgs)
    assert any(f == "model-00001-of-00003.safetensors" and moved in m for f, m in msgs)
    assert any("no file holds" in m and "norm.weight" in m for _, m in msgs)


def test_file_named_nowhere_is_a_warning(snap):
    import shutil

    shutil.copy(snap / "model-00001-of-00003.safetensors", snap / "model-old.safetensors")
    report = verify_snapshot(snap)
    assert report.ok
    assert any(w.file == "model-old.safetensors" for w in report.warnings)


def test_metadata_for_a_missing_file(snap):
    meta = snap / ".cache/huggingface/download/tokenizer.json.metadata"
    meta.write_text(f"{'a' * 40}\n{'b' * 40}\n1712656091.123\n")
    report = verify_snapshot(snap)
    assert ("tokenizer.json" in {f for f, _ in _errors(report)}) and not report.ok


def test_hash_mismatch_same_size(snap):
    """A flipped byte in the data area keeps the header valid: only --hash catches it."""
    p = snap / "model-00001-of-00003.safetensors"
    st = p.stat()
    with open(p, "r+b") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        fh.seek(8 + n + 10)
        b = fh.read(1)
        fh.seek(8 + n + 10)
        fh.write(bytes([b[0] ^ 0xFF]))
    os.utime(p, (st.st_atime, st.st_mtime))
    assert verify_snapshot(snap).ok  # sizes and headers cannot see it
    report = verify_snapshot(snap, hash=True)
    assert not report.ok
    (f, m) = _errors(report)[0]
    assert f == "model-00001-of-00003.safetensors" and "sha256" in m and "expected" in m


def test_single_file_snapshot(tmp_path):
    built = build_checkpoint(tmp_path / "one", files=0, base=400)
    report = verify_snapshot(built.root, hash=True)
    assert report.ok and report.weights == "single"
    with open(built.root / "model.safetensors", "r+b") as fh:
        fh.truncate(1000)
    assert not verify_snapshot(built.root).ok


def test_no_weights_at_all(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    report = verify_snapshot(tmp_path)
    assert not report.ok and "weights are missing" in report.errors[0].message


def test_hf_cache_layout_verifies_by_blob_name(pristine, tmp_path, capsys):
    repo = to_hf_cache(pristine, tmp_path / "hub")
    report = verify_snapshot(repo, hash=True)
    assert report.ok and report.layout == "hf-cache", _errors(report)
    assert all(f.hash_ok and f.expected_from.startswith("blob name") for f in report.files)
    # corrupt one blob: same size, other bytes
    snap_dir = repo / "snapshots" / pristine.commit
    target = snap_dir / "model-00002-of-00003.safetensors"
    blob = target.resolve()
    data = bytearray(blob.read_bytes())
    data[-1] ^= 0x01
    blob.write_bytes(bytes(data))
    report = verify_snapshot(snap_dir, hash=True)  # the snapshot dir itself works too
    assert [f for f, _ in _errors(report)] == ["model-00002-of-00003.safetensors"]
    # a dangling symlink (blob never arrived) and a partial blob
    blob.unlink()
    (repo / "blobs" / (blob.name + ".incomplete")).write_bytes(b"partial")
    code, out, _ = run_in_process(["checkpoint", "verify", str(repo), "--json"], capsys)
    doc = json.loads(out)
    assert code == 1 and not doc["ok"]
    msgs = " ".join(f["message"] for f in doc["findings"])
    assert "dangling" in msgs and "partial download" in msgs


def test_file_digest_algorithms(tmp_path, rng):
    import hashlib

    p = tmp_path / "f"
    data = rng.bytes(3 << 20)
    p.write_bytes(data)
    seen = []
    assert file_digest(p, "sha256", seen.append, chunk=1 << 20) == hashlib.sha256(data).hexdigest()
    assert sum(seen) == len(data) and len(seen) == 3
    assert file_digest(p, "git-sha1") == git_blob_sha1(data)


@pytest.mark.parametrize(
    "name", ["../outside.safetensors", "sub/../../outside.safetensors", "/etc/hostname"]
)
def test_index_entry_outside_the_snapshot_is_refused(snap, tmp_path, capsys, name):
    """An index may only name files inside its snapshot; `../` is never followed."""
    import shutil

    from flashnext.checkpoint import tensor_map
    from flashnext.errors import CheckpointError

    shutil.copy(snap / "model-00001-of-00003.safetensors", tmp_path / "outside.safetensors")
    index_path = snap / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    tensor = next(iter(index["weight_map"]))
    index["weight_map"][tensor] = name
    index_path.write_text(json.dumps(index))
    report = verify_snapshot(snap)
    assert not report.ok
    (f, m) = _errors(report)[0]
    assert f == "model.safetensors.index.json" and repr(tensor) in m and repr(name) in m
    assert "outside the snapshot" in m
    with pytest.raises(CheckpointError, match="outside the snapshot"):
        tensor_map(snap)
    code, _, err = run_in_process(["checkpoint", "ple", str(snap)], capsys)
    assert code == 1 and err.count("\n") == 1 and "outside the snapshot" in err


@pytest.mark.parametrize(
    ("text", "kind"), [("[1, 2]", "array"), ('"x"', "string"), ("3", "number")]
)
def test_config_that_is_not_an_object_fails_verify(snap, capsys, text, kind):
    (snap / "config.json").write_text(text)
    report = verify_snapshot(snap)
    assert [(f, m) for f, m in _errors(report)] == [
        ("config.json", f"a JSON {kind}, expected an object of config fields; re-download it")
    ]
    code, _, err = run_in_process(["checkpoint", "verify", str(snap)], capsys)
    assert code == 1 and err.startswith("error: ") and err.count("\n") == 1


def test_bad_ple_field_names_config_json_and_the_fix(snap, capsys):
    config = json.loads((snap / "config.json").read_text())
    config["ple_embed_dim"] = 2561
    (snap / "config.json").write_text(json.dumps(config))
    code, _, err = run_in_process(["checkpoint", "ple", str(snap)], capsys)
    assert code == 1 and err.count("\n") == 1
    assert err.startswith(f"error: {snap / 'config.json'}: ") and "ple_embed_dim" in err
    assert "correct the field in config.json" in err


def test_verify_json_is_a_record(snap, capsys):
    from flashnext.records import check_record

    code, out, err = run_in_process(["checkpoint", "verify", str(snap), "--json"], capsys)
    doc = check_record(json.loads(out), kind="flashnext.checkpoint.verify", schema_version=1)
    assert code == 0 and doc["ok"] and err == ""


def test_empty_shard_note_is_data(tmp_path, capsys):
    from flashnext.checkpoint.ple_report import LAYOUT_NOTES, report_ple_tables

    built = build_checkpoint(tmp_path / "ck", base=400, layout="empty-shard")
    (report,) = report_ple_tables(built.root, tp_size=2)
    assert report.notes == [LAYOUT_NOTES["empty-shard"]] and len(report.ranks) == 2
    assert report.to_dict()["notes"] == report.notes
    code, out, _ = run_in_process(["checkpoint", "ple", str(built.root)], capsys)
    assert code == 0 and f"note: {LAYOUT_NOTES['empty-shard']}" in " ".join(out.split())
    (plain,) = report_ple_tables(build_checkpoint(tmp_path / "ck2", base=400).root)
    assert plain.notes == [] and plain.ranks == []

"""``flashnext ple slice``: a node's ranks' shards, byte for byte, and what serves from them.

Real sidecars on disk, the real CLI (``tests/cli/runner.py``); lookups from the slice are
compared with the full sidecar's and with the numpy reference (other ranks' ids give 0).
"""

from __future__ import annotations

import filecmp
import json
import shutil

import numpy as np
import pytest

from flashnext.errors import SidecarError
from flashnext.host.table import open_table
from flashnext.store import write_sidecar
from flashnext.store.sidecar import open_sidecar

from .runner import run_here as run
from .runner import run_in_process

ROWS, PER_SHARD, TP = 1000, 128, 4  # rank r: rows [250 r, 250 (r + 1)); shards of 128 rows


@pytest.fixture
def full(tmp_path, rng):
    rows = rng.standard_normal((ROWS, 32)).astype(np.float32)
    return write_sidecar(tmp_path / "full", "int4", rows, PER_SHARD).path


def test_slice_copies_the_ranks_shards_and_serves_them_identically(full, tmp_path, rng, capsys):
    dst = tmp_path / "node1"
    code, out, err = run_in_process(
        ["ple", "slice", full, dst, "--tp", TP, "--ranks", "2,1"], capsys
    )
    assert code == 0, err
    assert "5 of 8 shards" in out and "rows 128..768 of 1000" in out
    names = sorted(p.name for p in dst.iterdir())
    assert names == ["META.json"] + [f"shard_{k}.safetensors" for k in range(1, 6)]
    for k in range(1, 6):
        name = f"shard_{k}.safetensors"
        assert filecmp.cmp(full / name, dst / name, shallow=False)
    meta = json.loads((dst / "META.json").read_text())
    assert meta["rows_present"] == [[128, 768]] and meta["num_rows"] == ROWS
    assert meta["slice"]["ranks"] == [1, 2] and meta["num_shards"] == 8
    assert open_sidecar(dst).verify_checksums() == []
    code, out, err = run_in_process(["ple", "info", dst, "--json"], capsys)
    info = json.loads(out)
    assert code == 0 and info["rows_present"] == [[128, 768]] and info["checksums"] == "ok", err
    assert info["resident_bytes"] == 640 * info["bytes_per_row"] and info["num_shards"] == 5
    ids = rng.integers(-1, ROWS, size=(64, 3))
    want_all = open_table(full).reference_lookup(ids)  # the plain numpy path, every row
    for rank in (1, 2):
        lo, hi = rank * 250, (rank + 1) * 250
        for residency in ("mmap", "resident"):
            got = open_table(dst, residency, row_range=(lo, hi)).lookup(ids)
            ref = open_table(full, residency, row_range=(lo, hi)).lookup(ids)
            np.testing.assert_array_equal(got, ref)
            want = np.where(((ids >= lo) & (ids < hi))[..., None], want_all, 0)
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_a_slice_refuses_rows_it_does_not_hold_naming_them(full, tmp_path, capsys):
    dst = tmp_path / "node"
    assert run_in_process(["ple", "slice", full, dst, "--tp", TP, "--ranks", 1], capsys)[0] == 0
    with pytest.raises(SidecarError, match=r"rows 0\.\.250 needs rows 0\.\.128, which it does"):
        open_table(dst, row_range=(0, 250))
    with pytest.raises(SidecarError, match=r"whole table .* needs rows 0\.\.128, 512\.\.1000"):
        open_table(dst)
    code, _, err = run_in_process(["ple", "slice", dst, tmp_path / "x", "--tp", TP, "--ranks", 2],
                                  capsys)  # fmt: skip
    assert code == 1 and "rank 2 of 4 serves rows 500..750" in err and err.count("\n") == 1
    sub = tmp_path / "sub"
    assert run_in_process(["ple", "slice", dst, sub, "--tp", 8, "--ranks", 3], capsys)[0] == 0
    assert json.loads((sub / "META.json").read_text())["rows_present"] == [[256, 512]]


def test_a_changed_source_shard_is_refused_and_not_copied(full, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(full, src)
    blob = bytearray((src / "shard_3.safetensors").read_bytes())
    blob[-1] ^= 0xFF  # a row byte: the header still parses, the checksum does not match
    (src / "shard_3.safetensors").write_bytes(bytes(blob))
    proc = run("ple", "slice", src, tmp_path / "out", "--tp", TP, "--ranks", 1)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "shard_3.safetensors: sha256" in lines[0], proc.stderr
    assert not (tmp_path / "out" / "shard_3.safetensors").exists()
    assert not (tmp_path / "out" / "META.json").exists()
    # what it left is an unfinished slice: refused by readers, naming the command ...
    info = run("ple", "info", tmp_path / "out")
    assert info.returncode == 1 and "unfinished: 2 of 3 shards" in info.stderr, info.stderr
    assert "flashnext ple slice" in info.stderr
    # ... and the same command resumes it once the source is whole again, keeping the copy
    kept = [(tmp_path / "out" / f"shard_{k}.safetensors").stat().st_ino for k in (1, 2)]
    blob[-1] ^= 0xFF
    (src / "shard_3.safetensors").write_bytes(bytes(blob))
    again = run("ple", "slice", src, tmp_path / "out", "--tp", TP, "--ranks", 1)
    assert again.returncode == 0, again.stderr
    assert [(tmp_path / "out" / f"shard_{k}.safetensors").stat().st_ino for k in (1, 2)] == kept
    assert sorted(q.name for q in (tmp_path / "out").iterdir()) == ["META.json"] + [
        f"shard_{k}.safetensors" for k in (1, 2, 3)]  # fmt: skip
    assert open_sidecar(tmp_path / "out").verify_checksums() == []
    # another slice (other ranks) is not this command's: refused, kept, unless --force
    before = {q.name: q.read_bytes() for q in (tmp_path / "out").iterdir()}
    other = run("ple", "slice", src, tmp_path / "out", "--tp", TP, "--ranks", 2)
    assert other.returncode == 1 and "a finished table that differs (slice" in other.stderr
    assert "--force" in other.stderr and other.stderr.count("\n") == 1, other.stderr
    assert {q.name: q.read_bytes() for q in (tmp_path / "out").iterdir()} == before
    forced = run("ple", "slice", src, tmp_path / "out", "--tp", TP, "--ranks", 2, "--force")
    assert forced.returncode == 0, forced.stderr
    assert open_sidecar(tmp_path / "out").rows_present == ((384, 768),)


def test_a_slice_missing_or_with_a_stray_shard_is_refused(full, tmp_path, capsys):
    dst = tmp_path / "node"
    assert run_in_process(["ple", "slice", full, dst, "--tp", TP, "--ranks", 1], capsys)[0] == 0
    shutil.copy(full / "shard_6.safetensors", dst)
    with pytest.raises(SidecarError, match=r"shard_6\.safetensors hold rows outside rows_present"):
        open_sidecar(dst)
    (dst / "shard_6.safetensors").unlink()
    (dst / "shard_2.safetensors").unlink()
    with pytest.raises(SidecarError, match=r"missing shard_2\.safetensors \(1 of the 3 shards"):
        open_sidecar(dst)


def test_dst_with_a_file_it_did_not_write_is_refused(full, tmp_path, capsys):
    dst = tmp_path / "node"
    dst.mkdir()
    (dst / "shard_1.safetensors").write_text("mine\n")
    code, _, err = run_in_process(["ple", "slice", full, dst, "--tp", TP, "--ranks", 1], capsys)
    assert code == 1 and "holds shard_1.safetensors but no flashnext META.json" in err, err
    assert (dst / "shard_1.safetensors").read_text() == "mine\n"


def test_checkpoint_ple_prints_the_slice_command(cli_inputs, capsys):
    code, out, err = run_in_process(["checkpoint", "ple", cli_inputs.checkpoint, "--tp", 2], capsys)
    assert code == 0, err
    assert "a node's ranks only: flashnext ple slice SIDECAR/layer_" in out
    assert "--tp 2 --ranks R[,R...]" in out


@pytest.mark.parametrize("name", ["profile.safetensors", "hot_rows.safetensors"])
def test_the_profile_comes_along_inside_the_slice(full, tmp_path, capsys, name):
    """Under its name, also when the sidecar's has the name before issue 43."""
    from flashnext.store.profile import RowProfile, load_profile, write_profile

    ids = np.array([700, 3, 260, 999], dtype=np.int64)
    written = write_profile(full, RowProfile(ids, np.array([9, 5, 2, 1]), 20, {"layer": 0}))
    assert written == tmp_path / "full.profile.safetensors"  # ple profile's default: beside
    written = written.rename(tmp_path / f"full.{name}")
    dst = tmp_path / "node"
    assert run_in_process(["ple", "slice", full, dst, "--tp", TP, "--ranks", 1], capsys)[0] == 0
    assert filecmp.cmp(written, dst / "profile.safetensors", shallow=False)
    assert not (dst / "hot_rows.safetensors").exists()
    np.testing.assert_array_equal(load_profile(dst).row_ids, ids)


def test_quantizing_a_slice_is_refused_before_anything_is_written(full, tmp_path, capsys):
    dst = tmp_path / "node"
    assert run_in_process(["ple", "slice", full, dst, "--tp", TP, "--ranks", 1], capsys)[0] == 0
    proc = run("ple", "quantize", dst, tmp_path / "q", "--format", "fp8")
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
    assert "a slice (rows 128..512 of 1000" in proc.stderr and "quantize the full" in proc.stderr
    assert not (tmp_path / "q").exists()
    assert [p.name for p in tmp_path.iterdir() if "flashnext" in p.name] == []


def test_ple_lookup_reads_a_slice_where_it_holds_rows(full, tmp_path, rng, capsys):
    dst = tmp_path / "node"  # ranks 0 and 2 of 4: shards 0-1 and 3-5, rows 0..256 and 384..768
    assert run_in_process(["ple", "slice", full, dst, "--tp", TP, "--ranks", "0,2"], capsys)[0] == 0
    for lo, hi in ((0, 256), (384, 768)):
        ids = [*rng.integers(lo, hi, size=4).tolist(), -1]
        text = ",".join(map(str, ids))
        code, out, err = run_in_process(["ple", "lookup", dst, "--ids", text, "--json"], capsys)
        assert code == 0, err
        want = open_table(full).reference_lookup(np.array(ids))
        np.testing.assert_array_equal(np.array(json.loads(out)["rows"], np.float32), want)
    outside = int(rng.integers(256, 384))
    code, _, err = run_in_process(["ple", "lookup", dst, "--ids", str(outside)], capsys)
    assert code == 1 and f"row {outside} is not in" in err and "rows 0..256, 384..768" in err
    code, _, err = run_in_process(["ple", "lookup", dst, "--ids", "3,600"], capsys)
    assert code == 1 and "two ranges of the slice" in err, err

"""Per-rank sidecars (``flashnext.ple.slicing``): byte-identical shards, rows_present, refusals."""

from __future__ import annotations

import numpy as np
import pytest

from flashnext.errors import SidecarError
from flashnext.ple import open_table, write_sidecar
from flashnext.ple.sidecar import open_sidecar
from flashnext.ple.slicing import rank_rows, slice_sidecar
from flashnext.synthetic import embedding_rows

ROWS, WIDTH, SHARD = 1000, 32, 128  # 8 shards, the last of 104 rows


@pytest.fixture
def full(tmp_path, rng):
    return write_sidecar(tmp_path / "full", "int4", embedding_rows(ROWS, WIDTH, rng), SHARD)


def test_a_rank_slice_serves_its_rows_like_the_full_sidecar(full, tmp_path, rng):
    start, end = rank_rows(ROWS, 4, 1)
    assert (start, end) == (250, 500)
    part = slice_sidecar(full.path, tmp_path / "rank1", 4, [1])
    assert part.rows_present == (128, 512) and part.num_rows == ROWS
    assert [s.path.name for s in part.shards] == [f"shard_{k}.safetensors" for k in (1, 2, 3)]
    for shard in part.shards:  # copied byte for byte
        assert shard.path.read_bytes() == (full.path / shard.path.name).read_bytes()
    ids = rng.integers(-1, ROWS, size=(300, 4))
    got = open_table(part.path, row_range=(start, end)).lookup(ids)
    want = open_table(full.path, row_range=(start, end)).lookup(ids)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert np.count_nonzero(got) > 0  # some ids fall inside the rank's rows


def test_rows_outside_the_slice_are_refused_by_name(full, tmp_path):
    part = slice_sidecar(full.path, tmp_path / "r1", 4, [1])
    with pytest.raises(SidecarError, match=r"rows 128\.\.512 of 1000; rows 0\.\.1000 were asked "
                       r"for and rows 0\.\.128, 512\.\.1000 are missing"):  # fmt: skip
        open_table(part.path)
    with pytest.raises(SidecarError, match=r"rows 512\.\.750 are missing"):
        open_table(part.path, row_range=(500, 750))
    two = slice_sidecar(full.path, tmp_path / "r23", 4, [3, 2])
    assert two.rows_present == (384, 1000)
    open_table(two.path, row_range=(500, 1000))  # both ranks' rows


def test_bad_slices_are_refused(full, tmp_path):
    with pytest.raises(SidecarError, match="not consecutive"):
        slice_sidecar(full.path, tmp_path / "x", 4, [0, 2])
    with pytest.raises(SidecarError, match="do not split into 3"):
        slice_sidecar(full.path, tmp_path / "x", 3, [0])
    with pytest.raises(SidecarError, match=r"rank 4 is not in \[0, 4\)"):
        slice_sidecar(full.path, tmp_path / "x", 4, [4])
    with pytest.raises(SidecarError, match="lies inside the input"):
        slice_sidecar(full.path, full.path / "inner", 4, [0])
    (tmp_path / "taken").mkdir()
    with pytest.raises(SidecarError, match="already exists"):
        slice_sidecar(full.path, tmp_path / "taken", 4, [0])
    assert not list(tmp_path.glob(".*slice-partial"))


def test_a_damaged_source_shard_is_not_copied(full, tmp_path):
    victim = full.path / "shard_1.safetensors"
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF  # a payload byte: the header still parses, the sha256 differs
    victim.write_bytes(bytes(data))
    with pytest.raises(SidecarError, match=r"shard_1\.safetensors: the copy.s sha256"):
        slice_sidecar(full.path, tmp_path / "r0", 4, [0])
    assert not (tmp_path / "r0").exists()


def test_a_partial_sidecar_missing_a_shard_is_refused(full, tmp_path):
    part = slice_sidecar(full.path, tmp_path / "r1", 4, [1])
    (part.path / "shard_2.safetensors").unlink()
    with pytest.raises(SidecarError, match=r"missing shard_2\.safetensors"):
        open_sidecar(part.path)


def _flashnext(*args):
    """The installed command (a local call until tests/cli/runner.py lands on main)."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "flashnext", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_the_slice_command(full, tmp_path):
    import json

    run = _flashnext("ple", "slice", full.path, tmp_path / "r3", "--tp", "4", "--ranks", "3",
                     "--json")  # fmt: skip
    assert run.returncode == 0, run.stderr
    record = json.loads(run.stdout)
    assert record["kind"] == "flashnext.ple.slice"
    assert record["rows_present"] == [640, 1000] and record["shards"] == 3
    bad = _flashnext("ple", "slice", full.path, tmp_path / "x", "--tp", "4", "--ranks", "a")
    assert bad.returncode == 2 and "--ranks" in bad.stderr
    gap = _flashnext("ple", "slice", full.path, tmp_path / "x", "--tp", "4", "--ranks", "0,2")
    assert gap.returncode == 1
    assert gap.stderr.strip().splitlines() == [
        "error: --ranks 0,2: not consecutive; a slice holds one contiguous row range: slice "
        "each run of ranks into its own directory"
    ]

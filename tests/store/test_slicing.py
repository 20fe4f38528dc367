"""The slice plan (``flashnext.store.slicing``): which rows each rank serves, which shards hold
them, and the refusals; a slice's destination (resume, refusal, force, lock) as every sidecar
writer's; the CLI, the copies and the lookups are in tests/cli/test_ple_slice.py."""

from __future__ import annotations

import pytest

from flashnext.errors import SidecarError
from flashnext.store import write_sidecar
from flashnext.store.destination import DestinationLock
from flashnext.store.sidecar import STATE_NAME, open_sidecar
from flashnext.store.slicing import plan_slice, rank_rows, write_slice
from flashnext.synthetic import embedding_rows

ROWS, WIDTH, SHARD = 1000, 32, 128  # 8 shards, the last of 104 rows


@pytest.fixture
def full(tmp_path, rng):
    return write_sidecar(tmp_path / "full", "int4", embedding_rows(ROWS, WIDTH, rng), SHARD)


def test_rank_rows_split_the_table_evenly():
    assert [rank_rows(ROWS, 4, r) for r in range(4)] == [(0, 250), (250, 500), (500, 750),
                                                         (750, 1000)]  # fmt: skip
    with pytest.raises(SidecarError, match="do not split evenly"):
        rank_rows(ROWS, 3, 0)
    with pytest.raises(SidecarError, match="not a rank of a tensor-parallel group of 4"):
        rank_rows(ROWS, 4, 4)


def test_disjoint_ranks_give_disjoint_rows_present(full):
    plan = plan_slice(full, 4, [2, 0])
    assert plan.ranks == (0, 2) and plan.rank_rows == ((0, 250), (500, 750))
    assert [sh.index for sh in plan.shards] == [0, 1, 3, 4, 5]
    assert plan.rows_present == ((0, 256), (384, 768))


def test_slicing_a_slice_needs_the_ranks_rows_in_it(full, tmp_path):
    part = open_sidecar(write_slice(full, tmp_path / "r1", plan_slice(full, 4, [1])))
    assert part.rows_present == ((128, 512),) and part.missing_rows(0, 600) == [(0, 128),
                                                                                (512, 600)]  # fmt: skip
    assert plan_slice(part, 4, [1]).rows_present == ((128, 512),)
    with pytest.raises(SidecarError, match=r"rank 2 of 4 serves rows 500\.\.750, but this slice "
                       r"holds only rows 128\.\.512"):  # fmt: skip
        plan_slice(part, 4, [2])


def _files(root):
    return {p.name: p.read_bytes() for p in sorted(root.iterdir())}


class Interrupt(Exception):
    """Raised from the progress callback: the copy stops mid-slice, as a killed run would."""


def test_an_interrupted_slice_resumes_keeping_its_copies(full, tmp_path):
    plan = plan_slice(full, 4, [1, 2])  # shards 1..5
    clean = _files(write_slice(full, tmp_path / "clean", plan))
    dst = tmp_path / "dst"
    copied = []

    def stop_after_two(n):
        copied.extend([n] if n else [])
        if len(copied) == 3:  # each shard is one chunk here: two are whole, the third is not
            raise Interrupt

    with pytest.raises(Interrupt):
        write_slice(full, dst, plan, progress=stop_after_two)
    assert (dst / STATE_NAME).is_file() and not (dst / "META.json").exists()
    with pytest.raises(SidecarError, match="unfinished"):
        open_sidecar(dst)
    assert sorted(p.name for p in dst.iterdir()) == [STATE_NAME, "shard_1.safetensors",
                                                      "shard_2.safetensors"]  # fmt: skip
    first = {name: (dst / name).stat().st_ino for name in ("shard_1.safetensors", "shard_2.safetensors")}
    write_slice(full, dst, plan)
    assert {name: (dst / name).stat().st_ino for name in first} == first  # kept, not redone
    assert _files(dst) == {**clean, "META.json": _files(dst)["META.json"]}
    assert open_sidecar(dst).rows_present == plan.rows_present
    # finished: the same slice again leaves every file as it is
    before = {p.name: p.stat().st_mtime_ns for p in dst.iterdir()}
    write_slice(full, dst, plan)
    assert {p.name: p.stat().st_mtime_ns for p in dst.iterdir()} == before


def test_a_directory_holding_anything_else_is_refused_and_kept(full, tmp_path):
    foreign = tmp_path / "notes"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("the user's own\n")
    with pytest.raises(SidecarError, match=r"files this command did not write \(notes\.txt\)"):
        write_slice(full, foreign, plan_slice(full, 4, [1]))
    assert _files(foreign) == {"notes.txt": b"the user's own\n"}
    # another slice (other ranks) of the same table is not this one: refused, kept whole
    other = write_slice(full, tmp_path / "other", plan_slice(full, 4, [3]))
    before = _files(other)
    with pytest.raises(SidecarError, match=r"a finished table that differs \(slice .*--force"):
        write_slice(full, other, plan_slice(full, 4, [1]))
    assert _files(other) == before


def test_force_writes_beside_and_swaps_in_once_complete(full, tmp_path):
    dst = write_slice(full, tmp_path / "node", plan_slice(full, 4, [3]))
    old = _files(dst)
    seen = []

    def look(n):  # during the copy the old slice is whole and the new one grows beside it
        seen.append((_files(dst) == old, (tmp_path / ".node.flashnext-new").is_dir()))

    write_slice(full, dst, plan_slice(full, 4, [0]), progress=look, force=True)
    assert seen and all(seen_old and beside for seen_old, beside in seen)
    assert open_sidecar(dst).rows_present == ((0, 256),)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full", "node"]  # nothing left beside
    # --force replaces a sidecar, never a folder of other things
    (tmp_path / "folder" / "sub").mkdir(parents=True)
    with pytest.raises(SidecarError, match="holds directories"):
        write_slice(full, tmp_path / "folder", plan_slice(full, 4, [0]), force=True)


def test_a_second_writer_is_refused_while_the_first_holds_the_lock(full, tmp_path):
    dst = tmp_path / "node"
    with DestinationLock(dst):  # a writer of dst, holding its lock (processes: test_writers_meet)
        with pytest.raises(SidecarError, match=r"another flashnext process \(pid \d+\) is writing"):
            write_slice(full, dst, plan_slice(full, 4, [1]))
        assert not dst.exists()
    assert open_sidecar(write_slice(full, dst, plan_slice(full, 4, [1]))).rows_present

"""The slice plan (``flashnext.store.slicing``): which rows each rank serves, which shards hold
them, and the refusals; the CLI, the copies and the lookups are in tests/cli/test_ple_slice.py."""

from __future__ import annotations

import pytest

from flashnext.errors import SidecarError
from flashnext.store import write_sidecar
from flashnext.store.sidecar import open_sidecar
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

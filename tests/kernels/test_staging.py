"""The staged path's host work (``HostStager``: dedup + gather into a staging slot), no torch.

Every id of a step must resolve to the row the table stores (its record bytes packed from the
table's own ``gather_raw``, its nvfp4 scale_2 from the shard), a cached row to its cache slot,
an id outside the served rows to nothing; misses are staged once each; the slot map is the
same after a step as before it (the dedup marks it while the step runs). Small steps run on
one thread, big ones on numba's threads (and without a cache through numpy's sort): both
thresholds are crossed here. The GPU side of the same slots is tests/kernels/test_lookup.py.
"""

import numpy as np
import pytest

from flashnext.errors import KernelError
from flashnext.host import open_table
from flashnext.kernels.records import pack_records, record_layout
from flashnext.kernels.stager import HostStager, StageKnobs, flat_ids
from flashnext.store import write_sidecar
from flashnext.synthetic import embedding_rows

from ..seeding import seeded_rng

ROWS, WIDTH, HEADS = 1000, 160, 16
LO, HI = 100, 1000


@pytest.fixture(scope="module")
def tables(tmp_path_factory, request):
    x = embedding_rows(ROWS, WIDTH, seeded_rng(request.node.nodeid, request.fixturename))
    root = tmp_path_factory.mktemp("staging_tables")
    for fmt in ("int4", "nvfp4"):
        write_sidecar(root / fmt, fmt, x, 128)  # 8 shards: nvfp4 has 8 scale_2 values
    return root


def _stager(root, fmt, max_ids, **knobs):
    table = open_table(root / fmt, "mmap", row_range=(LO, HI))
    layout = record_layout(table.codec, table.width)
    knobs.setdefault("workers", 2)
    stager = HostStager(table.stored(), layout, table.row_range, max_ids, StageKnobs(**knobs))
    slot = np.full(stager.slot_bytes, 0xAB, np.uint8)  # stale bytes: every used byte rewritten
    stager.add_slot(slot)
    return table, layout, stager, slot


def _check_step(table, layout, stager, slot, ids, cached):
    """Fill one step and check every id against the table (``cached``: row -> cache slot)."""
    before = None if stager.slot_map is None else stager.slot_map.copy()
    n_unique = stager.fill(0, flat_ids(ids))
    flat = ids.reshape(-1)
    s2_at, rec_at, _ = stager.offsets(flat.size, n_unique)
    inverse = slot[: 4 * flat.size].view(np.int32)
    rb = layout.record_bytes
    records = slot[rec_at : rec_at + n_unique * rb].reshape(n_unique, rb)
    inside = (flat >= LO) & (flat < HI)
    hit = np.array([inside[i] and int(r) in cached for i, r in enumerate(flat)], bool)
    miss = inside & ~hit
    assert n_unique == len(set(flat[miss].tolist()))  # each missed row staged once
    assert (inverse[~inside] == -1).all()
    assert [-(int(v) + 2) for v in inverse[hit]] == [cached[int(r)] for r in flat[hit]]
    assert (inverse[miss] >= 0).all() and (inverse[miss] < n_unique).all()
    want = pack_records(layout, table.gather_raw(flat[miss]))
    np.testing.assert_array_equal(records[inverse[miss]], want)
    if table.format == "nvfp4":
        s2 = slot[s2_at : s2_at + 4 * n_unique].view(np.float32)
        starts = np.asarray(table.stored().shard_starts)
        scalars = np.asarray(table.stored().shard_scalars["weight_scale_2"], np.float32)
        shard = np.searchsorted(starts, flat[miss], "right") - 1
        np.testing.assert_array_equal(s2[inverse[miss]], scalars[shard])
    if before is not None:
        np.testing.assert_array_equal(stager.slot_map, before)  # the dedup's marks are gone
    return n_unique


@pytest.mark.parametrize("fmt", ["int4", "nvfp4"])
@pytest.mark.parametrize("serial_rows", [1 << 20, 3, -1], ids=["one-thread", "mixed", "threads"])
def test_staged_rows_without_a_cache(tables, fmt, serial_rows, rng):
    table, layout, stager, slot = _stager(tables, fmt, 300 * HEADS, serial_rows=serial_rows)
    for t in (300, 1, 7, 40):
        ids = rng.integers(-1, ROWS + 40, size=(t, HEADS))
        ids[0, :3] = [-1, LO - 1, HI]
        _check_step(table, layout, stager, slot, ids, {})


@pytest.mark.parametrize("fmt", ["int4", "nvfp4"])
@pytest.mark.parametrize("serial_rows", [1 << 20, 3, -1], ids=["one-thread", "mixed", "threads"])
def test_staged_rows_behind_a_cache(tables, fmt, serial_rows, rng):
    parallel_ids = 1 if serial_rows < 0 else 1 << 30  # slot map read on threads first
    table, layout, stager, slot = _stager(
        tables, fmt, 300 * HEADS, serial_rows=serial_rows, parallel_ids=parallel_ids
    )
    hot = rng.permutation(ROWS)
    priority = np.concatenate([[-5, ROWS + 3, 50, hot[0]], hot])
    records, s2 = stager.cache_rows(priority, 300 * layout.record_bytes + 7)
    kept = sorted([int(r) for r in dict.fromkeys(priority.tolist()) if LO <= r < HI][:300])
    cached = {r: j for j, r in enumerate(kept)}  # slot j: the j-th kept row, ascending
    np.testing.assert_array_equal(records, pack_records(layout, table.gather_raw(np.array(kept))))
    assert s2.size == (300 if fmt == "nvfp4" else 0)
    for t in (300, 2, 33, 1):  # hits, misses, repeats, -1 and rows outside in one step
        ids = rng.integers(-1, ROWS + 40, size=(t, HEADS))
        ids[0, :3] = [-1, LO - 1, HI]
        ids[-1, -4:] = [kept[0], kept[0], ids[0, 5], ids[0, 5]]
        _check_step(table, layout, stager, slot, ids, cached)
    all_hits = np.array(kept[: 2 * HEADS]).reshape(2, HEADS)
    assert _check_step(table, layout, stager, slot, all_hits, cached) == 0
    stager.cache_rows(priority, 0)  # off again
    assert stager.slot_map is None
    _check_step(table, layout, stager, slot, rng.integers(0, ROWS, size=(5, HEADS)), {})


def test_bad_slots_and_sizes_are_named(tables):
    table = open_table(tables / "int4", "mmap")
    layout = record_layout(table.codec, table.width)
    with pytest.raises(KernelError, match="max_ids is"):
        HostStager(table.stored(), layout, table.row_range, (1 << 21) + 1)
    stager = HostStager(table.stored(), layout, table.row_range, 64)
    with pytest.raises(KernelError, match="a staging slot is uint8"):
        stager.add_slot(np.zeros(stager.slot_bytes - 1, np.uint8))


def test_the_hit_index_gives_each_cached_row_its_rank(rng):
    """Every served row looked up once: cached rows get their rank among the cached rows (the
    slot ``cache_rows`` gives them), across 64-row words and 384-row blocks."""
    from flashnext.kernels._layout import HIT_BLOCK
    from flashnext.kernels.dedup import build_hit_index, dedup_misses

    lo, n = 1000, 100_003
    rows = np.sort(rng.choice(n, size=n // 9, replace=False)) + lo
    rows[:4] = [lo, lo + 63, lo + HIT_BLOCK - 1, lo + HIT_BLOCK]  # word and block edges
    rows = np.unique(rows)
    index = np.zeros((-(-n // HIT_BLOCK), 8), np.uint64)
    build_hit_index(rows, lo, index)
    slot_map = np.full(n, -1, np.int32)
    slot_map[rows - lo] = np.arange(rows.size, dtype=np.int32)
    before = slot_map.copy()
    ids = np.arange(lo - 5, lo + n + 5, dtype=np.int64)
    inverse = np.empty(ids.size, np.int32)
    uniq = np.empty(ids.size, np.int64)
    pos = np.empty(ids.size, np.int64)
    n_unique = dedup_misses(ids, lo, lo + n, index, slot_map, inverse, uniq, pos)
    inside = (ids >= lo) & (ids < lo + n)
    cached = np.isin(ids, rows)
    np.testing.assert_array_equal(inverse[~inside], -1)
    np.testing.assert_array_equal(inverse[cached], -(np.searchsorted(rows, ids[cached]) + 2))
    missed = inside & ~cached
    assert n_unique == missed.sum()
    np.testing.assert_array_equal(inverse[missed], np.arange(n_unique))
    np.testing.assert_array_equal(uniq[:n_unique], ids[missed])
    np.testing.assert_array_equal(slot_map, before)


@pytest.mark.parametrize("kind", ["equal", "irregular", "one"])
def test_the_segment_directory_finds_every_rows_segment(kind, rng):
    """``_find`` through ``segment_directory`` gives each row the segment a binary search
    gives, for shards of one size (the released layout), of random sizes (other writers,
    partial sidecars) and a single one; the directory stays small (4 to 8 blocks a segment)."""
    import numba

    from flashnext.kernels.gather import _find, segment_directory

    first = int(rng.integers(0, 5000))
    if kind == "equal":
        sizes = np.full(128, int(rng.integers(1000, 3000)))
    elif kind == "irregular":
        sizes = rng.integers(1, 5000, size=int(rng.integers(2, 300)))
        sizes[rng.integers(0, sizes.size, 3)] = 1  # one-row segments among big ones
    else:
        sizes = np.array([int(rng.integers(1, 100_000))])
    seg_start = first + np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    end = first + int(sizes.sum())
    seg_dir, shift = segment_directory(seg_start, end)
    assert seg_dir.size <= 8 * seg_start.size + 2

    @numba.njit
    def find_all(rows, seg_start, seg_dir, shift):  # type: ignore[no-untyped-def]
        out = np.empty(rows.size, np.int64)
        for i in range(rows.size):
            out[i] = _find(rows[i], seg_start, seg_dir, shift)
        return out

    rows = np.concatenate([np.arange(first, min(end, first + 3000)), seg_start,
                           seg_start[1:] - 1, [end - 1], rng.integers(first, end, 20_000)])  # fmt: skip
    want = np.searchsorted(seg_start, rows, "right") - 1
    np.testing.assert_array_equal(find_all(rows.astype(np.int64), seg_start, seg_dir, shift), want)


def test_the_knobs_reach_the_step_context(tables, rng):
    """A step's call reads its settings from a context built once per slot (``stage_step``):
    each knob given at construction is in the context, the device cache's state follows
    ``cache_rows``, a new slot gets a context of its own, and the steps stay exact."""
    from flashnext.kernels._layout import AT, LAYOUT_ID

    for knob, value in (("serial_rows", -1), ("depth", 3), ("hash_ids", 0)):
        table, layout, stager, slot = _stager(tables, "int4", 300 * HEADS, **{knob: value})
        stager.cache_rows(rng.permutation(ROWS), 100 * layout.record_bytes)
        cached = {int(r): j for j, r in enumerate(np.flatnonzero(stager.slot_map >= 0) + LO)}
        assert stager._context(0)[getattr(AT, knob)] == value, knob
        assert stager._context(0)[AT.layout_id] == LAYOUT_ID
        _check_step(table, layout, stager, slot, rng.integers(0, ROWS, size=(9, HEADS)), cached)
    assert stager._context(0)[AT.cached] == 1
    stager.cache_rows(np.empty(0, np.int64), 0)
    assert stager._context(0)[AT.cached] == 0
    second = np.full(stager.slot_bytes, 0xCD, np.uint8)
    assert stager.add_slot(second) == 1
    assert stager._context(1)[AT.words] == second.ctypes.data


@pytest.mark.parametrize("memo_lines", [1 << 20, 4, 2], ids=["big", "colliding", "two-lines"])
def test_the_group_memo_changes_no_result(tables, memo_lines, rng):
    """Small steps behind a cache resolve a token's 8 ids of one n-gram order through a memo
    of whole groups (``classify_grouped``) before the hit index. Steps that repeat earlier
    groups (in other tokens' places), groups with ids outside the served rows, a memo so small
    that every group evicts another, a tail of ids that fills no group, a new cache (whose
    memo starts empty) and a second stager sharing the cache all resolve every id exactly as
    the table and the cache say."""
    from flashnext.kernels.dedup import GROUP

    table, layout, stager, slot = _stager(tables, "int4", 300 * HEADS, memo_lines=memo_lines)
    knobs = StageKnobs(workers=2, memo_lines=memo_lines)  # of one size: the two share one memo
    other = HostStager(table.stored(), layout, table.row_range, 300 * HEADS, knobs)
    other_slot = np.full(other.slot_bytes, 0xEF, np.uint8)
    other.add_slot(other_slot)
    for _ in range(2):  # a second cache: a new memo
        stager.cache_rows(rng.permutation(ROWS), int(rng.integers(50, 600)) * layout.record_bytes)
        cached = {int(r): j for j, r in enumerate(np.flatnonzero(stager.slot_map >= 0) + LO)}
        assert stager._memo.shape == (memo_lines, 2 * GROUP)
        assert (stager._memo[:, :GROUP] == -2).all()  # a new cache's memo holds nothing yet
        other.share(stager)
        seen = rng.integers(-1, ROWS + 40, size=(40, HEADS))
        seen[0, :GROUP] = [-1, LO - 1, HI, HI + 7, *rng.integers(LO, HI, GROUP - 4)]
        for step in range(6):
            ids = seen[rng.integers(0, seen.shape[0], size=int(rng.integers(1, 40)))].copy()
            ids[rng.random(ids.shape) < 0.1] = rng.integers(0, ROWS)  # some groups are new
            who, its_slot = (stager, slot) if step % 2 else (other, other_slot)
            _check_step(table, layout, who, its_slot, ids, cached)
            tail = np.concatenate([ids.reshape(-1), rng.integers(0, ROWS, GROUP - 3)])
            _check_step(table, layout, who, its_slot, tail.reshape(1, -1), cached)
        assert (stager._memo[:, :GROUP] != -2).any() and other._memo is stager._memo
    _, _, plain, plain_slot = _stager(tables, "int4", 300 * HEADS, memo_lines=0)
    plain.share(stager)  # no memo: the same results through the hit index alone
    assert plain._memo.shape[0] == 0
    _check_step(table, layout, plain, plain_slot, seen, cached)
    for bad in (3, 1):
        with pytest.raises(KernelError, match=f"memo_lines is {bad}, expected a power of two"):
            StageKnobs(memo_lines=bad)


def test_a_stagers_memo_follows_its_own_memo_lines(tables, rng):
    """``memo_lines`` says the memo a stager classifies through, whatever ``share`` brought:
    a stager without a memo keeps none when it shares a cache with one that has one (set
    before or after the share, with caches coming and going), and one of another size gets
    its own memo; the shared memo is shared only between stagers of one size."""
    table, layout, stager, _slot = _stager(tables, "int4", 64 * HEADS)
    plain = HostStager(
        table.stored(), layout, table.row_range, 64 * HEADS, StageKnobs(memo_lines=0)
    )
    small = HostStager(
        table.stored(), layout, table.row_range, 64 * HEADS, StageKnobs(memo_lines=4)
    )
    for cache_rows in (0, 300, 0, 200):
        stager.cache_rows(rng.permutation(ROWS), cache_rows * layout.record_bytes)
        plain.share(stager)
        small.share(stager)
        assert plain._memo.shape[0] == 0
        if cache_rows:
            assert small._memo.shape[0] == 4 and small._memo is not stager._memo
            assert stager._memo.shape[0] == stager.knobs.memo_lines
    twin = HostStager(table.stored(), layout, table.row_range, 64 * HEADS)
    twin.share(stager)
    assert twin._memo is stager._memo  # same size: one memo
    for bad in (2.0, True, "4"):
        with pytest.raises(KernelError, match="memo_lines is"):
            StageKnobs(memo_lines=bad)

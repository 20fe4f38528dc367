"""Read-ahead hints of a staged step (``cold_hints``, flashnext.kernels._cold).

The hints must cover exactly the pages of the rows a step gathers (its cache misses) and
change no result; ``auto`` follows the process's major page faults with hysteresis.
"""

import mmap

import numpy as np
import pytest

from flashnext.errors import KernelError
from flashnext.host import open_table
from flashnext.kernels import _cold
from flashnext.kernels.gather import row_addresses
from flashnext.kernels.records import record_layout
from flashnext.kernels.stager import HostStager, StageKnobs

from .test_staging import HEADS, HI, LO, ROWS, _check_step, tables  # noqa: F401 (fixture)


def _pages(src, rows, page):
    """Reference: every page holding a stored byte of ``rows``, from the row source's arrays."""
    out = set()
    for row in rows:
        s = int(np.searchsorted(src.seg_start, row, "right")) - 1
        for f, nb in enumerate(src.row_bytes.tolist()):
            addr = int(src.bases[f, s]) + (int(row) - int(src.seg_start[s])) * nb
            out.update(range(addr // page * page, addr + nb, page))
    return out


@pytest.mark.parametrize("fmt", ["int4", "nvfp4"])
@pytest.mark.parametrize("page", [mmap.PAGESIZE, 256])  # 256: many rows split across pages
def test_page_runs_cover_exactly_the_rows_pages(tables, fmt, page, rng):  # noqa: F811
    table = open_table(tables / fmt, "mmap", row_range=(LO, HI))
    src = row_addresses(table.stored(), record_layout(table.codec, table.width))
    for n in (0, 1, 37, 700):
        rows = rng.permutation(np.arange(LO, HI))[:n].astype(np.int64)
        runs = np.empty((max(1, n) * src.row_bytes.size, 2), np.int64)
        m = _cold.page_runs(rows, n, src.seg_start, src.bases, src.row_bytes, page, runs)
        got = set()
        for a, b in runs[:m].tolist():
            assert a % page == 0 and b % page == 0 and a < b
            got.update(range(a, b, page))
        assert got == _pages(src, rows, page)
        assert sum((b - a) // page for a, b in runs[:m].tolist()) == len(got)  # disjoint
        assert (runs[1:m, 0] > runs[: m - 1, 1]).all()  # sorted, adjacent runs merged


@pytest.mark.parametrize("fmt", ["int4", "nvfp4"])
@pytest.mark.parametrize("big", [False, True], ids=["one-call", "threads"])
def test_hinted_steps_hint_the_misses_and_change_no_result(tables, fmt, big, rng, monkeypatch):  # noqa: F811
    table = open_table(tables / fmt, "mmap", row_range=(LO, HI))
    layout = record_layout(table.codec, table.width)
    more = {"serial_rows": -1, "parallel_ids": 1} if big else {}
    knobs = StageKnobs(workers=2, cold_hints="on", **more)
    stager = HostStager(table.stored(), layout, table.row_range, 300 * HEADS, knobs)
    slot = np.full(stager.slot_bytes, 0xAB, np.uint8)
    stager.add_slot(slot)
    hinted = []
    real = _cold.hint_rows

    def spy(uniq, n, *rest):  # records what is hinted, then hints for real
        hinted.append(set(uniq[:n].tolist()))
        return real(uniq, n, *rest)

    monkeypatch.setattr(_cold, "hint_rows", spy)
    for cached in ({}, None):
        if cached is None:  # behind a cache: only misses are hinted
            kept = sorted(rng.permutation(np.arange(LO, HI))[:300].tolist())
            stager.cache_rows(np.array(kept), 300 * layout.record_bytes)
            cached = {r: j for j, r in enumerate(kept)}
        for t in (300, 1, 9):
            ids = rng.integers(-1, ROWS + 40, size=(t, HEADS))
            _check_step(table, layout, stager, slot, ids, cached)
            flat = ids.reshape(-1)
            want = {int(r) for r in flat if LO <= r < HI and int(r) not in cached}
            assert hinted.pop() == want


def test_auto_follows_major_faults_with_hysteresis():
    # Fault injection: a counter in place of getrusage (major faults on demand are not
    # reproducible on a shared machine's page cache).
    count = [0]
    watch = _cold.FaultWatch(every=4, off_after=3, faults=lambda: count[0])
    assert [watch.step() for _ in range(3)] == [True, True, False]  # starts on, 3 quiet: off
    assert [watch.step() for _ in range(8)] == [False] * 8  # warm: reads every 4th step
    count[0] += 5
    assert [watch.step() for _ in range(4)] == [False, False, False, True]
    count[0] += 1
    assert watch.step()  # on: read every step
    assert [watch.step() for _ in range(3)] == [True, True, False]  # 3 quiet steps: off
    assert not watch.step()


def test_an_unknown_cold_hints_mode_is_named(tables):  # noqa: F811
    table = open_table(tables / "int4", "mmap")
    layout = record_layout(table.codec, table.width)
    with pytest.raises(KernelError, match="cold_hints is 'sometimes'"):
        StageKnobs(cold_hints="sometimes")
    stager = HostStager(table.stored(), layout, table.row_range, 16)
    with pytest.raises(KernelError, match="cold_hints is 'never'"):
        stager.set_cold_hints("never")
    assert stager.cold_hints == "off"
    stager.set_cold_hints("auto")  # between steps: the mode and its fault watch
    assert stager.knobs.cold_hints == "auto" and stager._watch is not None

import os
import resource
from pathlib import Path

import numpy as np
import pytest

from flashnext.errors import SidecarError
from flashnext.host import open_table
from flashnext.store import write_sidecar
from flashnext.synthetic import embedding_rows
from tests.ple.reference import dequant64

from ..seeding import seeded_rng

FORMATS = ["bf16", "fp8", "int4", "nvfp4"]


@pytest.fixture(scope="module")
def tables(tmp_path_factory, request):
    rng = seeded_rng(request.node.nodeid, request.fixturename)
    x = embedding_rows(1000, 160, rng)
    root = tmp_path_factory.mktemp("tables")
    for fmt in FORMATS:
        write_sidecar(root / fmt, fmt, x, 128)
    return root, x


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("residency", ["mmap", "resident"])
def test_lookup_equals_float64_dequant(tables, fmt, residency, rng):
    root, x = tables
    table = open_table(root / fmt, residency)
    assert (table.format, table.num_rows, table.width) == (fmt, 1000, 160)
    ids = rng.integers(-1, 1000, size=(4, 33, 16))
    raw = table.gather_raw(ids)
    for spec in table.codec.specs:
        if spec.per_row:
            assert raw[spec.name].dtype == spec.dtype
            assert raw[spec.name].shape[:3] == ids.shape
    flat = {k: v.reshape(ids.size, *v.shape[3:]) for k, v in raw.items()}
    expect = dequant64(fmt, flat).reshape(*ids.shape, 160)
    got = table.lookup(ids)
    np.testing.assert_array_equal(got, expect.astype(np.float32))
    assert np.all(got[ids == -1] == 0) and not np.any(np.signbit(got[ids == -1]))
    # and the rows are the source rows, up to the format's error
    valid = ids >= 0
    err = np.linalg.norm(got[valid] - x[ids[valid]]) / np.linalg.norm(x[ids[valid]])
    assert err < {"bf16": 0.005, "fp8": 0.04, "int4": 0.13, "nvfp4": 0.12}[fmt]


def test_row_range_serves_only_its_rows(tables):
    root, _ = tables
    whole = open_table(root / "nvfp4")
    ids = np.arange(-1, 1000)
    full = whole.lookup(ids)
    total = np.zeros_like(full)
    for rank in range(4):
        lo, hi = rank * 250, (rank + 1) * 250
        part = open_table(root / "nvfp4", "resident" if rank % 2 else "mmap", row_range=(lo, hi))
        overlapping = [
            s.row_start
            for s in part.sidecar.shards
            if s.row_start < hi and s.row_start + s.rows > lo
        ]
        assert part._shard_starts.tolist() == overlapping  # only these shards were opened
        rows = part.lookup(ids)
        inside = (ids >= lo) & (ids < hi)
        np.testing.assert_array_equal(rows[inside], full[inside])
        assert np.all(rows[~inside] == 0)
        total += rows
    np.testing.assert_array_equal(total, full)  # partial sums across ranks rebuild the rows


def test_index_errors_name_the_id(tables):
    root, _ = tables
    table = open_table(root / "int4")
    with pytest.raises(IndexError, match=r"row id 1000 at index \(1,\) is outside the table"):
        table.lookup([3, 1000])
    with pytest.raises(IndexError, match=r"row id -2 at index \(0, 1\)"):
        table.lookup([[0, -2]])
    with pytest.raises(SidecarError, match=r"row_range \(10, 2000\) is not inside"):
        open_table(root / "int4", row_range=(10, 2000))
    # a rank's bounds from true division, strings, a flag or a third value: refused, not floored
    for bad in ((249.9, 750.9), ("3", "10"), (True, 5), (0, 10, 99), 7):
        with pytest.raises(SidecarError, match=r"row_range must be two integers \(start, end\)"):
            open_table(root / "int4", row_range=bad)  # type: ignore[arg-type]
    assert open_table(root / "int4", row_range=[np.int64(3), 10]).row_range == (3, 10)
    with pytest.raises(SidecarError, match="residency must be 'mmap' or 'resident'"):
        open_table(root / "int4", "pinned")  # type: ignore[arg-type]
    assert table.lookup(np.empty((0,), np.int64)).shape == (0, 160)
    table.close()
    with pytest.raises(SidecarError, match="lookup on a closed table"):
        table.lookup([0])


def _rss_kb():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def test_mmap_is_zero_copy_and_resident_copies(tmp_path, rng):
    rows = 200_000  # 64 MB of bf16
    big = rng.integers(0, 2**16, size=(rows, 160), dtype=np.uint16)
    big[(big & 0x7F80) == 0x7F80] = 0x3F80  # no NaN/inf bit patterns
    from flashnext.store.destination import SidecarWriter

    w = SidecarWriter(tmp_path, "bf16", 160, rows, 50_000)
    for i in range(4):
        w.write_shard(i, {"weight": big[i * 50_000 : (i + 1) * 50_000].view(np.dtype("bfloat16"))})
    w.finish()
    before = _rss_kb()
    mapped = open_table(tmp_path, "mmap")
    after_map = _rss_kb()
    resident = open_table(tmp_path, "resident")
    after_copy = _rss_kb()
    assert after_map - before < 8_000  # nothing read: a few pages of headers at most
    assert after_copy - after_map > 60_000  # the 64 MB copy is anonymous memory
    assert resident.resident_bytes == rows * 320 and mapped.resident_bytes == 0
    ids = rng.integers(0, rows, size=512)
    np.testing.assert_array_equal(mapped.lookup(ids), resident.lookup(ids))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("residency", ["mmap", "resident", "hot"])
def test_fused_kernels_match_numpy_reference(tables, fmt, residency, rng):
    import ml_dtypes

    root, _ = tables
    hot = rng.choice(1000, size=100, replace=False) if residency == "hot" else None
    table = open_table(root / fmt, "mmap" if hot is not None else residency, hot_tier=hot)
    assert table.hot_tier_rows == (100 if hot is not None else 0)
    for row_range in (None, (130, 700)):
        if row_range:
            table = open_table(root / fmt, "mmap", row_range=row_range, hot_tier=hot)
        ids = rng.integers(-1, 1000, size=(3, 40_000 // 3))  # big enough to split over threads
        ref = table.reference_lookup(ids)
        got = table.lookup(ids)
        np.testing.assert_array_equal(got.view(np.uint32), ref.view(np.uint32))
        bf = table.lookup(ids, dtype=ml_dtypes.bfloat16)
        np.testing.assert_array_equal(
            bf.view(np.uint16), ref.astype(ml_dtypes.bfloat16).view(np.uint16)
        )
        raw, want = table.gather_raw(ids), table.reference_gather_raw(ids)
        for name in want:
            assert raw[name].dtype == want[name].dtype and raw[name].shape == want[name].shape
            np.testing.assert_array_equal(raw[name].view(np.uint8), want[name].view(np.uint8))


def test_lookup_from_threads_matches_single_thread(tables, rng):
    from concurrent.futures import ThreadPoolExecutor

    import ml_dtypes

    root, _ = tables
    hot = rng.choice(1000, size=150, replace=False)
    for table in (open_table(root / "int4"), open_table(root / "nvfp4", hot_tier=hot)):
        calls = [
            table.lookup,
            lambda ids, t=table: t.lookup(ids, dtype=ml_dtypes.bfloat16),
            lambda ids, t=table: t.gather_raw(ids)[t.codec.specs[0].name],
        ]
        # sizes on both sides of the split over the pool (kernels run on 6 threads at once)
        work = [
            (int(rng.integers(0, 3)), rng.integers(-1, 1000, size=int(rng.integers(1, 40_000))))
            for _ in range(24)
        ]
        expect = [calls[c](ids) for c, ids in work]
        with ThreadPoolExecutor(6) as pool:
            got = list(pool.map(lambda w, calls=calls: calls[w[0]](w[1]), work))
        for e, g in zip(expect, got):
            np.testing.assert_array_equal(e.view(np.uint8), g.view(np.uint8))


def test_warm_reads_the_open_rows(tables):
    root, _ = tables
    table = open_table(root / "fp8", row_range=(100, 900))
    seen = []
    warming = table.warm(background=True, progress=seen.append)
    assert warming.wait(30) and warming.bytes_read == warming.total_bytes == sum(seen)
    assert warming.total_bytes == 800 * table.codec.bytes_per_row(160)


def test_row_ranges_cover_the_rows_page_aligned_and_merged(tables, rng):
    root, _ = tables
    table = open_table(root / "int4", row_range=(100, 900))
    rows = np.unique(rng.integers(100, 900, size=40))
    ranges = table.row_ranges(rows, gap=0)
    touched = set()
    for row in rows.tolist():
        shard = next(sh for sh in table._shards if sh.row_start <= row < sh.row_start + sh.rows)
        for spec in table._row_specs:  # int4: codes and scales, each its own bytes
            entry = shard.tensors[spec.name]
            size = entry.nbytes // shard.rows
            at = entry.offset + (row - shard.row_start) * size
            assert any(p == shard.path and o <= at and at + size <= o + n for p, o, n in ranges)
            touched.add((shard.path, spec.name))
    assert all(o % 4096 == 0 and n > 0 for _, o, n in ranges)
    # a gap bigger than any file: one range per shard tensor that holds rows
    assert len(table.row_ranges(rows, gap=1 << 30)) == len(touched) <= len(ranges)


def _smaps_fields(match):
    """Per mapping whose header line satisfies ``match(line)``: its smaps fields (kB)."""
    maps, current = [], None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and ":" not in head[0]:
                current = {} if match(line.rstrip()) else None
                if current is not None:
                    maps.append(current)
            elif current is not None and head and head[0].endswith(":") and len(head) >= 2:
                current[head[0][:-1]] = int(head[1]) if head[1].isdigit() else head[1]
    return maps


def _evict(files):
    for path in files:
        with open(path, "rb") as fh:
            os.fdatasync(fh.fileno())
            os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def _mapped_kb(path):
    """Rss of this process's mappings of ``path`` (kB), from /proc/self/smaps."""
    return sum(m["Rss"] for m in _smaps_fields(lambda line: line.endswith(str(path))))


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="needs Linux page-cache advice")
def test_warm_maps_the_pages_so_lookups_take_no_faults(tmp_path, rng):
    x = embedding_rows(20_000, 160, rng)
    write_sidecar(tmp_path / "t", "int4", x, 5_000)
    table = open_table(tmp_path / "t", "mmap")
    files = sorted({p for p, _, _ in table.file_ranges()})
    before = sum(_mapped_kb(p) for p in files)
    table.warm(background=False)
    after = sum(_mapped_kb(p) for p in files)
    # every stored byte of the table is now mapped (Rss of the file maps), no lookup ran
    assert after - before >= 20_000 * table.codec.bytes_per_row(160) // 1024 - 64
    ids = rng.integers(0, 20_000, size=4096)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    got = table.lookup(ids)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults < 64  # out buffer only
    np.testing.assert_array_equal(got, table.reference_lookup(ids))


def _file_huge_pages_work(path, rng):
    """Whether this kernel and filesystem map a file's pages 2 MiB at a time (large
    page-cache folios, Linux >= 6.16 on ext4): a 4 MiB file faulted in through a huge-advised
    map, then checked in smaps."""
    import mmap

    path.write_bytes(rng.integers(0, 256, size=4 << 20, dtype=np.uint8).tobytes())
    _evict([path])
    with open(path, "rb") as fh:
        view = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        view.madvise(mmap.MADV_HUGEPAGE)
        view.madvise(22)  # MADV_POPULATE_READ
    except (AttributeError, OSError):
        return False
    found = _smaps_fields(lambda line: line.endswith(str(path)))
    view.close()
    return any(m.get("FilePmdMapped", 0) for m in found)


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="needs Linux page-cache advice")
def test_warm_maps_each_file_once_on_huge_pages(tmp_path, rng):
    if not _file_huge_pages_work(tmp_path / "probe.bin", rng):
        pytest.skip("this kernel/filesystem keeps file pages at 4 KiB (no large folios)")
    rows = 60_000  # int4: 6 MB per shard file, 2 whole 2 MiB pieces and a tail
    write_sidecar(tmp_path / "t", "int4", embedding_rows(2 * rows, 160, rng), rows)
    files = sorted((tmp_path / "t").glob("*.safetensors"))
    _evict(files)
    table = open_table(tmp_path / "t", "mmap")  # reads the headers: small folios at the head
    # lookups before warming fault single 4 KiB pages in all over the files (MADV_RANDOM)
    table.lookup(rng.integers(0, 2 * rows, size=2048))
    table.warm(background=False)
    for path in files:
        maps = _smaps_fields(lambda line, p=path: line.endswith(str(p)))
        # one map for the file's tensors: a map per tensor leaves the 2 MiB piece where
        # they meet on 4 KiB pages
        assert len(maps) == 1, f"{path.name}: {len(maps)} maps"
        whole_pieces = path.stat().st_size // (2 << 20)
        # every whole 2 MiB piece on a huge page, those holding the header or rows
        # looked up before warming included
        assert maps[0]["FilePmdMapped"] == whole_pieces * 2048, (path.name, maps[0])
    ids = rng.integers(-1, 2 * rows, size=2048)
    np.testing.assert_array_equal(table.lookup(ids), table.reference_lookup(ids))


def test_hot_index_is_exact_and_on_huge_pages(rng):
    from flashnext.host import lookup_kernels as kern

    rows = 20_000_000  # a 2.5 MB bitmap
    hot = np.unique(rng.integers(0, rows, size=200_000))
    bitmap, rank = kern.hot_index(hot, rows)
    want = np.zeros(bitmap.size * 64, bool)
    want[hot] = True
    np.testing.assert_array_equal(np.unpackbits(bitmap.view(np.uint8), bitorder="little"), want)
    per_block = want.reshape(-1, 512).sum(axis=1)
    np.testing.assert_array_equal(rank, np.concatenate([[0], np.cumsum(per_block)[:-1]]))
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if thp.exists() and "[never]" not in thp.read_text():

        def holds_bitmap(line):
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            return lo <= bitmap.ctypes.data < hi

        maps = _smaps_fields(holds_bitmap)
        assert maps and maps[0]["AnonHugePages"] >= 2048, maps


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="needs Linux page-cache advice")
def test_hot_tier_reads_its_ranges_before_gathering(tmp_path, rng):
    from flashnext.host.preflight import page_cache_bytes

    x = embedding_rows(40_000, 160, rng)
    write_sidecar(tmp_path / "t", "int4", x, 10_000)
    files = sorted((tmp_path / "t").glob("*.safetensors"))
    _evict(files)
    if sum(page_cache_bytes(p) for p in files):
        pytest.skip("the page cache kept the files (eviction refused on this filesystem)")
    hot = np.sort(rng.choice(40_000, size=300, replace=False))
    major = resource.getrusage(resource.RUSAGE_SELF).ru_majflt
    table = open_table(tmp_path / "t", "mmap", hot_tier=hot)
    # read() brought the tier's pages in; gathering through the maps would have taken a
    # major fault per page (~300 here)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_majflt - major < 30
    assert sum(page_cache_bytes(p) for p in files) >= sum(n for _, _, n in table.row_ranges(hot))
    np.testing.assert_array_equal(table.lookup(hot), table.reference_lookup(hot))


@pytest.mark.parametrize("hot", ["profile.safetensors", 50, np.zeros((2, 3), np.int64)])
def test_hot_rows_takes_a_profile_or_ids_only(hot, tmp_path, rng):
    """A count or a file name is no longer a hot tier: the error says what is (issue 21)."""
    write_sidecar(tmp_path / "t", "int4", embedding_rows(300, 32, rng), 100)
    with pytest.raises(SidecarError, match="hot_tier must be a RowProfile or 1-D integer row ids"):
        open_table(tmp_path / "t", "mmap", hot_tier=hot)


def test_hot_rows_is_the_old_name_of_hot_tier(tmp_path, rng, monkeypatch, caplog):
    """``open_table(hot_rows=)`` and ``PLETable.hot_rows`` still work; the old keyword says so
    once per process."""
    from flashnext import words

    monkeypatch.setattr(words, "_said", set())
    write_sidecar(tmp_path / "t", "int4", embedding_rows(300, 32, rng), 100)
    hot = rng.permutation(300)[:40]
    ids = rng.integers(0, 300, size=(7, 3))
    with open_table(tmp_path / "t", "mmap", hot_tier=hot) as new:
        want, rows = new.lookup(ids), new.hot_tier_rows
    for _ in range(2):
        with open_table(tmp_path / "t", "mmap", hot_rows=hot) as old:
            assert old.hot_rows == old.hot_tier_rows == rows == 40
            np.testing.assert_array_equal(old.lookup(ids), want)
    said = [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()]
    assert said == [
        "warning: open_table(hot_rows=) is deprecated; it is now spelled open_table(hot_tier=)"
    ]


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="needs Linux page-cache advice")
def test_hot_tier_maps_what_it_read_so_lookups_take_no_faults(tmp_path, rng):
    """The hot tier's read covers its rows' file ranges; open then maps those ranges into the
    table's own maps (issue 26), not only the rows it gathered, so later lookups of any row
    in them take no page fault on any boot, 4 KiB or 2 MiB pages alike."""
    rows = 40_000  # int4: 4 MB per shard file
    write_sidecar(tmp_path / "t", "int4", embedding_rows(2 * rows, 160, rng), rows)
    files = sorted((tmp_path / "t").glob("*.safetensors"))
    _evict(files)
    for path in files:  # cached by plain reads: small folios, which no fault maps 2 MiB at once
        path.read_bytes()
    hot = np.arange(0, 2 * rows, 2_500) + rng.integers(0, 2_500, size=2 * rows // 2_500)
    table = open_table(tmp_path / "t", "mmap", hot_tier=hot)
    ranges = table.row_ranges(np.sort(hot))
    for path in files:
        want = sum(n for p, _, n in ranges if p == path) // 1024
        assert _mapped_kb(path) >= want - 8, (path.name, _mapped_kb(path), want)
    ids = rng.integers(0, 2 * rows, size=4096)
    faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    got = table.lookup(ids)
    assert resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - faults < 64  # out buffer only
    np.testing.assert_array_equal(got, table.reference_lookup(ids))


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="needs Linux page-cache advice")
def test_lookups_read_their_pages_ahead_while_warming(tmp_path, rng):
    """While background warming runs, a decode-sized lookup first asks for all its rows'
    pages at once (issue 26); here the asking alone, on evicted files, brings them in."""
    import time

    from flashnext.host import lookup_kernels as kern
    from flashnext.host.mapping import Warming, cached_pages

    write_sidecar(tmp_path / "t", "int4", embedding_rows(40_000, 160, rng), 10_000)
    table = open_table(tmp_path / "t", "mmap")
    files = sorted((tmp_path / "t").glob("*.safetensors"))
    _evict(files)
    ids = rng.integers(0, 40_000, size=64)
    pages = kern.row_pages(ids, table._state.loc)
    bases = {seg.start: seg for seg in table.stored().segments}  # each row's first, last byte
    for row in ids.tolist():
        seg = bases[max(s for s in bases if s <= row)]
        for arr in seg.tensors.values():
            first = arr.ctypes.data + (row - seg.start) * arr.strides[0]
            for address in (first, first + arr.strides[0] - 1):
                assert address // 4096 * 4096 in set(pages.tolist())
    assert kern.row_pages(np.full(4, -1, np.int64), table._state.loc).size == 0
    maps = list(table._maps.values())
    want = set(pages.tolist())

    def cached() -> set[int]:
        got = set()
        for view in maps:
            start = np.frombuffer(view, np.uint8, count=1).ctypes.data
            hits = np.flatnonzero(cached_pages(view)) * 4096 + start
            got |= want & set(hits.tolist())
        return got

    if cached():
        pytest.skip("the page cache kept the files (eviction refused on this filesystem)")
    table._warming = Warming([])  # a warming not yet done: lookups read ahead
    table._read_ahead(table._state, ids)
    deadline = time.monotonic() + 30  # generous: a loaded machine reads slowly
    while cached() != want and time.monotonic() < deadline:
        time.sleep(0.01)
    assert cached() == want
    np.testing.assert_array_equal(table.lookup(ids), table.reference_lookup(ids))
    table._warming._done.set()  # once warming is done, lookups stop reading ahead
    table.lookup(ids)
    assert table._warming is None


def test_touch_pages_reads_one_byte_per_page_of_the_clipped_range(tmp_path, rng):
    """Warming's first touch: every page of the range once, clipped at the map's end, and the
    map can close afterwards (no array left holding it)."""
    import mmap

    from flashnext.host.mapping import touch_pages

    page = mmap.PAGESIZE
    path = tmp_path / "data.bin"
    path.write_bytes(rng.integers(1, 256, 64 * page, dtype=np.uint8).tobytes())
    with open(path, "rb") as fh:
        view = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        assert touch_pages(view, 8 * page, 20 * page + 5) == 21
        assert touch_pages(view, 60 * page, 10 * page) == 4
        assert touch_pages(view, 64 * page, page) == 0
        view.close()

"""The fused lookup kernel against the float64 reference of the card's formulas.

Runs on a CUDA GPU, or on the CPU in Triton's interpreter (``TRITON_INTERPRET=1``, device and
staged placements only). Both need torch and triton (``pip install 'flashnext[gpu]'``); without
them, or with neither a GPU nor the interpreter, every test here skips and says why.
"""

import os
import threading
import time

import ml_dtypes
import numpy as np
import pytest

from flashnext.errors import KernelError
from flashnext.host import open_table
from flashnext.store import write_sidecar
from flashnext.synthetic import embedding_rows

from ..ple.reference import dequant64
from ..seeding import seeded_rng

torch = pytest.importorskip("torch", reason="torch not installed: pip install 'flashnext[gpu]'")
pytest.importorskip("triton", reason="triton not installed: pip install 'flashnext[gpu]'")

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
CUDA = torch.cuda.is_available() and not INTERPRET
if not (CUDA or INTERPRET):
    pytest.skip(
        "no CUDA GPU (set TRITON_INTERPRET=1 to run the kernel on the CPU)", allow_module_level=True
    )

from flashnext.kernels import GpuTable, GraphStagedTable, StagedTable  # noqa: E402
from flashnext.kernels import _triton_lookup as _lookup  # noqa: E402
from flashnext.kernels.graph_staged import SPIN_MAX_IDS  # noqa: E402
from flashnext.kernels.rows import Rows  # noqa: E402
from flashnext.kernels.table import UvaPointer  # noqa: E402

FORMATS = ["bf16", "fp8", "int4", "nvfp4"]
ROWS, WIDTH, HEADS = 1000, 160, 16
DEVICE = "cuda" if CUDA else "cpu"
PLACEMENTS = ["device", "pinned"] if CUDA else ["device"]
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (pinned memory, graphs)")


@pytest.fixture(autouse=True)
def few_programs_when_interpreted(monkeypatch):
    """The interpreter's cost is per program: launch fewer, larger ones (the index and dequant
    code is the same; only the BLOCK constant grows, partial last blocks still occur)."""
    if INTERPRET:
        monkeypatch.setattr(_lookup, "SPREAD", 4)


@pytest.fixture(scope="module")
def sidecars(tmp_path_factory, request):
    x = embedding_rows(ROWS, WIDTH, seeded_rng(request.node.nodeid, request.fixturename))
    root = tmp_path_factory.mktemp("kernel_tables")
    for fmt in FORMATS:
        write_sidecar(root / fmt, fmt, x, 128)  # 8 shards: nvfp4 has 8 scale_2 values
    return root


def expected(table, ids, row_range=None):
    """bf16 bits [T, heads*width] from the float64 reference; zero outside ``row_range``."""
    lo, hi = row_range or (0, table.num_rows)
    flat = ids.reshape(-1)
    inside = (flat >= lo) & (flat < hi)
    raw = table.gather_raw(np.where(inside, flat, -1))
    ref = dequant64(table.format, raw).astype(np.float32)  # f64 product rounded once
    ref[~inside] = 0.0
    return ref.astype(ml_dtypes.bfloat16).view(np.uint16).reshape(ids.shape[0], -1)


def random_ids(rng, t, lo=-1, hi=ROWS + 40):
    ids = rng.integers(lo, hi, size=(t, HEADS))
    ids[0, :3] = [-1, ROWS, ROWS - 1]
    return ids


def bits(out):
    return out.cpu().view(torch.int16).numpy().view(np.uint16)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_lookup_is_bit_exact(sidecars, fmt, placement, rng):
    table = open_table(sidecars / fmt)
    gpu = GpuTable.from_table(table, placement, device=DEVICE)
    # 1 row per program (decode), 8, and 64 with a partial last block (prefill)
    for t in (37, 300, 4099) if CUDA else (3, 40):
        ids = random_ids(rng, t)
        out = gpu.lookup(torch.from_numpy(ids).to(DEVICE))
        assert out.dtype == torch.bfloat16 and tuple(out.shape) == (t, HEADS * WIDTH)
        np.testing.assert_array_equal(bits(out), expected(table, ids))


@pytest.mark.parametrize("fmt", ["int4", "nvfp4"])
def test_rank_row_ranges_sum_to_the_whole(sidecars, fmt, rng):
    table = open_table(sidecars / fmt, row_range=(250, 1000))
    ids = random_ids(rng, 21)
    ids_d = torch.from_numpy(ids).to(DEVICE)
    total = torch.zeros(21, HEADS * WIDTH, dtype=torch.bfloat16, device=DEVICE)
    for lo, hi in [(250, 333), (333, 700), (700, 1000)]:  # ranks, not on shard bounds
        part = GpuTable.from_table(table, PLACEMENTS[-1], row_range=(lo, hi), device=DEVICE)
        got = part.lookup(ids_d)
        np.testing.assert_array_equal(bits(got), expected(table, ids, (lo, hi)))
        total += got
    # a sum turns -0.0 into +0.0 (nvfp4 code 8 is -0.0): compare the sum with +0.0 there
    whole = expected(table, ids, (250, 1000))
    np.testing.assert_array_equal(bits(total), np.where(whole == 0x8000, 0, whole))


@pytest.mark.parametrize("fmt", FORMATS if CUDA else ["nvfp4"])  # CPU: one numba compile
def test_staged_lookup_matches_across_reused_buffers(sidecars, fmt, rng):
    table = open_table(sidecars / fmt, "mmap")
    staged = StagedTable(table, max_ids=40 * HEADS, buffers=2, device=DEVICE)
    batches = [random_ids(rng, t, hi=ROWS) for t in (40, 3, 17, 1)]
    pending = [staged.stage(batches[0]), staged.stage(batches[1])]
    for i, ids in enumerate(batches):
        out = staged.lookup(pending[i])
        if i + 2 < len(batches):
            pending.append(staged.stage(batches[i + 2]))  # reuses this step's slot
        np.testing.assert_array_equal(bits(out), expected(table, ids))
    # the serving layer's one call (kernels.rows.Rows): stage + lookup, from torch ids
    assert isinstance(staged, Rows)
    ids = random_ids(rng, 23, hi=ROWS)
    out = torch.empty(23, HEADS * WIDTH, dtype=torch.bfloat16, device=DEVICE)
    staged.rows_into(torch.from_numpy(ids), out)
    np.testing.assert_array_equal(bits(out), expected(table, ids))


@needs_cuda
@pytest.mark.parametrize("fmt", ["int4", "nvfp4", "fp8"])
def test_hot_row_cache_serves_the_same_rows(sidecars, fmt, rng):
    table = open_table(sidecars / fmt)
    gpu = GpuTable.from_table(table, "pinned", device=DEVICE)
    ids = random_ids(rng, 50)
    plain = bits(gpu.lookup(torch.from_numpy(ids).to(DEVICE)))
    hot = rng.permutation(ROWS)[:400]
    bytes_per_row = gpu.layout.record_bytes
    info = gpu.set_device_cache(np.concatenate([[-5, ROWS + 3], hot]), 300 * bytes_per_row)
    assert info.rows == 300 and info.bytes == 300 * bytes_per_row + 4 * ROWS
    cached = bits(gpu.lookup(torch.from_numpy(ids).to(DEVICE)))
    np.testing.assert_array_equal(cached, plain)
    np.testing.assert_array_equal(cached, expected(table, ids))
    gpu.sort_min_ids = 1  # sorted gather, rows written back to their ids' places
    np.testing.assert_array_equal(bits(gpu.lookup(torch.from_numpy(ids).to(DEVICE))), plain)


@needs_cuda
@pytest.mark.parametrize("placement", ["device", "pinned"])
def test_cuda_graph_replays_with_new_ids(sidecars, placement, rng):
    table = open_table(sidecars / "nvfp4")
    gpu = GpuTable.from_table(table, placement, row_range=(100, 900), device=DEVICE)
    if placement == "pinned":
        gpu.set_device_cache(rng.permutation(ROWS), 200 * gpu.layout.record_bytes)
    gpu.sort_min_ids = 1  # the sort (graph-safe) is captured too
    ids = torch.from_numpy(random_ids(rng, 24)).to(DEVICE)
    out = torch.empty(24, HEADS * WIDTH, dtype=torch.bfloat16, device=DEVICE)
    gpu.lookup(ids, out=out)  # compile and allocate the sort buffers before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gpu.lookup(ids, out=out)
    for _ in range(3):
        new = random_ids(rng, 24)
        ids.copy_(torch.from_numpy(new))
        graph.replay()
        torch.cuda.synchronize()
        np.testing.assert_array_equal(bits(out), expected(table, new, (100, 900)))


def test_bad_arguments_are_named(sidecars):
    table = open_table(sidecars / "int4", row_range=(0, 500))
    with pytest.raises(KernelError, match=r"row_range \(400, 600\) is not inside"):
        GpuTable.from_table(table, "device", row_range=(400, 600), device=DEVICE)
    with pytest.raises(KernelError, match="placement must be"):
        GpuTable.from_table(table, "disk", device=DEVICE)
    gpu = GpuTable.from_table(table, "device", device=DEVICE)
    with pytest.raises(KernelError, match="ids must be int64"):
        gpu.lookup(torch.zeros(4, dtype=torch.int64, device=DEVICE))
    with pytest.raises(KernelError, match="expected contiguous bfloat16"):
        gpu.lookup(
            torch.zeros(2, HEADS, dtype=torch.int64, device=DEVICE),
            out=torch.empty(2, 7, dtype=torch.bfloat16, device=DEVICE),
        )
    with pytest.raises(KernelError, match="a device cache serves pinned tables"):
        gpu.set_device_cache(np.arange(3), 1 << 20)
    if CUDA:
        with pytest.raises(KernelError, match="wait is 'poll', expected one of spin, stream"):
            GraphStagedTable(table, (2, HEADS), device=DEVICE, wait="poll")
        with pytest.raises(KernelError, match=r"\(copy_slot=True\) waits with wait=.stream."):
            GraphStagedTable(table, (2, HEADS), device=DEVICE, copy_slot=True, wait="spin")
        # decode-sized steps spin in the lookup kernel, bigger ones and copied slots stream-wait
        big = SPIN_MAX_IDS // HEADS + 1
        assert GraphStagedTable(table, (24, HEADS), device=DEVICE).wait == "spin"
        assert GraphStagedTable(table, (big, HEADS), device=DEVICE).wait == "stream"
        assert GraphStagedTable(table, (24, HEADS), device=DEVICE, copy_slot=True).wait == "stream"


def _wait_or_release(graph_staged, timeout_s=20.0):
    """Synchronize, but never hang on a GPU stuck at the flag: release it and fail."""
    done = torch.cuda.Event()
    done.record()
    deadline = time.monotonic() + timeout_s
    while not done.query():
        if time.monotonic() > deadline:
            graph_staged.release()
            torch.cuda.synchronize()
            pytest.fail(f"the GPU still waited on the staging flag after {timeout_s} s")
        time.sleep(1e-4)


def _eager_then_captured(staged, table, t, rng):
    """One eager step of ``staged`` checked against the reference (it compiles the kernel
    outside capture), then its lookup captured: (out bf16 [t, HEADS * WIDTH], the graph)."""
    out = torch.empty(t, HEADS * WIDTH, dtype=torch.bfloat16, device=DEVICE)
    ids = random_ids(rng, t)
    staged.stage(ids)
    staged.lookup(out)
    _wait_or_release(staged)
    np.testing.assert_array_equal(bits(out), expected(table, ids, (100, 1000)))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        staged.lookup(out)
    return out, graph


# how the slot reaches the kernel x how the GPU waits for the host's flag
GRAPH_MODES = [(True, None), (False, None), (False, "stream")]  # None: the default (by size)
GRAPH_IDS = ["copied-stream", "uva-spin", "uva-stream"]


@needs_cuda
@pytest.mark.parametrize(("copy_slot", "wait"), GRAPH_MODES, ids=GRAPH_IDS)
@pytest.mark.parametrize("fmt", ["int4", "nvfp4", "fp8"])
def test_graph_staged_lookup_replays_with_new_ids(sidecars, fmt, copy_slot, wait, rng):
    table = open_table(sidecars / fmt, "mmap", row_range=(100, 1000))
    t = 24
    staged = GraphStagedTable(table, (t, HEADS), device=DEVICE, copy_slot=copy_slot, wait=wait)
    out, graph = _eager_then_captured(staged, table, t, rng)
    for step in range(4):
        ids = random_ids(rng, t)
        if step % 2:  # the host fills after the launch (the GPU waits) or before it
            graph.replay()
            staged.stage(ids)
        else:
            staged.stage(ids)
            graph.replay()
        _wait_or_release(staged)
        np.testing.assert_array_equal(bits(out), expected(table, ids, (100, 1000)))
    assert isinstance(staged, Rows)  # the serving layer's one call, eager: stage + lookup
    ids = random_ids(rng, t)
    staged.rows_into(torch.from_numpy(ids), out)
    torch.cuda.synchronize()
    np.testing.assert_array_equal(bits(out), expected(table, ids, (100, 1000)))


def _misses(ids, lo, hi, cached):
    """The distinct rows of ``ids`` inside ``[lo, hi)`` that the cache does not hold."""
    flat = ids.reshape(-1)
    return {int(r) for r in flat if lo <= r < hi and int(r) not in cached}


@pytest.mark.parametrize("fmt", FORMATS if CUDA else ["nvfp4"])  # CPU: one numba compile
def test_staged_cache_serves_the_same_rows_and_gathers_only_misses(sidecars, fmt, rng):
    lo, hi = 100, 1000
    table = open_table(sidecars / fmt, "mmap", row_range=(lo, hi))
    staged = StagedTable(table, max_ids=50 * HEADS, buffers=2, device=DEVICE)
    rb = staged.layout.record_bytes
    hot = rng.permutation(ROWS)[:600]
    info = staged.set_device_cache(np.concatenate([[-5, ROWS + 3, 50, hot[0]], hot]), 300 * rb + 7)
    in_range = [int(r) for r in dict.fromkeys([hot[0], *hot]) if lo <= r < hi]
    cached = set(in_range[:300])  # first in priority order, repeats and outside rows skipped
    assert info.rows == 300
    assert info.bytes == 300 * rb + (300 * 4 if fmt == "nvfp4" else 0)
    for t in (50, 3, 1):
        ids = random_ids(rng, t)  # hits, misses, -1 and rows outside the range in one step
        batch = staged.stage(ids)
        assert batch.n_unique == len(_misses(ids, lo, hi, cached))
        np.testing.assert_array_equal(bits(staged.lookup(batch)), expected(table, ids, (lo, hi)))
    all_hits = np.array(sorted(cached)[:HEADS * 2]).reshape(2, HEADS)
    batch = staged.stage(all_hits)
    assert batch.n_unique == 0
    np.testing.assert_array_equal(bits(staged.lookup(batch)), expected(table, all_hits))
    assert staged.set_device_cache(hot, 0).rows == 0  # off again: every row staged
    ids = random_ids(rng, 7)
    batch = staged.stage(ids)
    assert batch.n_unique == len(_misses(ids, lo, hi, set()))
    np.testing.assert_array_equal(bits(staged.lookup(batch)), expected(table, ids, (lo, hi)))


@needs_cuda
@pytest.mark.parametrize(("copy_slot", "wait"), GRAPH_MODES, ids=GRAPH_IDS)
@pytest.mark.parametrize("fmt", ["int4", "nvfp4", "fp8"])
def test_graph_staged_cache_replays_with_new_ids(sidecars, fmt, copy_slot, wait, rng):
    table = open_table(sidecars / fmt, "mmap", row_range=(100, 1000))
    t = 24
    staged = GraphStagedTable(table, (t, HEADS), device=DEVICE, copy_slot=copy_slot, wait=wait)
    staged.set_device_cache(rng.permutation(ROWS), 400 * staged.layout.record_bytes)
    out, graph = _eager_then_captured(staged, table, t, rng)
    for step in range(4):
        ids = random_ids(rng, t)
        batch = staged.stage(ids) if step % 2 else None
        graph.replay()
        if batch is None:
            batch = staged.stage(ids)
        assert 0 < batch.n_unique < t * HEADS  # hits and misses in the same step
        _wait_or_release(staged)
        np.testing.assert_array_equal(bits(out), expected(table, ids, (100, 1000)))


@pytest.mark.parametrize("fmt", ["nvfp4"] if not CUDA else ["int4", "nvfp4"])
def test_a_sliced_rank_directory_serves_the_rank_like_the_full_sidecar(sidecars, fmt, rng,
                                                                       tmp_path):  # fmt: skip
    from flashnext.store.sidecar import open_sidecar
    from flashnext.store.slicing import plan_slice, rank_rows, write_slice

    rows = rank_rows(ROWS, 4, 2)  # (500, 750): shards 3..5 of 128 rows
    source = open_sidecar(sidecars / fmt)
    part = write_slice(source, tmp_path / "rank2", plan_slice(source, 4, [2]))
    ids = random_ids(rng, 30)
    full = GpuTable.from_table(open_table(sidecars / fmt, row_range=rows), device=DEVICE)
    sliced = GpuTable.from_table(open_table(part, row_range=rows), device=DEVICE)
    ids_d = torch.from_numpy(ids).to(DEVICE)
    np.testing.assert_array_equal(bits(sliced.lookup(ids_d)), bits(full.lookup(ids_d)))
    np.testing.assert_array_equal(bits(sliced.lookup(ids_d)), expected(open_table(sidecars / fmt),
                                                                        ids, rows))  # fmt: skip


@pytest.mark.parametrize("fmt", ["int4", "nvfp4", "fp8"] if CUDA else ["nvfp4"])
def test_the_kernel_reads_the_slot_only_after_the_flag_and_hands_it_back(sidecars, fmt, rng):
    """The graph-staged handover inside the lookup kernel (``launch_lookup(flag=, counts=)``):
    the slot holds another step's bytes (valid, wrong) until a host thread writes this step's
    and then raises the flag, 0.2 s after the launch. A kernel that read the slot's inverse
    index or rows before it saw the flag returns the other step's rows. The last program
    writes the flag back to 0 and its counters back to 0 for the next launch."""
    lo, hi = 100, 1000
    t = 24
    table = open_table(sidecars / fmt, "mmap", row_range=(lo, hi))
    staged = StagedTable(table, max_ids=t * HEADS, buffers=2, device=DEVICE)
    staged.set_device_cache(rng.permutation(ROWS), 300 * staged.layout.record_bytes)
    flag = torch.zeros(1, dtype=torch.int32, pin_memory=CUDA)
    counts = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    # on the GPU the kernel reads the pinned slot through UVA; the interpreter reads a CPU one
    slots = staged.slots.host if CUDA else staged.slots.dev
    for _ in range(2):  # a second launch: the counter was reset by the first
        other, ids = random_ids(rng, t), random_ids(rng, t)
        staged.stage(other)
        batch = staged.stage(ids)  # into slot 1: the one the kernel reads
        assert 0 < batch.n_unique < t * HEADS  # hits and misses in the same step
        if CUDA:
            torch.cuda.synchronize()
        mine = slots[1].clone()
        slots[1].copy_(slots[0])  # the other step's bytes until the host "fills" the slot

        def fill(mine=mine):
            time.sleep(0.2)
            slots[1].copy_(mine)
            flag.numpy()[0] = 1  # x86 keeps store order: the slot's bytes are visible first

        host = threading.Thread(target=fill)
        host.start()
        out = torch.empty(t, HEADS * WIDTH, dtype=torch.bfloat16, device=DEVICE)
        handover = (UvaPointer(flag) if CUDA else flag, counts)
        staged.slots.launch(slots[1], batch.n_ids, batch.n_unique, out, pinned=CUDA, handover=handover)
        host.join()
        if CUDA:
            torch.cuda.synchronize()
        np.testing.assert_array_equal(bits(out), expected(table, ids, (lo, hi)))
        assert int(flag[0]) == 0 and counts.cpu().tolist() == [0, 0]

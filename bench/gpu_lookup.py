"""Benchmark: GPU PLE lookups (fused gather + dequant) against vLLM 0.33's BF16 UVA copy, same run.

    python bench/gpu_lookup.py --tokens TOKENS.npy [--baseline-rows N] [--rows N]
        [--staged-rows N] [--repeats K] [--json PATH]

One run on one CUDA GPU: (0) H2D and device-to-device copy ceilings; then for T in
{32, 512, 8192, 65536} tokens x 16 heads, uniform ids and ids hashed from real text
(``--tokens``: an int32 token stream, documents joined by EOS, with a ``.json`` beside it
giving ``vocab_size`` and ``eos_token_id``; made by ``bench/text_tokens.py`` from local text as
``flashnext demo`` does), hashed with the real layer-0 geometry (20M base, 320,001,536 rows):
(a) baseline: vLLM 0.33's kernel copying raw BF16 rows over UVA from a pinned table of
``--baseline-rows`` rows; (b) ours over UVA for fp8/int4/nvfp4 at ``--rows`` rows; (c) ours
from device memory; (d) the staged path from a memory-mapped int4 sidecar of ``--staged-rows``
rows; (e) int4 over UVA behind a device cache of the hottest rows of the text's first half
(1, 2, 4 GB), timed on the second half. Each timing replays a CUDA graph of several lookups
on fresh ids after flushing L2; the median of ``--repeats`` and the spread (min..max) are
printed with rows/s, useful GB/s (stored bytes gathered), hit rate and the ratio to (a).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).parent))
from lookup import random_shard

from flashnext import __version__
from flashnext.kernels import GpuTable, StagedTable
from flashnext.kernels.records import pack_records
from flashnext.kernels.table import CACHED_SORT_MIN_IDS
from flashnext.ple import open_table
from flashnext.ple.formats import get_codec
from flashnext.ple.geometry import PLEGeometry
from flashnext.ple.hashing import ngram_ids
from flashnext.synthetic import flash_next_config

HEADS, WIDTH = 16, 160
TOKENS = (32, 512, 8192, 65536)
SHARD_ROWS = 2_500_012  # the released checkpoints' rows per shard (128 shards)
FORMATS = ("fp8", "int4", "nvfp4")


# (a) the baseline: vLLM 0.33.0's _lookup_ple_embedding_from_pinned_kernel (common/
# ngram_embedding.py, Apache-2.0), one program per id copying the row's raw bytes over UVA.
@triton.jit
def _vllm_pinned_kernel(weight_ptr, ids_ptr, output_ptr, row_bytes, tp_start, tp_end,
                        BLOCK_D: tl.constexpr):  # fmt: skip
    row_id = tl.program_id(0).to(tl.int64)
    global_idx = tl.load(ids_ptr + row_id)
    in_range = (global_idx >= tp_start) & (global_idx < tp_end)
    local_idx = tl.where(in_range, global_idx - tp_start, 0)
    offsets = tl.arange(0, BLOCK_D)
    store_mask = offsets < row_bytes
    values = tl.load(weight_ptr + local_idx * row_bytes + offsets, mask=store_mask & in_range,
                     other=0)  # fmt: skip
    tl.store(output_ptr + row_id * row_bytes + offsets, values, mask=store_mask)


class Baseline:
    """BF16 rows in pinned memory, gathered as vLLM 0.33 does."""

    def __init__(self, host: Any, rows: int):
        from flashnext.kernels.table import UvaPointer

        self.weight = UvaPointer(host[: rows * 2 * WIDTH])
        self.rows = rows
        self.record_bytes = 2 * WIDTH

    def lookup(self, ids: Any, out: Any) -> None:
        flat = ids.reshape(-1)
        _vllm_pinned_kernel[(flat.numel(),)](
            self.weight, flat, out.view(torch.uint8), 2 * WIDTH, 0, self.rows, BLOCK_D=512
        )


# -- timing --------------------------------------------------------------------------------
class Timer:
    """Times ``calls`` lookups per CUDA-graph replay on fresh ids, L2 flushed before each."""

    def __init__(self, repeats: int):
        self.repeats = repeats
        self.flush = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")

    def run(self, lookup: Any, id_sets: list[Any], t: int) -> list[float]:
        calls = max(1, min(20, (1 << 20) // (t * HEADS)))
        bufs = [torch.empty(t, HEADS, dtype=torch.int64, device="cuda") for _ in range(calls)]
        out = torch.empty(t, HEADS * WIDTH, dtype=torch.bfloat16, device="cuda")
        bufs[0].copy_(id_sets[0])
        lookup(bufs[0], out)  # compile outside capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for b in bufs:
                lookup(b, out)
        times = []
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for rep in range(self.repeats + 1):
            for i, b in enumerate(bufs):
                b.copy_(id_sets[(rep * calls + i) % len(id_sets)])
            self.flush.zero_()
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            if rep:  # the first replay warms the graph
                times.append(start.elapsed_time(end) * 1e3 / calls)
        return times


def summary(times: list[float], t: int, stored_bytes: int, base_us: float | None) -> dict:
    med = statistics.median(times)
    rows = t * HEADS
    return {
        "us": med,
        "us_min": min(times),
        "us_max": max(times),
        "rows_per_s": rows / med * 1e6,
        "GB_per_s": rows * stored_bytes / med / 1e3,
        "x_baseline": (base_us / med) if base_us else None,
    }


# -- ids -----------------------------------------------------------------------------------
class TextIds:
    """Real-text ids: part of the stream profiles hot rows (``profile``), the rest is timed."""

    def __init__(self, tokens_path: Path, profile: str = "halves"):
        meta = json.loads(tokens_path.with_suffix(".json").read_text())
        tokens = np.load(tokens_path).astype(np.int64)
        cfg = flash_next_config(vocab_size=meta["vocab_size"], eos_token_id=meta["eos_token_id"])
        self.geometry = PLEGeometry.from_config(cfg)
        half = tokens.size // 2
        self.all_ids = ngram_ids(self.geometry, tokens)
        starts = np.zeros(tokens.size, np.int64)
        eos = np.flatnonzero(tokens[:-1] == meta["eos_token_id"])
        starts[eos + 1] = 1
        self.doc = np.cumsum(starts)  # document number of each token
        if profile == "docs":  # even documents profile, odd documents are timed
            even = self.doc % 2 == 0
            profile_ids, self.eval_ids = self.all_ids[even].reshape(-1), self.all_ids[~even]
        else:  # the first half profiles, the second is timed
            profile_ids, self.eval_ids = self.all_ids[:half].reshape(-1), self.all_ids[half:]
        rows, counts = np.unique(profile_ids, return_counts=True)
        order = np.lexsort((rows, -counts))  # count descending, ties by id
        self.hot_rows = rows[order]
        self.meta = {**meta, "profile": profile, "profile_lookups": int(profile_ids.size),
                     "profile_distinct_rows": int(rows.size),
                     "eval_lookups": int(self.eval_ids.size)}  # fmt: skip

    def sets(self, t: int, n: int, rng: np.random.Generator, modulo: int) -> list[Any]:
        """``n`` id sets [t, 16] on the GPU (see :meth:`host_sets`)."""
        return [torch.from_numpy(s).cuda() for s in self.host_sets(t, n, rng, modulo)]

    def host_sets(self, t: int, n: int, rng: np.random.Generator, modulo: int) -> list[Any]:
        """``n`` id sets [t, 16]: random tokens (decode, t <= 512) or windows (prefill)."""
        out = []
        for _ in range(n):
            if t <= 512:
                sel = self.eval_ids[rng.integers(0, len(self.eval_ids), size=t)]
            else:
                s = int(rng.integers(0, max(1, len(self.eval_ids) - t)))
                sel = self.eval_ids[s : s + t]
                sel = np.resize(sel, (t, HEADS))
            out.append(sel % modulo)
        return out


def uniform_sets(t: int, n: int, rows: int) -> list[Any]:
    return [torch.randint(0, rows, (t, HEADS), device="cuda") for _ in range(n)]


# -- sections ------------------------------------------------------------------------------
def copy_ceilings(host: Any) -> dict:
    """H2D from pinned memory and device-to-device copy bandwidth (GB/s), 1 GiB each."""
    n = 1 << 30
    dev_a = torch.empty(n, dtype=torch.uint8, device="cuda")
    dev_b = torch.empty_like(dev_a)
    out = {}
    for name, fn in (("h2d", lambda: dev_a.copy_(host[:n], non_blocking=True)),
                     ("d2d", lambda: dev_b.copy_(dev_a))):  # fmt: skip
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        out[f"{name}_GB_per_s"] = 5 * n / (time.perf_counter() - t0) / 1e9
    return out


class Bench:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.timer = Timer(args.repeats) if torch.cuda.is_available() else None
        self.rng = np.random.default_rng(args.seed)
        self.text = TextIds(args.tokens, args.profile)
        self.results: list[dict] = []
        self.base_us: dict[tuple[str, int], float] = {}

    def id_sets(self, kind: str, t: int, rows: int) -> list[Any]:
        n = max(4, min(64, 4 * (1 << 20) // (t * HEADS)))
        if kind == "uniform":
            return uniform_sets(t, n, rows)
        return self.text.sets(t, n, self.rng, rows)

    def record(self, case: str, fmt: str, kind: str, t: int, times: list[float],
               stored_bytes: int, extra: dict | None = None) -> None:  # fmt: skip
        base = None if case == "baseline" else self.base_us.get((kind, t))
        row = {"case": case, "format": fmt, "ids": kind, "T": t,
               **summary(times, t, stored_bytes, base), **(extra or {})}  # fmt: skip
        if case == "baseline":
            self.base_us[(kind, t)] = row["us"]
        self.results.append(row)
        ratio = "" if row["x_baseline"] is None else f" x{row['x_baseline']:.2f}"
        hit = f" hit {row['hit_rate']:.1%}" if "hit_rate" in row else ""
        print(f"{case:>16} {fmt:>5} {kind:>7} T={t:>5}: {row['us']:10.1f} us "
              f"[{row['us_min']:.1f}..{row['us_max']:.1f}] {row['rows_per_s'] / 1e6:8.1f} M rows/s "
              f"{row['GB_per_s']:7.1f} GB/s{ratio}{hit}", flush=True)  # fmt: skip

    def table_cases(self, case: str, gpu: Any, fmt: str, rows: int, rec: int) -> None:
        def lookup(ids: Any, out: Any) -> None:
            gpu.lookup(ids, out=out)

        for kind in ("uniform", "text"):
            for t in TOKENS:
                self.record(
                    case, fmt, kind, t, self.timer.run(lookup, self.id_sets(kind, t, rows), t), rec
                )

    def baseline(self, host: Any) -> None:
        rows = self.args.baseline_rows
        self.table_cases("baseline", Baseline(host, rows), "bf16", rows, 2 * WIDTH)

    def uva(self, host: Any) -> None:
        if not self.base_us:
            self.baseline(host)
        for fmt in FORMATS:
            gpu = uva_table(host, fmt, self.args.rows)
            self.table_cases("uva", gpu, fmt, self.args.rows, gpu.layout.record_bytes)

    def device(self) -> None:
        for fmt in FORMATS:
            rec = get_codec(fmt).bytes_per_row(WIDTH)
            records = torch.randint(0, 256, (self.args.rows, rec), dtype=torch.uint8, device="cuda")
            gpu = GpuTable.from_records(get_codec(fmt), WIDTH, records, (0, self.args.rows),
                                        self.args.rows, shard_scale_2=[1e-3])  # fmt: skip
            self.table_cases("device", gpu, fmt, self.args.rows, rec)
            del gpu, records
            torch.cuda.empty_cache()

    def cache(self, host: Any) -> None:
        rows = self.args.rows
        gpu = uva_table(host, "int4", rows)
        for gb in (1, 2, 4):
            info = gpu.set_hot_rows(self.text.hot_rows, gb << 30)
            for kind in ("text", "uniform") if gb == 2 else ("text",):
                for t in TOKENS:
                    self._cache_case(gpu, f"cache {gb}GB", kind, t, info)
            if gb == 2:  # the same without sorting big steps (GpuTable.sort_min_ids)
                gpu.sort_min_ids = 0
                for kind in ("text", "uniform"):
                    for t in TOKENS[2:]:
                        self._cache_case(gpu, "cache 2GB unsorted", kind, t, info)
                gpu.sort_min_ids = CACHED_SORT_MIN_IDS
            torch.cuda.empty_cache()
        gpu = uva_table(host, "int4", rows)  # no cache, big steps sorted
        for kind in ("text", "uniform"):
            for t in TOKENS[2:]:
                self._cache_case(gpu, "uva sorted", kind, t, None)

    def _cache_case(self, gpu: Any, case: str, kind: str, t: int, info: Any) -> None:
        sets = self.id_sets(kind, t, self.args.rows)
        extra = {}
        if info is not None:
            hits = torch.stack([(gpu._slot_map[s] >= 0).float().mean() for s in sets])
            extra = {"hit_rate": float(hits.mean()), "cached_rows": info.rows,
                     "cache_bytes": info.bytes}  # fmt: skip
        times = self.timer.run(lambda ids, out: gpu.lookup(ids, out=out), sets, t)
        self.record(case, "int4", kind, t, times, 100, extra)

    def staged_sidecar(self, root: Path) -> Path:
        """The memory-mapped int4 sidecar of ``--staged-rows`` rows (written once per run)."""
        path = root / "int4"
        if not path.exists():
            t0 = time.perf_counter()
            build_repeated(root, self.args.staged_rows, self.rng)
            print(f"staged: wrote a {self.args.staged_rows:,}-row int4 sidecar in "
                  f"{time.perf_counter() - t0:.0f} s", file=sys.stderr)  # fmt: skip
        return path

    def staged(self, root: Path) -> None:
        rows = self.args.staged_rows
        table = open_table(self.staged_sidecar(root), "mmap")
        staged = StagedTable(table, max_ids=max(TOKENS) * HEADS)
        for kind in ("uniform", "text"):
            for t in TOKENS:
                sets = [s.cpu().numpy() for s in self.id_sets(kind, t, rows)][:8]
                self._staged_case(staged, kind, t, sets)
        graph_staged(self, table, rows)

    def _staged_case(self, staged: Any, kind: str, t: int, sets: list[np.ndarray]) -> None:
        out = torch.empty(t, HEADS * WIDTH, dtype=torch.bfloat16, device="cuda")
        staged.lookup(staged.stage(sets[0]), out)  # warm: compile, fault pages in
        torch.cuda.synchronize()
        latency, host, parts = [], [], []
        for rep in range(self.args.repeats):
            ids = sets[rep % len(sets)]
            t0 = time.perf_counter()
            batch = staged.stage(ids)
            t1 = time.perf_counter()
            staged.lookup(batch, out)
            torch.cuda.synchronize()
            latency.append((time.perf_counter() - t0) * 1e6)
            host.append((t1 - t0) * 1e6)
            parts.append(batch.host_us)
        breakdown = {k: statistics.median(p[k] for p in parts) for k in parts[0]}
        steps = 2 * len(sets)
        t0 = time.perf_counter()
        batch = staged.stage(sets[0])
        for i in range(1, steps + 1):
            staged.lookup(batch, out)
            if i < steps:
                batch = staged.stage(sets[i % len(sets)])
        torch.cuda.synchronize()
        pipelined = (time.perf_counter() - t0) * 1e6 / steps
        self.record("staged", "int4", kind, t, latency, 100,
                    {"host_stage_us": statistics.median(host), "pipelined_us": pipelined,
                     "unique_rows": batch.n_unique, **breakdown})  # fmt: skip
        print(f"{'':>16} host {statistics.median(host):.0f} us: "
              + ", ".join(f"{k} {v:.0f}" for k, v in breakdown.items())
              + f"; {batch.n_unique} unique rows; pipelined {pipelined:.0f} us/step")  # fmt: skip


def numpy_stage(table: Any, layout: Any, flat: np.ndarray, out: np.ndarray) -> int:
    """The previous StagedTable's host work, one thread: numpy dedup, gather_raw, pack."""
    lo, hi = table.row_range
    uniq, inverse = np.unique(np.where((flat >= lo) & (flat < hi), flat, -1), return_inverse=True)
    out[: 4 * flat.size].view(np.int32)[:] = inverse
    rec = 4 * flat.size + (-4 * flat.size) % 16
    recs = out[rec : rec + uniq.size * layout.record_bytes].reshape(uniq.size, -1)
    pack_records(layout, table.gather_raw(uniq), out=recs)
    return int(uniq.size)


def hit_rates(bench: Bench) -> None:
    """CPU only: the share of lookups a cache of the N hottest rows serves, for three ways of
    choosing the profile text: the first half of the stream for the second (the cache section),
    even documents for odd ones (same mix of sources), and the evaluated half itself (the
    ceiling a live refresh approaches)."""
    text = bench.text
    ids, doc = text.all_ids, text.doc
    half = ids.shape[0] // 2
    even = doc % 2 == 0
    splits = {"halves": (ids[:half], ids[half:]), "docs": (ids[even], ids[~even]),
              "self": (ids[half:], ids[half:])}  # fmt: skip
    for name, (prof, ev) in splits.items():
        rows, counts = np.unique(prof.reshape(-1), return_counts=True)
        order = rows[np.lexsort((rows, -counts))]
        flat = ev.reshape(-1)
        row = {"case": "hit-rates", "profile": name, "profile_rows": int(order.size)}
        for label, k in (("1M", 1 << 20), ("4M", 4 << 20), ("1GB", (1 << 30) // 100),
                         ("2GB", (2 << 30) // 100)):  # fmt: skip
            hot = np.sort(order[:k])
            pos = np.minimum(np.searchsorted(hot, flat), hot.size - 1)
            row[label] = float((hot[pos] == flat).mean())
        bench.results.append(row)
        print(
            f"hit rate, profile {name:>6} ({order.size / 1e6:.1f}M rows): "
            + " ".join(f"{k} {row[k]:.1%}" for k in ("1M", "4M", "1GB", "2GB")),
            flush=True,
        )


def staged_host(bench: Bench, root: Path) -> None:
    """CPU only: the staged path's host work per step (dedup + gather into the staging slot),
    numba (StagedTable) against numpy (the previous version), same ids, same table."""
    args, rng = bench.args, bench.rng
    table = open_table(bench.staged_sidecar(root), "mmap")
    staged = StagedTable(table, max_ids=8192 * HEADS, buffers=1, device="cpu")
    scratch = np.empty_like(staged._host_np[0])
    for kind in ("uniform", "text"):
        for t in (32, 512, 8192):
            n = 64 if t < 8192 else 8
            if kind == "uniform":
                sets = [rng.integers(0, args.staged_rows, (t, HEADS)) for _ in range(n)]
            else:
                sets = bench.text.host_sets(t, n, rng, args.staged_rows)
            ours, old, uniq = [], [], 0
            for rep in range(args.repeats * n + 1):
                ids = sets[rep % n]
                batch = staged.stage(ids)
                t0 = time.perf_counter()
                numpy_stage(table, staged.layout, ids.reshape(-1), scratch)
                if rep:  # the first call compiles
                    old.append((time.perf_counter() - t0) * 1e6)
                    ours.append(batch.host_us["dedup_gather_us"])
                uniq = batch.n_unique
            med, med_old = statistics.median(ours), statistics.median(old)
            bench.results.append({"case": "staged-host", "ids": kind, "T": t, "us": med,
                                  "us_min": min(ours), "us_max": max(ours), "numpy_us": med_old,
                                  "unique_rows": uniq})  # fmt: skip
            print(f"staged-host int4 {kind:>7} T={t:>5}: numba {med:8.1f} us "
                  f"[{min(ours):.1f}..{max(ours):.1f}]  numpy {med_old:8.1f} us  "
                  f"x{med_old / med:.1f}  ({uniq} unique rows)", flush=True)  # fmt: skip


def graph_staged(bench: Bench, table: Any, rows: int) -> None:
    """(d') the staged path inside a CUDA graph (GraphStagedTable): per step the graph is
    launched first and waits on the flag while the host stages the step's ids."""
    from flashnext.kernels import GraphStagedTable

    for kind in ("uniform", "text"):
        for t in TOKENS[:3]:
            sets = [s.cpu().numpy() for s in bench.id_sets(kind, t, rows)][:8]
            staged = GraphStagedTable(table, (t, HEADS), prefault=False)
            out = torch.empty(t, HEADS * WIDTH, dtype=torch.bfloat16, device="cuda")
            staged.stage(sets[0])
            staged.lookup(out)  # compile outside capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                staged.lookup(out)
            latency, host = [], []
            for rep in range(max(bench.args.repeats, 20)):
                t0 = time.perf_counter()
                graph.replay()
                batch = staged.stage(sets[rep % len(sets)])
                torch.cuda.synchronize()
                latency.append((time.perf_counter() - t0) * 1e6)
                host.append(batch.host_us["dedup_gather_us"])
            steps = 4 * len(sets)
            t0 = time.perf_counter()
            for i in range(steps):
                graph.replay()
                staged.stage(sets[i % len(sets)])
            torch.cuda.synchronize()
            pipelined = (time.perf_counter() - t0) * 1e6 / steps
            bench.record("graph-staged", "int4", kind, t, latency, 100,
                         {"dedup_gather_us": statistics.median(host), "pipelined_us": pipelined,
                          "unique_rows": batch.n_unique})  # fmt: skip
            print(
                f"{'':>16} host dedup+gather {statistics.median(host):.0f} us; "
                f"{batch.n_unique} unique rows; pipelined {pipelined:.0f} us/step",
                flush=True,
            )


def build_repeated(root: Path, rows: int, rng: np.random.Generator) -> Path:
    """An int4 sidecar of ``rows`` rows (2,500,012 per shard) whose shards all hold one random
    shard's bytes, written by 8 threads: a 320M-row table in about a minute, not several.
    Timings depend on which addresses are read, not on the values."""
    from concurrent.futures import ThreadPoolExecutor

    from flashnext.ple.destination import SidecarWriter
    from flashnext.ple.sidecar import write_shard_file

    shard_rows = min(SHARD_ROWS, rows)
    writer = SidecarWriter(root / "int4", "int4", WIDTH, rows // shard_rows * shard_rows,
                           shard_rows)  # fmt: skip
    writer.start()
    tensors = random_shard("int4", shard_rows, rng)

    def one(i: int) -> dict:
        start, end = writer.shard_rows(i)
        return write_shard_file(writer.path, writer.codec, WIDTH, i, start, end - start, tensors,
                                table_rows=writer.num_rows)  # fmt: skip

    with ThreadPoolExecutor(8) as pool:
        for record in pool.map(one, range(writer.num_shards)):
            writer.adopt(record)
    writer.finish()
    return root / "int4"


def staged_cache(bench: Bench, root: Path) -> None:
    """(f) StagedTable and GraphStagedTable behind a device cache of the profile's hot rows
    (``set_hot_rows``: none, 1 GB, 2 GB), text ids. Latency = stage + lookup + synchronize;
    the graph is launched first and waits on the flag while the host stages (as graph_staged).
    Records the hit rate, the unique (missed) rows staged and the host bytes each path pins."""
    from flashnext.kernels import GraphStagedTable

    rows = bench.args.staged_rows
    table = open_table(bench.staged_sidecar(root), "mmap")
    staged = StagedTable(table, max_ids=max(TOKENS) * HEADS)
    sets = {t: bench.text.host_sets(t, 8, bench.rng, rows) for t in TOKENS}
    for gb in (0, 1, 2):
        t0 = time.perf_counter()
        info = staged.set_hot_rows(bench.text.hot_rows, gb << 30)
        print(f"staged cache {gb} GB: {info.rows:,} rows, {info.bytes / 1e9:.2f} GB on the device, "
              f"built in {time.perf_counter() - t0:.1f} s", flush=True)  # fmt: skip
        for t in TOKENS:
            hit = float(np.mean([(staged._slot_map[s] >= 0).mean() for s in sets[t]])
                        if info.rows else 0.0)  # fmt: skip
            extra = {"hit_rate": hit, "cached_rows": info.rows, "cache_bytes": info.bytes,
                     "pinned_bytes": staged.pinned_bytes}  # fmt: skip
            _time_staged(bench, staged, f"staged cache {gb}GB", t, sets[t], extra)
            if t <= 8192:
                graph = GraphStagedTable(table, (t, HEADS), prefault=False)
                graph.share_cache(staged)
                extra = {**extra, "pinned_bytes": graph.pinned_bytes}
                _time_graph_staged(bench, graph, f"graph-staged cache {gb}GB", t, sets[t], extra)
                del graph
        torch.cuda.empty_cache()


def _time_staged(bench: Bench, staged: Any, case: str, t: int, sets: list, extra: dict) -> None:
    out = torch.empty(t, HEADS * WIDTH, dtype=torch.bfloat16, device="cuda")
    staged.lookup(staged.stage(sets[0]), out)  # warm: compile
    torch.cuda.synchronize()
    latency, unique = [], []
    for rep in range(max(bench.args.repeats, 20)):
        t0 = time.perf_counter()
        batch = staged.stage(sets[rep % len(sets)])
        staged.lookup(batch, out)
        torch.cuda.synchronize()
        latency.append((time.perf_counter() - t0) * 1e6)
        unique.append(batch.n_unique)
    steps = 2 * len(sets)
    t0 = time.perf_counter()
    batch = staged.stage(sets[0])
    for i in range(1, steps + 1):
        staged.lookup(batch, out)
        if i < steps:
            batch = staged.stage(sets[i % len(sets)])
    torch.cuda.synchronize()
    pipelined = (time.perf_counter() - t0) * 1e6 / steps
    bench.record(case, "int4", "text", t, latency, 100, {**extra, "pipelined_us": pipelined,
                 "unique_rows": int(statistics.median(unique))})  # fmt: skip


def _time_graph_staged(bench: Bench, staged: Any, case: str, t: int, sets: list,
                       extra: dict) -> None:  # fmt: skip
    out = torch.empty(t, HEADS * WIDTH, dtype=torch.bfloat16, device="cuda")
    staged.stage(sets[0])
    staged.lookup(out)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        staged.lookup(out)
    latency, unique = [], []
    for rep in range(max(bench.args.repeats, 20)):
        t0 = time.perf_counter()
        graph.replay()
        batch = staged.stage(sets[rep % len(sets)])
        torch.cuda.synchronize()
        latency.append((time.perf_counter() - t0) * 1e6)
        unique.append(batch.n_unique)
    steps = 4 * len(sets)
    t0 = time.perf_counter()
    for i in range(steps):
        graph.replay()
        staged.stage(sets[i % len(sets)])
    torch.cuda.synchronize()
    pipelined = (time.perf_counter() - t0) * 1e6 / steps
    bench.record(case, "int4", "text", t, latency, 100, {**extra, "pipelined_us": pipelined,
                 "unique_rows": int(statistics.median(unique))})  # fmt: skip


def uva_table(host: Any, fmt: str, rows: int) -> Any:
    """A GpuTable over the first bytes of the pinned buffer (contents: whatever is there)."""
    codec = get_codec(fmt)
    rec = codec.bytes_per_row(WIDTH)
    records = host[: rows * rec].view(rows, rec)
    starts = np.arange(0, rows, SHARD_ROWS, dtype=np.int64)
    s2 = np.full(starts.size, 1e-3, np.float32) if fmt == "nvfp4" else None
    return GpuTable.from_records(codec, WIDTH, records, (0, rows), rows, starts, s2)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=Path, help="int32 token stream .npy (with a .json beside)")
    ap.add_argument("--baseline-rows", type=int, default=160_000_000)
    ap.add_argument("--rows", type=int, default=320_001_536, help="rows of our UVA/device tables")
    ap.add_argument("--staged-rows", type=int, default=40_000_000)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument(
        "--sections",
        default="ceilings,uva,cache,device,staged",
        help="comma-separated: ceilings, baseline, uva, cache, device, staged, staged-cache, "
        "staged-host (CPU only: the staged path's host work, numba vs numpy), "
        "hit-rates (CPU only: cache hit rates for three choices of profile text)",
    )
    ap.add_argument("--profile", choices=("halves", "docs"), default="halves",
                    help="hot rows from the text's first half, timed on the second (halves), "
                    "or from its even documents, timed on the odd ones (docs)")  # fmt: skip
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args()
    if args.tokens is None:
        ap.error("--tokens is required (make one with bench/text_tokens.py)")
    args.seed = (
        args.seed if args.seed is not None else int(np.random.SeedSequence().entropy % 2**32)
    )
    sections = set(args.sections.split(","))
    bench = Bench(args)
    tmp = tempfile.TemporaryDirectory()
    root = Path(tmp.name)
    extra: dict[str, Any] = {}
    if "hit-rates" in sections:  # CPU only
        hit_rates(bench)
    if "staged-host" in sections:  # CPU only
        print(f"{platform.machine()}, {os.cpu_count()} cores, seed {args.seed}", flush=True)
        staged_host(bench, root)
    if sections - {"staged-host", "hit-rates"}:
        extra = gpu_sections(bench, sections, root)
    tmp.cleanup()
    if args.json:
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        record = {"device": device, "flashnext": __version__,
                  "python": platform.python_version(), "torch": torch.__version__,
                  "triton": triton.__version__, "args": {k: str(v) for k, v in vars(args).items()},
                  "text": bench.text.meta, **extra, "results": bench.results}  # fmt: skip
        args.json.write_text(json.dumps(record, indent=1))
    return 0


def gpu_sections(bench: Bench, sections: set[str], root: Path) -> dict[str, Any]:
    """Run the GPU sections; returns the copy ceilings (empty unless asked for)."""
    args = bench.args
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"seed {args.seed}", flush=True)  # fmt: skip
    print(f"text ids: {bench.text.meta}", flush=True)
    host_bytes = max(
        args.baseline_rows * 2 * WIDTH, args.rows * get_codec("fp8").bytes_per_row(WIDTH)
    )
    t0 = time.perf_counter()
    host = torch.empty(host_bytes if sections & {"uva", "cache", "ceilings", "baseline"}
                       else 1 << 30, dtype=torch.uint8, pin_memory=True)  # fmt: skip
    print(f"pinned {host.numel() / 1e9:.1f} GB in {time.perf_counter() - t0:.0f} s", flush=True)
    extra: dict[str, Any] = {}
    if "ceilings" in sections:
        extra = copy_ceilings(host)
        print(f"copy ceilings: {extra}", flush=True)
    for name in ("baseline", "uva", "cache"):
        if name in sections:
            getattr(bench, name)(host)
    del host
    if "device" in sections:
        bench.device()
    if "staged" in sections:
        bench.staged(root)
    if "staged-cache" in sections:
        staged_cache(bench, root)
    return extra


if __name__ == "__main__":
    sys.exit(main())

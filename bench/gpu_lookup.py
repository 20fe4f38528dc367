"""Benchmark: GPU PLE lookups (fused gather + dequant) against vLLM 0.33's BF16 UVA copy, same run.

    python bench/gpu_lookup.py --tokens TOKENS.npy [--baseline-rows N] [--rows N]
        [--staged-rows N] [--shard-rows N] [--repeats K] [--rounds N] [--sections ...] [--sizes 32,512,...]
        [--device cuda|cpu] [--json PATH]

One run on one CUDA GPU: (0) H2D and device-to-device copy ceilings; then for T in
{32, 512, 8192, 65536} tokens x 16 heads, uniform ids and ids hashed from real text
(``--tokens``: an int32 token stream, documents joined by EOS, with a ``.json`` beside it
giving ``vocab_size`` and ``eos_token_id``; made by ``bench/text_tokens.py`` from local text as
``flashnext demo`` does), hashed with the real layer-0 geometry (20M base, 320,001,536 rows):
(a) baseline: vLLM 0.33's kernel copying raw BF16 rows over UVA from a pinned table of
``--baseline-rows`` rows; (b) ours over UVA for fp8/int4/nvfp4 at ``--rows`` rows; (c) ours
from device memory; (d) the staged path from a memory-mapped int4 sidecar of ``--staged-rows``
rows; (e) int4 over UVA behind a device cache of the hottest rows of the text's first half
(1, 2, 4 GB), timed on the second half; (f) ``staged-cache``: the staged and graph-staged paths
(the graph one copying the slot after the driver's stream wait for the flag; with
``copy_slot=False`` its kernel reads the pinned slot over UVA and polls the flag itself, "uva",
or runs after the driver's stream wait, "uva stream")
behind a device cache of those hot rows (none, 1, 2 GB), text ids, with the host bytes each
pins; ``staged-host``: the staged path's host work alone, no torch (bench/_staged_host.py).
The staged sidecar is warmed as ``flashnext ple warm`` leaves it (2 MiB page-cache folios where
the filesystem has them); the share of its maps on 2 MiB pages is printed and recorded. Each
timing replays a CUDA graph of several lookups
on fresh ids after flushing L2; the median of ``--repeats`` and the spread (min..max) are
printed with rows/s, useful GB/s (stored bytes gathered), hit rate and the ratio to (a).

The synthetic tables have the released layout (bench/_common.py): 128 shards of
``ceil(rows / 128)`` rows (2,500,012 at 320,001,536 rows), or ``--shard-rows``.
``--device cpu`` runs the sections Triton's interpreter can (``TRITON_INTERPRET=1``, torch CPU
tensors; timed eagerly, no CUDA graphs, no L2 flush): a check that the script runs, at a tiny
size, not a measurement. ``hit-rates`` needs neither torch nor a GPU.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from _common import (
    add_shard_rows_option,
    build_repeated,
    device_refusal,
    positive_int,
    shard_starts,
)

from flashnext import __version__
from flashnext.host import open_table
from flashnext.ple.formats import get_codec
from flashnext.ple.geometry import PLEGeometry
from flashnext.ple.hashing import ngram_ids
from flashnext.synthetic import flash_next_config

try:  # --help, hit-rates and the JSON need neither; the other sections check for them
    import torch
    import triton
except ImportError:
    torch = triton = None

HEADS, WIDTH = 16, 160
TOKENS = (32, 512, 8192, 65536)
FORMATS = ("fp8", "int4", "nvfp4")
SECTIONS = ("ceilings", "baseline", "uva", "cache", "device", "staged", "staged-cache",
            "staged-host", "hit-rates")  # fmt: skip
HOST_ONLY = {"hit-rates", "staged-host"}  # need no torch
# What Triton's interpreter cannot run with CPU tensors, and why (printed when skipped).
NOT_ON_CPU = {
    "ceilings": "H2D and device copy bandwidth mean nothing without a GPU",
    "cache": "a hot-row cache serves pinned tables, and on the CPU every table is device-placed",
    "graph-staged": "GraphStagedTable is a CUDA graph",
}


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def pipelined_us(staged: Any, sets: list[Any], out: Any, passes: int = 2) -> float:
    """Microseconds per step with staging overlapped: step i+1 is staged while step i's lookup
    runs, ``passes`` passes over ``sets``."""
    steps = passes * len(sets)
    t0 = time.perf_counter()
    batch = staged.stage(sets[0])
    for i in range(1, steps + 1):
        staged.lookup(batch, out)
        if i < steps:
            batch = staged.stage(sets[i % len(sets)])
    synchronize()
    return (time.perf_counter() - t0) * 1e6 / steps


# -- timing --------------------------------------------------------------------------------
class Timer:
    """Times ``calls`` lookups per CUDA-graph replay on fresh ids, L2 flushed before each.
    On ``cpu`` (Triton's interpreter): one eager call per repeat, wall clock."""

    def __init__(self, repeats: int, device: str):
        self.repeats = repeats
        self.device = device
        on_gpu = device != "cpu"
        self.flush = torch.empty(512 << 20 if on_gpu else 1, dtype=torch.uint8, device=device)

    def run(self, lookup: Any, id_sets: list[Any], t: int) -> list[float]:
        if self.device == "cpu":
            return self._run_eager(lookup, id_sets, t)
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

    def _run_eager(self, lookup: Any, id_sets: list[Any], t: int) -> list[float]:
        out = torch.empty(t, HEADS * WIDTH, dtype=torch.bfloat16)
        times = []
        for rep in range(self.repeats):
            ids = id_sets[rep % len(id_sets)]
            t0 = time.perf_counter()
            lookup(ids, out)
            times.append((time.perf_counter() - t0) * 1e6)
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
        self.profile_rows = rows[order]
        self.meta = {**meta, "profile": profile, "profile_lookups": int(profile_ids.size),
                     "profile_distinct_rows": int(rows.size),
                     "eval_lookups": int(self.eval_ids.size)}  # fmt: skip

    def sets(self, t: int, n: int, rng: np.random.Generator, modulo: int, device: str) -> list[Any]:
        """``n`` id sets [t, 16] on ``device`` (see :meth:`host_sets`)."""
        return [torch.from_numpy(s).to(device) for s in self.host_sets(t, n, rng, modulo)]

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


def uniform_sets(t: int, n: int, rows: int, device: str) -> list[Any]:
    return [torch.randint(0, rows, (t, HEADS), device=device) for _ in range(n)]


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
        self.device = args.device
        self.sizes = args.sizes
        self.timer = Timer(args.repeats, args.device) if torch is not None else None
        self.rng = np.random.default_rng(args.seed)
        self.text = TextIds(args.tokens, args.profile)
        self.results: list[dict] = []
        self.base_us: dict[tuple[str, int], float] = {}

    def id_sets(self, kind: str, t: int, rows: int) -> list[Any]:
        n = max(4, min(64, 4 * (1 << 20) // (t * HEADS)))
        if self.device == "cpu":
            n = 2  # the interpreter: a check that it runs, not a measurement
        if kind == "uniform":
            return uniform_sets(t, n, rows, self.device)
        return self.text.sets(t, n, self.rng, rows, self.device)

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
            for t in self.sizes:
                self.record(
                    case, fmt, kind, t, self.timer.run(lookup, self.id_sets(kind, t, rows), t), rec
                )

    def baseline(self, host: Any) -> None:
        from _vllm_baseline import Baseline

        rows = self.args.baseline_rows
        baseline = Baseline(host, rows, WIDTH, self.device)
        self.table_cases("baseline", baseline, "bf16", rows, 2 * WIDTH)

    def uva(self, host: Any) -> None:
        if not self.base_us:
            self.baseline(host)
        for fmt in FORMATS:
            gpu = uva_table(host, fmt, self.args.rows, self.args.shard_rows, self.device)
            self.table_cases("uva", gpu, fmt, self.args.rows, gpu.layout.record_bytes)

    def on_device(self) -> None:
        """(c) every format from device memory."""
        from flashnext.kernels import GpuTable

        rows = self.args.rows
        for fmt in FORMATS:
            rec = get_codec(fmt).bytes_per_row(WIDTH)
            records = torch.randint(0, 256, (rows, rec), dtype=torch.uint8, device=self.device)
            gpu = GpuTable.from_records(get_codec(fmt), WIDTH, records, (0, rows), rows,
                                        shard_scale_2=[1e-3], device=self.device)  # fmt: skip
            self.table_cases("device", gpu, fmt, rows, rec)
            del gpu, records
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    def cache(self, host: Any) -> None:
        from flashnext.kernels.table import CACHED_SORT_MIN_IDS

        rows, sizes = self.args.rows, self.sizes
        gpu = uva_table(host, "int4", rows, self.args.shard_rows, self.device)
        for gb in (1, 2, 4):
            info = gpu.set_device_cache(self.text.profile_rows, gb << 30)
            for kind in ("text", "uniform") if gb == 2 else ("text",):
                for t in sizes:
                    self._cache_case(gpu, f"cache {gb}GB", kind, t, info)
            if gb == 2:  # the same without sorting big steps (GpuTable.sort_min_ids)
                gpu.sort_min_ids = 0
                for kind in ("text", "uniform"):
                    for t in sizes[2:]:
                        self._cache_case(gpu, "cache 2GB unsorted", kind, t, info)
                gpu.sort_min_ids = CACHED_SORT_MIN_IDS
            torch.cuda.empty_cache()
        gpu = uva_table(host, "int4", rows, self.args.shard_rows, self.device)  # no cache, sorted
        for kind in ("text", "uniform"):
            for t in sizes[2:]:
                self._cache_case(gpu, "uva sorted", kind, t, None)

    def _cache_case(self, gpu: Any, case: str, kind: str, t: int, info: Any) -> None:
        sets = self.id_sets(kind, t, self.args.rows)
        extra = {}
        if info is not None:
            hits = torch.stack([(gpu.slot_map[s] >= 0).float().mean() for s in sets])
            extra = {"hit_rate": float(hits.mean()), "cached_rows": info.rows,
                     "cache_bytes": info.bytes}  # fmt: skip
        times = self.timer.run(lambda ids, out: gpu.lookup(ids, out=out), sets, t)
        self.record(case, "int4", kind, t, times, 100, extra)

    def staged_sidecar(self, root: Path) -> Path:
        """The memory-mapped int4 sidecar of ``--staged-rows`` rows (written once per run;
        every shard the same random bytes: the timings depend on addresses, not values), warm
        in the page cache as ``flashnext ple warm`` leaves a served table: on 2 MiB folios
        where the filesystem has them (when under half the written file maps on 2 MiB pages,
        it is flushed, dropped and read again by ``PLETable.warm``)."""
        from lookup import evict, huge_mapped_fraction

        path = root / "int4"
        if path.exists():
            return path
        t0 = time.perf_counter()
        build_repeated(root, "int4", self.args.staged_rows, self.rng, self.args.shard_rows)
        t1 = time.perf_counter()
        with open_table(path, "mmap") as table:
            table.populate_maps()
            share = huge_mapped_fraction(path)
        if share is None or share < 0.5:
            evict(path)
            with open_table(path, "mmap") as table:
                table.warm(background=False, populate=True)
                share = huge_mapped_fraction(path)
        huge = "-" if share is None else f"{share:.0%}"
        print(f"staged: wrote a {self.args.staged_rows:,}-row int4 sidecar in {t1 - t0:.0f} s, "
              f"warm in {time.perf_counter() - t1:.0f} s, {huge} of it on 2 MiB pages",
              flush=True)  # fmt: skip
        return path

    def huge_share(self, root: Path) -> None:
        """Print the share of this process's maps of the staged sidecar on 2 MiB pages."""
        from lookup import huge_mapped_fraction

        share = huge_mapped_fraction(root / "int4")
        self.results.append({"case": "staged maps", "huge_page_share": share})
        print(f"staged maps on 2 MiB pages: {'-' if share is None else f'{share:.1%}'}", flush=True)

    def staged(self, root: Path) -> None:
        from flashnext.kernels import StagedTable

        rows = self.args.staged_rows
        table = open_table(self.staged_sidecar(root), "mmap")
        staged = StagedTable(table, max_ids=max(self.sizes) * HEADS, device=self.device)
        self.huge_share(root)
        for kind in ("uniform", "text"):
            for t in self.sizes:
                sets = [s.cpu().numpy() for s in self.id_sets(kind, t, rows)][:8]
                self._staged_case(staged, kind, t, sets)
        if self.device == "cpu":
            print(f"skipped graph-staged: {NOT_ON_CPU['graph-staged']}", flush=True)
        else:
            graph_staged(self, table, rows)

    def _staged_case(self, staged: Any, kind: str, t: int, sets: list[np.ndarray]) -> None:
        out = torch.empty(t, HEADS * WIDTH, dtype=torch.bfloat16, device=self.device)
        staged.lookup(staged.stage(sets[0]), out)  # warm: compile, fault pages in
        synchronize()
        latency, host, parts = [], [], []
        for rep in range(self.args.repeats):
            ids = sets[rep % len(sets)]
            t0 = time.perf_counter()
            batch = staged.stage(ids)
            t1 = time.perf_counter()
            staged.lookup(batch, out)
            synchronize()
            latency.append((time.perf_counter() - t0) * 1e6)
            host.append((t1 - t0) * 1e6)
            parts.append(batch.host_us)
        breakdown = {k: statistics.median(p[k] for p in parts) for k in parts[0]}
        pipelined = pipelined_us(staged, sets, out)
        self.record("staged", "int4", kind, t, latency, 100,
                    {"host_stage_us": statistics.median(host), "pipelined_us": pipelined,
                     "unique_rows": batch.n_unique, **breakdown})  # fmt: skip
        print(f"{'':>16} host {statistics.median(host):.0f} us: "
              + ", ".join(f"{k} {v:.0f}" for k, v in breakdown.items())
              + f"; {batch.n_unique} unique rows; pipelined {pipelined:.0f} us/step")  # fmt: skip


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


def graph_staged(bench: Bench, table: Any, rows: int) -> None:
    """(d') the staged path inside a CUDA graph (GraphStagedTable): per step the graph is
    launched first and waits on the flag while the host stages the step's ids."""
    from flashnext.kernels import GraphStagedTable

    for kind in ("uniform", "text"):
        for t in [t for t in bench.sizes if t <= 8192]:
            sets = [s.cpu().numpy() for s in bench.id_sets(kind, t, rows)][:8]
            staged = GraphStagedTable(table, (t, HEADS), prefault=False)
            timed = [sets[0]] + [sets[i % len(sets)] for i in range(max(bench.args.repeats, 20))]
            latency, batches, pipelined, _ = _replay_graph_staged(bench, staged, t, timed,
                                                                  4 * sets)  # fmt: skip
            host = [b.host_us["dedup_gather_us"] for b in batches]
            batch = batches[-1]
            bench.record("graph-staged", "int4", kind, t, latency, 100,
                         {"dedup_gather_us": statistics.median(host), "pipelined_us": pipelined,
                          "unique_rows": batch.n_unique})  # fmt: skip
            print(
                f"{'':>16} host dedup+gather {statistics.median(host):.0f} us; "
                f"{batch.n_unique} unique rows; pipelined {pipelined:.0f} us/step",
                flush=True,
            )


def staged_cache(bench: Bench, root: Path) -> None:
    """(f) StagedTable and GraphStagedTable behind a device cache of the profile's hot rows
    (``set_device_cache``: none, 1 GB, 2 GB), text ids. Latency = stage + lookup + synchronize;
    the graph is launched first and waits on the flag while the host stages (as graph_staged).
    Records the hit rate, the unique (missed) rows staged and the host bytes each path pins.

    Every timed step stages ids of its own (:class:`FreshSteps`): a step's missed rows are
    then as cold in the CPU's caches as a served model's (each decode step reads new n-grams),
    not rows an earlier step or path of the run has just gathered."""
    from flashnext.kernels import StagedTable

    rows = bench.args.staged_rows
    table = open_table(bench.staged_sidecar(root), "mmap")
    staged = StagedTable(table, max_ids=max(bench.sizes) * HEADS, device=bench.device)
    bench.huge_share(root)
    # the timed ids are taken modulo the table's rows; so are the profile's rows (a no-op at the
    # full 320,001,536 rows; below it, the profile would otherwise miss the ids it predicts)
    profile_rows = bench.text.profile_rows % rows
    if bench.device == "cpu":
        print(f"skipped graph-staged cache: {NOT_ON_CPU['graph-staged']}", flush=True)
    for gb in (0, 1, 2):
        t0 = time.perf_counter()
        info = staged.set_device_cache(profile_rows, gb << 30)
        print(f"staged cache {gb} GB: {info.rows:,} rows, {info.bytes / 1e9:.2f} GB on the device, "
              f"built in {time.perf_counter() - t0:.1f} s", flush=True)  # fmt: skip
        for t in bench.sizes:
            steps = FreshSteps(bench, t, rows)
            hit = float(np.mean([(staged.slot_map[s] >= 0).mean() for s in steps.draw(4)])
                        if info.rows else 0.0)  # fmt: skip
            extra = {"hit_rate": hit, "cached_rows": info.rows, "cache_bytes": info.bytes,
                     "pinned_bytes": staged.pinned_bytes}  # fmt: skip
            _time_staged(bench, staged, f"staged cache {gb}GB", t, steps, extra)
            for _ in range(bench.args.rounds if t <= 8192 and bench.device != "cpu" else 0):
                for copy_slot, wait, how in GRAPH_VARIANTS:
                    _graph_staged_cache(bench, table, staged, f"graph-staged cache {gb}GB{how}",
                                        t, steps, extra, copy_slot, wait)  # fmt: skip
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


class FreshSteps:
    """Text id sets ``[t, 16]`` for timed steps, each drawn once (random tokens of the timed
    documents for decode sizes, windows for prefill); ``reps``: the timed steps per case
    (more for small steps, whose times are short and noisy)."""

    def __init__(self, bench: Bench, t: int, rows: int):
        self.bench, self.t, self.rows = bench, t, rows
        on_cpu = bench.device == "cpu"
        self.reps = (
            bench.args.repeats if on_cpu else max(bench.args.repeats, 100 if t <= 512 else 20)
        )

    def draw(self, n: int) -> list[np.ndarray]:
        return self.bench.text.host_sets(self.t, n, self.bench.rng, self.rows)


#: GraphStagedTable variants timed behind a cache: (copy_slot, wait, case name suffix).
GRAPH_VARIANTS = ((True, "stream", ""), (False, "spin", " uva"), (False, "stream", " uva stream"))


def _graph_staged_cache(bench: Bench, table: Any, staged: Any, case: str, t: int,
                        steps: FreshSteps, extra: dict, copy_slot: bool,
                        wait: str) -> None:  # fmt: skip
    """One GraphStagedTable for steps of ``t`` tokens, sharing ``staged``'s device cache
    (``copy_slot=False``: the kernel reads the pinned slot through UVA, no copy; ``wait``:
    the lookup kernel polls the flag itself, or the driver's stream wait)."""
    from flashnext.kernels import GraphStagedTable

    graph = GraphStagedTable(table, (t, HEADS), prefault=False, copy_slot=copy_slot, wait=wait)
    graph.share_cache(staged)
    _time_graph_staged(bench, graph, case, t, steps, {**extra, "pinned_bytes": graph.pinned_bytes})


def _time_staged(bench: Bench, staged: Any, case: str, t: int, steps: FreshSteps,
                 extra: dict) -> None:  # fmt: skip
    out = torch.empty(t, HEADS * WIDTH, dtype=torch.bfloat16, device=bench.device)
    sets = steps.draw(steps.reps + 1)
    staged.lookup(staged.stage(sets[0]), out)  # warm: compile
    synchronize()
    latency, unique, parts = [], [], []
    for ids in sets[1:]:
        t0 = time.perf_counter()
        batch = staged.stage(ids)
        staged.lookup(batch, out)
        synchronize()
        latency.append((time.perf_counter() - t0) * 1e6)
        unique.append(batch.n_unique)
        parts.append(batch.host_us)
    pipelined = pipelined_us(staged, steps.draw(steps.reps), out, passes=1)
    host = {k: statistics.median(p[k] for p in parts) for k in parts[0]}
    bench.record(case, "int4", "text", t, latency, 100, {**extra, "pipelined_us": pipelined,
                 "unique_rows": int(statistics.median(unique)), **host})  # fmt: skip
    print(f"{'':>16} host " + ", ".join(f"{k} {v:.0f}" for k, v in host.items()), flush=True)


def _time_graph_staged(bench: Bench, staged: Any, case: str, t: int, steps: FreshSteps,
                       extra: dict) -> None:  # fmt: skip
    latency, batches, pipelined, graph = _replay_graph_staged(
        bench, staged, t, steps.draw(steps.reps + 1), steps.draw(steps.reps)
    )
    unique = [b.n_unique for b in batches]
    fill = statistics.median(b.host_us["dedup_gather_us"] for b in batches)
    gpu = _graph_without_host(staged, graph, steps.draw(steps.reps))
    bench.record(case, "int4", "text", t, latency, 100, {**extra, "pipelined_us": pipelined,
                 "unique_rows": int(statistics.median(unique)), "host_fill_us": fill,
                 "replay_gpu_sync_us": gpu})  # fmt: skip
    print(f"{'':>16} host fill {fill:.1f} us; replay + GPU + sync with the slot already "
          f"filled {gpu:.1f} us", flush=True)  # fmt: skip


def _graph_without_host(staged: Any, graph: Any, sets: list) -> float:
    """Median us of replay + synchronize of ``staged``'s captured ``graph`` when the host
    filled the slot before the launch (one step per set): what a step costs beyond the
    host's fill."""
    times = []
    for ids in sets:
        staged.stage(ids)
        t0 = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def _replay_graph_staged(bench: Bench, staged: Any, t: int, sets: list,
                         pipe_sets: list) -> tuple[list, list, float, Any]:  # fmt: skip
    """Capture ``staged``'s lookup for steps of ``t`` tokens in a CUDA graph and time it: per
    step the graph is launched first and waits on the flag while the host stages the step's
    ids (``sets[0]`` warms up, then one timed step per set), then ``pipe_sets`` back to back.
    Returns (latency us per step, the timed steps' StagedBatch, pipelined us per step,
    the graph)."""
    out = torch.empty(t, HEADS * WIDTH, dtype=torch.bfloat16, device="cuda")
    staged.stage(sets[0])
    staged.lookup(out)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        staged.lookup(out)
    latency, batches = [], []
    for ids in sets[1:]:
        t0 = time.perf_counter()
        graph.replay()
        batches.append(staged.stage(ids))
        torch.cuda.synchronize()
        latency.append((time.perf_counter() - t0) * 1e6)
    t0 = time.perf_counter()
    for ids in pipe_sets:
        graph.replay()
        staged.stage(ids)
    torch.cuda.synchronize()
    return latency, batches, (time.perf_counter() - t0) * 1e6 / len(pipe_sets), graph


def uva_table(host: Any, fmt: str, rows: int, shard_rows: int | None, device: str) -> Any:
    """A GpuTable over the first bytes of the pinned buffer (contents: whatever is there),
    shards as bench/_common.py lays them out. On ``cpu`` the buffer is plain memory."""
    from flashnext.kernels import GpuTable

    codec = get_codec(fmt)
    rec = codec.bytes_per_row(WIDTH)
    records = host[: rows * rec].view(rows, rec)
    starts = shard_starts(rows, shard_rows)
    s2 = np.full(starts.size, 1e-3, np.float32) if fmt == "nvfp4" else None
    return GpuTable.from_records(codec, WIDTH, records, (0, rows), rows, shard_starts=starts,
                                 shard_scale_2=s2, device=device)  # fmt: skip


def comma_ints(text: str) -> list[int]:
    """argparse type: ``32,512`` -> [32, 512], each >= 1."""
    return [positive_int(x) for x in text.split(",") if x]


def comma_sections(text: str) -> list[str]:
    """argparse type: known section names, comma-separated."""
    names = [x for x in text.split(",") if x]
    unknown = [x for x in names if x not in SECTIONS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown section {', '.join(unknown) or '(none given)'}; choose from "
            + ", ".join(SECTIONS)
        )
    return names


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=Path, help="bench/text_tokens.py output .npy (its .json beside)")
    ap.add_argument("--baseline-rows", type=positive_int, default=160_000_000)
    ap.add_argument("--rows", type=positive_int, default=320_001_536,
                    help="rows of our UVA/device tables")  # fmt: skip
    ap.add_argument("--staged-rows", type=positive_int, default=40_000_000)
    add_shard_rows_option(ap)
    ap.add_argument("--repeats", type=positive_int, default=7)
    ap.add_argument("--rounds", type=positive_int, default=1,
                    help="staged-cache: time the graph-staged variants this many times in turn "
                    "(each round on fresh ids; a noisy machine drifts between cases)")  # fmt: skip
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument(
        "--sections",
        type=comma_sections,
        default=["ceilings", "uva", "cache", "device", "staged"],
        help="comma-separated: ceilings, baseline, uva, cache, device, staged, "
        "staged-cache (staged and graph-staged behind a 0/1/2 GB device cache), "
        "staged-host (the staged path's host work, this version against the previous one, "
        "with and without a 2 GB cache; no torch, no GPU), "
        "hit-rates (CPU only: cache hit rates for three choices of profile text)",
    )
    ap.add_argument("--sizes", type=comma_ints, default=list(TOKENS),
                    help="tokens per step T (x 16 heads ids), comma-separated")  # fmt: skip
    ap.add_argument("--profile", choices=("halves", "docs"), default="halves",
                    help="hot rows from the text's first half, timed on the second (halves), "
                    "or from its even documents, timed on the odd ones (docs)")  # fmt: skip
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: Triton's interpreter on CPU tensors (set TRITON_INTERPRET=1), "
                    "a check that the sections run, not a measurement")  # fmt: skip
    ap.add_argument("--json", type=Path, help="write the results here")
    return ap


def main() -> int:
    ap = parser()
    args = ap.parse_args()
    if args.tokens is None:
        ap.error("--tokens is required (make one with bench/text_tokens.py)")
    sections = set(args.sections)
    if sections - HOST_ONLY and torch is None:
        print(f"error: --sections {','.join(sorted(sections - HOST_ONLY))} need torch and triton "
              "(pip install 'flashnext[gpu]')", file=sys.stderr)  # fmt: skip
        return 1
    gpu_work = sections - HOST_ONLY
    refusal = device_refusal(args.device, not gpu_work or torch.cuda.is_available())
    if refusal:
        print(refusal, file=sys.stderr)
        return 1
    args.seed = (
        args.seed if args.seed is not None else int(np.random.SeedSequence().entropy % 2**32)
    )
    bench = Bench(args)
    extra: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        if "hit-rates" in sections:  # CPU only
            hit_rates(bench)
        if "staged-host" in sections:  # CPU only
            from _staged_host import staged_host

            staged_host(bench, root)
        if sections - {"staged-host", "hit-rates"}:
            extra = gpu_sections(bench, sections, root)
    if args.json:
        write_json(args, bench, extra)
    return 0


def write_json(args: argparse.Namespace, bench: Bench, extra: dict[str, Any]) -> None:
    """The run's record: environment, arguments, text ids, ceilings and every result."""
    on_gpu = torch is not None and torch.cuda.is_available() and args.device == "cuda"
    record = {"device": torch.cuda.get_device_name() if on_gpu else "cpu",
              "flashnext": __version__, "python": platform.python_version(),
              "torch": getattr(torch, "__version__", None),
              "triton": getattr(triton, "__version__", None),
              "args": {k: str(v) for k, v in vars(args).items()},
              "text": bench.text.meta, **extra, "results": bench.results}  # fmt: skip
    tmp = args.json.with_name(args.json.name + ".tmp")
    tmp.write_text(json.dumps(record, indent=1))
    tmp.replace(args.json)


def gpu_sections(bench: Bench, sections: set[str], root: Path) -> dict[str, Any]:
    """Run the GPU sections; returns the copy ceilings (empty unless asked for)."""
    args = bench.args
    cpu = args.device == "cpu"
    name = "Triton interpreter (CPU)" if cpu else torch.cuda.get_device_name()
    print(f"{name}, torch {torch.__version__}, triton {triton.__version__}, seed {args.seed}",
          flush=True)  # fmt: skip
    print(f"text ids: {bench.text.meta}", flush=True)
    for skipped in sorted(sections & set(NOT_ON_CPU)) if cpu else ():
        print(f"skipped {skipped}: {NOT_ON_CPU[skipped]}", flush=True)
        sections = sections - {skipped}
    host_bytes = max(
        args.baseline_rows * 2 * WIDTH, args.rows * get_codec("fp8").bytes_per_row(WIDTH)
    )
    host = None
    if sections & {"uva", "cache", "ceilings", "baseline"}:
        t0 = time.perf_counter()
        host = torch.empty(host_bytes, dtype=torch.uint8, pin_memory=not cpu)
        if cpu:  # rows whose contents nobody reads on a GPU, but the interpreter decodes them
            host.random_(0, 256)
        print(f"host buffer {host.numel() / 1e9:.1f} GB in {time.perf_counter() - t0:.0f} s",
              flush=True)  # fmt: skip
    extra: dict[str, Any] = {}
    if "ceilings" in sections:
        extra = copy_ceilings(host)
        print(f"copy ceilings: {extra}", flush=True)
    for name in ("baseline", "uva", "cache"):
        if name in sections:
            getattr(bench, name)(host)
    del host
    if "device" in sections:
        bench.on_device()
    if "staged" in sections:
        bench.staged(root)
    if "staged-cache" in sections:
        staged_cache(bench, root)
    return extra


if __name__ == "__main__":
    sys.exit(main())

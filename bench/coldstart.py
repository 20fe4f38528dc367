"""Benchmark: the first lookups after a cold start, memory-mapped, against warm and resident.

    python bench/coldstart.py [--base N] [--dir DIR] [--repeats K] [--steps S] [--json]

Builds an int4 sidecar with the released layout (128 shards; ``--base`` scales the rows per
shard down) and the geometry of ``flashnext demo`` (its byte-level BPE, trained on this
machine's text). Row ids come from real text hashed through that geometry: a hot-row profile
from the demo corpus, and held-out text (standard-library sources the tokenizer never saw)
for the measured requests: ``--steps`` decode steps of 32 requests (512 ids each), then one
8K-token prefill (131,072 ids).

Each cold scenario first evicts the shard files from the page cache (``posix_fadvise
(DONTNEED)``) and checks with ``mincore`` that no page is left. Scenarios, in each repeat:

- resident: an anonymous copy of the table (the baseline after warming);
- warm: memory-mapped, evicted, then ``table.warm()`` before the lookups, as a server that
  warms its table at start (or whose page cache ``flashnext ple warm`` filled): every page
  cached and mapped, on 2 MiB pages where the filesystem allows (the baseline of the cold
  start);
- cold: memory-mapped straight after eviction;
- cold + hot tier: the same with the top 5% rows of the profile copied at open;
- cold + warming: ``table.warm(background=True)`` started at open, lookups at once; then the
  time until fully warm, the lookups again, and anonymous memory (``/proc/self/smaps_rollup``)
  before opening and after warming.

After the repeats, after-warming against resident is measured in pairs: a table warmed from
cold while serving, and a resident copy beside it, run the workload ``--passes`` times each,
alternating.

Prints the median and spread (min..max) over repeats and the ratios cold / warm and
after-warming / resident (targets: <= 2x with a hot tier of <= 5%, <= 1.1x after warming),
with the worst repeat's ratio beside the median's: a user boots once. Then every repeat of
every scenario: its times, the page faults (minor/major) of the decode steps (this thread:
decode-sized lookups run on the caller's thread, so a background warmer's faults are not
counted), of the prefill and of the open (the process), and the share of the table's mapped
bytes on 2 MiB pages (``FilePmdMapped`` / ``Rss`` of its maps in /proc/self/smaps) before and
after the lookups, and the host probe taken right after the first step (``HostProbe``: how fast
this machine served random reads of private memory, and a fixed in-cache computation, at that
moment; a slow first step beside a slow probe is the host, beside a usual one it is the lookup).
The JSON holds the same per repeat (``per_repeat``) and the load average.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import statistics
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from _common import build_sidecar

from flashnext import __version__
from flashnext.host import open_table
from flashnext.host.preflight import page_cache_bytes
from flashnext.ple.geometry import PLEGeometry
from flashnext.ple.hashing import ngram_ids
from flashnext.store.profile import build_profile
from flashnext.synthetic import flash_next_config
from flashnext.text import EOS, corpus_files, train_tokenizer

REQUESTS = 32
PREFILL_TOKENS = 8192
HOT_SHARE = 0.05


# -- page cache ------------------------------------------------------------------------------
def evict(files: list[Path]) -> int:
    """Drop ``files`` from the page cache; returns the bytes still cached (0 when it worked)."""
    gc.collect()  # maps of closed tables must be gone: mapped pages are not dropped
    for path in files:
        with open(path, "rb") as fh:
            os.fsync(fh.fileno())
            os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    return sum(page_cache_bytes(p) for p in files)


def evict_or_exit(files: list[Path]) -> None:
    left = evict(files)
    if left:
        raise SystemExit(f"eviction failed: {left} bytes of the shard files still cached")


def anonymous_bytes() -> int:
    """This process's anonymous memory (``Anonymous`` of /proc/self/smaps_rollup)."""
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("Anonymous:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/smaps_rollup has no Anonymous line")


# -- inputs ------------------------------------------------------------------------------------
class HostProbe:
    """Microseconds this machine takes, now, for 4,096 random reads of a private 256 MB buffer
    touched once at start (DRAM, TLB and the host's handling of guest memory) and for a fixed
    computation on 64 KiB in cache (CPU speed and steal): measured beside each first step, so
    a slow one can be told from a slow host. Neither touches the table."""

    def __init__(self, rng: np.random.Generator):
        self.buf = np.ones(256 << 20, np.uint8)  # written: no first touch left to the probe
        self.idx = rng.integers(0, self.buf.size, 4096)
        self.small = rng.random(16384).astype(np.float32)

    def __call__(self) -> tuple[float, float]:
        t0 = time.perf_counter()
        int(self.buf[self.idx].sum())
        t1 = time.perf_counter()
        for _ in range(20):
            float(self.small.sum())
        t2 = time.perf_counter()
        return (t1 - t0) * 1e6, (t2 - t1) * 1e6


@dataclass
class Workload:
    decode: list[np.ndarray]  # int64 [REQUESTS, heads] per decode step
    prefill: np.ndarray  # int64 [PREFILL_TOKENS, heads]
    hot_ids: np.ndarray  # int64 [H]: the profile's top rows
    profile_coverage: float  # share of the held-out lookups the hot rows serve
    text_bytes: int
    # Output buffers allocated once, so anonymous memory measures tables, not results.
    out_decode: np.ndarray = field(default_factory=lambda: np.empty(0, np.float32))
    out_prefill: np.ndarray = field(default_factory=lambda: np.empty(0, np.float32))
    probe: HostProbe | None = None

    def allocate(self, width: int) -> None:
        self.out_decode = np.zeros((*self.decode[0].shape, width), np.float32)
        self.out_prefill = np.zeros((*self.prefill.shape, width), np.float32)


def held_out_files(exclude: set[Path], limit_bytes: int) -> list[Path]:
    """Standard-library subpackage sources (tests skipped) not in the tokenizer's corpus."""
    files: list[Path] = []
    total = 0
    for p in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        if total >= limit_bytes:
            break
        if p not in exclude and "test" not in p.parts and p.is_file() and not p.is_symlink():
            size = p.stat().st_size
            if 0 < size < 400_000:
                files.append(p)
                total += size
    return files


def tokens_of(tok: object, files: list[Path], eos: int) -> np.ndarray:
    """The documents of ``files`` tokenized and joined by EOS (int64 [T])."""
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in files]
    stream: list[int] = []
    for enc in tok.encode_batch(texts):  # type: ignore[attr-defined]
        stream.extend(enc.ids)
        stream.append(eos)
    return np.array(stream, dtype=np.int64)


def make_workload(geo: PLEGeometry, tok: object, eos: int, steps: int) -> Workload:
    train = corpus_files()
    held = held_out_files(set(train), 3_000_000)
    profile = build_profile(geo, [tokens_of(tok, [p], eos) for p in train])
    hot_ids = profile.row_ids[: int(geo.num_rows * HOT_SHARE)]
    ids = ngram_ids(geo, tokens_of(tok, held, eos))  # [T, heads]
    span = (ids.shape[0] - PREFILL_TOKENS) // REQUESTS
    if span < steps:
        raise SystemExit(f"held-out text too short for {steps} steps of {REQUESTS} requests")
    starts = np.arange(REQUESTS) * span
    decode = [ids[starts + k] for k in range(steps)]
    seen = np.concatenate([d.reshape(-1) for d in decode] + [ids[-PREFILL_TOKENS:].reshape(-1)])
    coverage = float(np.isin(seen, hot_ids).mean())
    return Workload(
        decode, ids[-PREFILL_TOKENS:], hot_ids, coverage, sum(p.stat().st_size for p in held)
    )


def build_table(root: Path, geo: PLEGeometry, rng: np.random.Generator) -> Path:
    """An int4 sidecar of random valid stored tensors with ``geo``'s rows, laid out as
    bench/_common.py says (128 shards, as ``geo``'s ``split_ngram_parts``)."""
    return build_sidecar(root, "int4", geo.num_rows, rng, geometry=geo.to_dict())


# -- scenarios -----------------------------------------------------------------------------
@dataclass
class Run:
    decode_s: float  # the decode steps, summed
    first_step_s: float
    prefill_s: float
    extra: dict[str, float] = field(default_factory=dict)


def faults(who: int = resource.RUSAGE_THREAD) -> np.ndarray:
    """int64 [2]: minor and major page faults so far, of this thread (decode-sized lookups
    run on the calling thread, so a background warmer's faults are not counted) or of the
    process (``resource.RUSAGE_SELF``)."""
    use = resource.getrusage(who)
    return np.array([use.ru_minflt, use.ru_majflt], np.int64)


def huge_share(root: Path) -> float | None:
    """Share of this process's resident mapped bytes of files under ``root`` that sit on
    2 MiB pages (``FilePmdMapped`` / ``Rss`` over those maps in /proc/self/smaps); None when
    nothing of them is mapped."""
    rss = pmd = 0
    mine = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=2)
            if "-" in head[0] and not head[0].endswith(":"):  # a mapping's first line
                mine = len(line.split()) >= 6 and line.split()[5].startswith(str(root))
            elif mine and head[0] == "Rss:":
                rss += int(head[1])
            elif mine and head[0] == "FilePmdMapped:":
                pmd += int(head[1])
    return pmd / rss if rss else None


def run_lookups(table: object, work: Workload, root: Path | None = None) -> Run:
    """The decode steps, then the prefill; with ``root`` (the table's directory) also the
    faults each took and how much of the table's maps sat on 2 MiB pages before and after."""
    lookup: Callable[..., np.ndarray] = table.lookup  # type: ignore[attr-defined]
    extra: dict[str, float] = {}
    if root is not None:
        extra["huge_share_before"] = huge_share(root) or 0.0
    times = []
    before = faults()
    for ids in work.decode:
        t = time.perf_counter()
        lookup(ids, out=work.out_decode)
        times.append(time.perf_counter() - t)
        if len(times) == 1 and work.probe is not None:  # after the first step: not before it,
            # where its reads would wake the CPU and caches for the step it is to explain
            extra["probe_mem_us"], extra["probe_cpu_us"] = work.probe()
    decode_faults = faults() - before
    before = faults(resource.RUSAGE_SELF)
    t = time.perf_counter()
    lookup(work.prefill, out=work.out_prefill)
    prefill_s = time.perf_counter() - t
    prefill_faults = faults(resource.RUSAGE_SELF) - before
    if root is not None:
        extra["huge_share_after"] = huge_share(root) or 0.0
        extra.update(decode_minflt=int(decode_faults[0]), decode_majflt=int(decode_faults[1]),
                     prefill_minflt=int(prefill_faults[0]),
                     prefill_majflt=int(prefill_faults[1]))  # fmt: skip
    return Run(sum(times), times[0], prefill_s, extra)


def scenario(name: str, path: Path, files: list[Path], work: Workload) -> Run:
    """Open the table as ``name`` says, run the lookups, close; see the module docstring."""
    if name.startswith("cold") or name == "warm":
        evict_or_exit(files)
    anon0 = anonymous_bytes()
    open_faults = faults(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    residency = "resident" if name == "resident" else "mmap"
    hot = work.hot_ids if name == "cold+hot" else None
    table = open_table(path, residency, hot_tier=hot)  # type: ignore[arg-type]
    opened = time.perf_counter() - t0
    open_faults = faults(resource.RUSAGE_SELF) - open_faults
    if name == "cold+hot":  # how much of the files the hot tier's load pulled in
        run_cached = sum(page_cache_bytes(p) for p in files)
    if name == "warm":
        table.warm(background=False)
    warming = table.warm(background=True) if name == "cold+warming" else None
    run = run_lookups(table, work, path)
    run.extra.update(open_s=opened, open_minflt=int(open_faults[0]),
                     open_majflt=int(open_faults[1]))  # fmt: skip
    if name == "cold+hot":
        run.extra["cached_at_open_bytes"] = run_cached
    if warming is not None:
        warming.wait()
        run.extra["fully_warm_s"] = time.perf_counter() - t0
        again = run_lookups(table, work)
        run.extra.update(after_decode_s=again.decode_s, after_prefill_s=again.prefill_s)
        run.extra["anon_growth_bytes"] = anonymous_bytes() - anon0
        run.extra["cached_bytes"] = sum(page_cache_bytes(p) for p in files)
    if name == "resident":
        run.extra["anon_growth_bytes"] = anonymous_bytes() - anon0
    table.close()
    del table
    return run


SCENARIOS = ("resident", "warm", "cold", "cold+hot", "cold+warming")


def after_warming_paired(
    path: Path, files: list[Path], work: Workload, passes: int
) -> dict[str, list[float]]:
    """Start cold with ``warm(background=True)`` while the workload runs once (a server
    serving as it warms), wait until warm, open a resident copy beside it, then run the
    workload ``passes`` times on each, alternating which goes first: ratios after-warming /
    resident (paired, so load on the machine hits both alike), one per two passes, the
    geometric mean of that pair's two ratios. Whichever table runs second in a pass runs
    ~20% slower on the 2-vCPU VM (the first one's prefill has just filled the caches with its
    rows), so single-pass ratios split into ~0.85 and ~1.2 and their median lands anywhere
    between; a pair holds one pass of each order and cancels it."""
    evict_or_exit(files)
    mapped = open_table(path, "mmap")
    warming = mapped.warm(background=True)
    run_lookups(mapped, work)
    warming.wait()
    resident = open_table(path, "resident")
    ratios: dict[str, list[float]] = {"decode_s": [], "prefill_s": []}
    for k in range(passes):
        order = (mapped, resident) if k % 2 == 0 else (resident, mapped)
        first, second = (run_lookups(t, work) for t in order)
        on_map, on_copy = (first, second) if k % 2 == 0 else (second, first)
        for key in ratios:
            ratios[key].append(getattr(on_map, key) / getattr(on_copy, key))
    mapped.close()
    resident.close()
    return {key: [(a * b) ** 0.5 for a, b in zip(r[0::2], r[1::2])] for key, r in ratios.items()}


def median_spread(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", type=int, default=200_000, help="ngram_vocab_size_base (rows / 16)")
    ap.add_argument("--dir", type=Path, default=None, help="Where to build the table (on disk)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=100, help="decode steps timed per scenario")
    ap.add_argument(
        "--passes", type=int, default=20, help="paired passes, after warming vs resident"
    )
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    rng = np.random.default_rng()
    if args.passes < 2 or args.passes % 2:
        ap.error(f"--passes must be even and at least 2 (one of each order), found {args.passes}")
    if args.dir is not None:
        if args.dir.exists() and not args.dir.is_dir():
            ap.error(f"--dir {args.dir} is a file; give a directory to build the table in")
        args.dir.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(corpus_files())
    eos = tok.token_to_id(EOS)
    config = flash_next_config(tok.get_vocab_size(), eos, ngram_vocab_size_base=args.base)
    geo = PLEGeometry.from_config(config)
    work = make_workload(geo, tok, eos, args.steps)
    work.allocate(geo.width)
    work.probe = HostProbe(rng)
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="coldstart-") as tmp:
        path = build_table(Path(tmp), geo, rng)
        files = sorted(path.glob("shard_*.safetensors"))
        table_bytes = sum(p.stat().st_size for p in files)
        log(f"table: {geo.num_rows:,} rows int4 in {len(files)} shards, {table_bytes / 1e6:.0f} MB")
        runs: dict[str, list[Run]] = {name: [] for name in SCENARIOS}
        scenario("warm", path, files, work)  # untimed: one-time costs (thread pool, caches)
        for rep in range(args.repeats):
            for name in SCENARIOS:
                runs[name].append(scenario(name, path, files, work))
                log(f"repeat {rep + 1}/{args.repeats} {name}: {runs[name][-1]}")
        log(f"after warming vs resident: {args.passes} paired passes")
        paired = after_warming_paired(path, files, work, args.passes)
    report(args, geo, work, table_bytes, len(files), runs, paired)


def report(args, geo, work, table_bytes, shards, runs, paired) -> None:  # type: ignore[no-untyped-def]
    def med(name: str, key: str) -> tuple[float, float, float]:
        vals = [getattr(r, key) if hasattr(r, key) else r.extra[key] for r in runs[name]]
        return median_spread(vals)

    rows = []
    for name in SCENARIOS:
        for key in ("decode_s", "first_step_s", "prefill_s"):
            m, lo, hi = med(name, key)
            base = "resident" if name == "resident" else "warm"
            ratio, worst = m / med(base, key)[0], hi / med(base, key)[0]
            values = [(getattr(r, key)) * 1e3 for r in runs[name]]
            rows.append({"scenario": name, "metric": key, "median_ms": m * 1e3,
                         "min_ms": lo * 1e3, "max_ms": hi * 1e3, "values_ms": values,
                         f"x_{base}": ratio, f"worst_x_{base}": worst})  # fmt: skip
    warmed = runs["cold+warming"]
    after = {
        key: median_spread([r.extra[f"after_{key}"] for r in warmed])
        for key in ("decode_s", "prefill_s")
    }
    out = {
        "machine": f"{platform.node()} {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "flashnext": __version__,
        "command": " ".join(["python", *sys.argv]),
        "table": {"rows": geo.num_rows, "shards": shards, "bytes": table_bytes, "format": "int4"},
        "hot_tier": {
            "rows": int(work.hot_ids.size),
            "share": HOT_SHARE,
            "lookups_served": work.profile_coverage,
        },
        "steps": args.steps,
        "repeats": args.repeats,
        "load_average": os.getloadavg(),
        "rows": rows,
        # every repeat of every scenario: times (ms), faults, share of the maps on 2 MiB pages
        "per_repeat": {
            name: [
                {
                    "decode_ms": r.decode_s * 1e3,
                    "first_step_ms": r.first_step_s * 1e3,
                    "prefill_ms": r.prefill_s * 1e3,
                    **r.extra,
                }
                for r in runs[name]
            ]
            for name in SCENARIOS
        },
        # median of the order-balanced ratios (one per two passes), then their p10 and p90
        "after_warming_vs_resident": {
            k: [float(np.median(v)), *np.percentile(v, [10, 90]).tolist()]
            for k, v in paired.items()
        },
        "passes": args.passes,
        "after_warming_ms": {k: [v * 1e3 for v in after[k]] for k in after},
        "fully_warm_s": median_spread([r.extra["fully_warm_s"] for r in warmed]),
        "open_s": {n: median_spread([r.extra["open_s"] for r in runs[n]]) for n in SCENARIOS},
        "anon_growth_after_warming_bytes": [r.extra["anon_growth_bytes"] for r in warmed],
        "anon_growth_resident_bytes": [r.extra["anon_growth_bytes"] for r in runs["resident"]],
        "cached_after_warming_bytes": [r.extra["cached_bytes"] for r in warmed],
        "cached_after_hot_open_bytes": [r.extra["cached_at_open_bytes"] for r in runs["cold+hot"]],
    }
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print_table(out)


def print_table(out: dict) -> None:  # type: ignore[type-arg]
    print(f"{out['machine']}; {out['date']}; flashnext {out['flashnext']}")
    t = out["table"]
    print(f"table: int4, {t['rows']:,} rows, {t['shards']} shards, {t['bytes'] / 1e6:.0f} MB; "
          f"hot tier {out['hot_tier']['rows']:,} rows ({out['hot_tier']['share']:.0%}) serves "
          f"{out['hot_tier']['lookups_served']:.1%} of the measured lookups")  # fmt: skip
    print(f"load average {', '.join(f'{x:.1f}' for x in out['load_average'])} (1, 5, 15 min)")
    print(f"{'scenario':14} {'metric':13} {'median ms':>10} {'min..max ms':>19} {'ratio':>14} "
          f"{'worst':>7}")  # fmt: skip
    for r in out["rows"]:
        key = next(k for k in r if k.startswith("x_"))
        spread = f"{r['min_ms']:.2f}..{r['max_ms']:.2f}"
        print(f"{r['scenario']:14} {r['metric']:13} {r['median_ms']:10.2f} {spread:>19} "
              f"{r[key]:8.2f} {key} {r['worst_' + key]:7.2f}")  # fmt: skip
    print_repeats(out)
    op = out["open_s"]
    hot_cached = statistics.median(out["cached_after_hot_open_bytes"]) / t["bytes"]
    print(f"open: cold {op['cold'][0]:.2f} s, cold + hot tier {op['cold+hot'][0]:.2f} s "
          f"({op['cold+hot'][1]:.2f}..{op['cold+hot'][2]:.2f}), which left {hot_cached:.0%} of "
          "the shard files cached; resident copy "
          f"{op['resident'][0]:.2f} s")  # fmt: skip
    a = out["after_warming_vs_resident"]
    print(f"after warming / resident ({out['passes']} passes, one ratio per pair of orders, median (p10-p90)): "
          f"decode {a['decode_s'][0]:.2f}x ({a['decode_s'][1]:.2f}-{a['decode_s'][2]:.2f}), "
          f"prefill {a['prefill_s'][0]:.2f}x ({a['prefill_s'][1]:.2f}-{a['prefill_s'][2]:.2f})")  # fmt: skip
    fw = out["fully_warm_s"]
    cached = min(1.0, min(out["cached_after_warming_bytes"]) / t["bytes"])
    print(f"fully warm after {fw[0]:.2f} s ({fw[1]:.2f}..{fw[2]:.2f}); {cached:.0%} of the "
          "shard files cached then (mincore)")  # fmt: skip
    print(f"anonymous memory growth: after warming "
          f"{max(out['anon_growth_after_warming_bytes']) / 1e6:.1f} MB (max), resident copy "
          f"{statistics.median(out['anon_growth_resident_bytes']) / 1e6:.1f} MB")  # fmt: skip


def print_repeats(out: dict) -> None:  # type: ignore[type-arg]
    """Every repeat: times, the faults of the decode steps (this thread), of the prefill and
    of the open (process), the share of the maps on 2 MiB pages before / after, and the host
    probe beside the first step."""
    print(f"{'scenario':14} {'rep':>3} {'decode ms':>10} {'first ms':>9} {'prefill ms':>10} "
          f"{'decode min/maj flt':>19} {'prefill min/maj':>16} {'open min/maj':>14} "
          f"{'2 MiB before/after':>19} {'probe mem/cpu us':>17}")  # fmt: skip
    for name, reps in out["per_repeat"].items():
        for k, r in enumerate(reps, 1):
            flt = {w: f"{r.get(w + '_minflt', 0)}/{r.get(w + '_majflt', 0)}"
                   for w in ("decode", "prefill", "open")}  # fmt: skip
            huge = f"{r.get('huge_share_before', 0):.0%}/{r.get('huge_share_after', 0):.0%}"
            probe = f"{r.get('probe_mem_us', 0):.0f}/{r.get('probe_cpu_us', 0):.0f}"
            print(f"{name:14} {k:>3} {r['decode_ms']:10.2f} {r['first_step_ms']:9.2f} "
                  f"{r['prefill_ms']:10.2f} {flt['decode']:>19} {flt['prefill']:>16} "
                  f"{flt['open']:>14} {huge:>19} {probe:>17}")  # fmt: skip


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # the temporary table is gone with its directory by now
        print("coldstart: interrupted", file=sys.stderr)
        raise SystemExit(130) from None

"""Benchmark: PLETable lookups against numpy take from an in-RAM BF16 array, same run.

    python bench/lookup.py [--shard-rows N] [--shards 128] [--repeats K] [--hot-fraction F]
                           [--threads-sweep 1,2,4,...] [--formats fp8,int4,nvfp4] [--dir DIR]
                           [--ids fresh|repeat] [--json]

Writes fp8, int4 and nvfp4 sidecars in the released layout (``--shards`` shards, 128 like the
released checkpoint, of ``--shard-rows`` rows: scaled down from its 2,500,012) holding random
valid stored tensors, and a BF16 array of the same shape in RAM. The default 200,000 rows make
20 MB int4 files (8 GB of RAM for the baseline): big enough that the maps sit on 2 MiB pages as
the released 250 MB files do; much smaller shards (2 MB files at 20,000 rows) leave every map
on 4 KiB pages, which no deployment has. Larger shards come closer still: at 200,000 rows a
quarter of the rows' scales sit in the files' last, partial 2 MiB (4 KiB pages), at 2,500,012
under 1%. Then, for each format x
{mmap, resident, hot (mmap + a hot tier of ``--hot-fraction`` of the rows, random priority)}
x {512 ids (a 32-request decode step), 131,072 ids (an 8K-token prefill)}, it times
``lookup`` to float32, ``lookup`` to bfloat16 and ``gather_raw`` of uniform random ids, each
repeat paired with ``np.take`` of the same rows from the BF16 array (the baseline: no
dequantization) so that load on the machine hits both alike. Every call allocates its output,
the baseline's too.

Ids: ``--ids fresh`` (the default) draws new ids for every repeat, as each decode step of a
server asks for other rows: rows come from memory, not from the CPU caches. ``--ids repeat``
times the same ids every repeat: 512 rows then stay in L2/L3 for both sides and the ratio
measures the instructions per row instead (decoding costs more than take's copy there).

Before timing, the written shard files are dropped from the page cache (as after a reboot: a
server reads a sidecar written earlier, not pages left over from writing it), each mmapped
table is warmed (``table.warm()``: large sequential reads, then the pages mapped) and every
row is read once through the API, so page cache and page tables are warm (steady serving).
The output says how much of the maps the kernel put on 2 MiB pages (``FilePmdMapped`` in
/proc/self/smaps): the resident copies and the take baseline are anonymous memory on huge
pages, and 4 KiB file pages cost TLB misses that the other side does not pay.

Prints per row: median time, rows/s, the median of the paired ratios (op / take) and their
spread (10th-90th percentile), then a thread-scaling table (int4, mmap, 131,072 ids) for
``--threads-sweep``. ``--json`` prints a ``flashnext.bench.lookup`` record instead.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
from _common import RELEASED_SHARDS, WIDTH, add_shard_rows_option, build_sidecar

from flashnext.host import open_table
from flashnext.host.lookup_kernels import default_threads
from flashnext.host.table import PLETable
from flashnext.records import dumps, make_record

SIZES = (512, 131_072)
BF16 = ml_dtypes.bfloat16


def evict(root: Path) -> None:
    """Drop the files under ``root`` from the page cache (flushed first, so they can go)."""
    for path in sorted(root.rglob("*.safetensors")):
        with open(path, "rb") as fh:
            os.fsync(fh.fileno())
            os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def huge_mapped_fraction(root: Path) -> float | None:
    """Share of this process's mapped bytes of files under ``root`` on 2 MiB pages."""
    rss = pmd = 0
    current = False
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split()
                if head and "-" in head[0] and ":" not in head[0]:
                    current = str(root) in line
                elif current and head[0] == "Rss:":
                    rss += int(head[1])
                elif current and head[0] == "FilePmdMapped:":
                    pmd += int(head[1])
    except OSError:
        return None
    return pmd / rss if rss else None


def touch_every_row(table: PLETable, chunk: int = 65_536) -> None:
    """One pass over every row through the API: page cache and page tables warm."""
    out = np.empty((chunk, WIDTH), np.float32)
    for start in range(0, table.num_rows, chunk):
        ids = np.arange(start, min(start + chunk, table.num_rows), dtype=np.int64)
        table.lookup(ids, out=out[: ids.size])


def paired(
    op: Callable[[np.ndarray], object],
    base: Callable[[np.ndarray], object],
    ids: list[np.ndarray],
    k: int,
) -> dict[str, float]:
    """Time ``op(ids[r])`` and ``base(ids[r])`` alternately for ``r < k`` (``ids`` cycled;
    one untimed call each first)."""
    op(ids[-1])
    base(ids[-1])
    t_op, t_base = np.empty(k), np.empty(k)
    for r in range(k):
        batch = ids[r % len(ids)]
        t = time.perf_counter()
        base(batch)
        t_base[r] = time.perf_counter() - t
        t = time.perf_counter()
        op(batch)
        t_op[r] = time.perf_counter() - t
    ratio = t_op / t_base
    return {
        "ms": float(np.median(t_op)) * 1e3,
        "take_ms": float(np.median(t_base)) * 1e3,
        "rows_per_s": ids[0].size / float(np.median(t_op)),
        "ratio": float(np.median(ratio)),
        "ratio_p10": float(np.percentile(ratio, 10)),
        "ratio_p90": float(np.percentile(ratio, 90)),
        "repeats": k,
    }


def operations(table: PLETable) -> dict[str, Callable[[np.ndarray], object]]:
    return {
        "lookup_f32": table.lookup,
        "lookup_bf16": lambda ids: table.lookup(ids, dtype=BF16),
        "gather_raw": table.gather_raw,
    }


def open_variant(path: Path, variant: str, hot_ids: np.ndarray) -> PLETable:
    if variant == "hot":
        return open_table(path, "mmap", hot_tier=hot_ids)
    return open_table(path, variant)  # type: ignore[arg-type]


def run(args: argparse.Namespace, root: Path, rng: np.random.Generator) -> dict[str, Any]:
    rows = args.shards * args.shard_rows
    print(f"writing {args.shards} shards x {args.shard_rows:,} rows under {root}", file=sys.stderr)
    paths = {fmt: build_sidecar(root, fmt, rows, rng, args.shard_rows) for fmt in args.formats}
    bf16 = rng.standard_normal((rows, WIDTH), dtype=np.float32).astype(BF16)
    take = lambda ids: np.take(bf16, ids, axis=0)  # noqa: E731
    hot_ids = rng.permutation(rows)[: int(rows * args.hot_fraction)]

    def batches(n: int, k: int) -> list[np.ndarray]:
        count = k + 1 if args.ids == "fresh" else 1
        return [rng.integers(0, rows, size=n, dtype=np.int64) for _ in range(count)]

    evict(root)
    results = []
    huge: dict[str, float | None] = {}
    for fmt, path in paths.items():
        for variant in ("mmap", "resident", "hot"):
            table = open_variant(path, variant, hot_ids)
            if variant != "resident":
                table.warm(background=False)
            touch_every_row(table)
            huge[f"{fmt} {variant}"] = huge_mapped_fraction(path)
            print(f"timing {fmt} {variant}", file=sys.stderr)
            for n in SIZES:
                k = args.repeats * (20 if n <= 4096 else 1)
                for op, fn in operations(table).items():
                    r = paired(fn, take, batches(n, k), k)
                    results.append({"format": fmt, "residency": variant, "ids": n, "op": op, **r})
            table.close()
    scaling = []
    if args.threads_sweep and "int4" in paths:
        table = open_table(paths["int4"], "mmap")
        table.warm(background=False)
        touch_every_row(table)
        n = SIZES[-1]
        for threads in args.threads_sweep:
            table.threads = threads
            for op in ("lookup_bf16", "gather_raw"):
                r = paired(operations(table)[op], take, batches(n, args.repeats), args.repeats)
                scaling.append({"format": "int4", "residency": "mmap", "ids": n, "op": op,
                                "threads": threads, **r})  # fmt: skip
        table.close()
    return {
        "rows": rows,
        "shards": args.shards,
        "shard_rows": args.shard_rows,
        "width": WIDTH,
        "hot_tier_rows": int(hot_ids.size),
        "ids_per_repeat": args.ids,
        "maps_on_huge_pages": huge,
        "threads": default_threads(),
        "cpus": os.cpu_count(),
        "processor": _processor(),
        "numpy": np.__version__,
        "results": results,
        "thread_scaling": scaling,
    }


def _processor() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def print_tables(payload: dict[str, Any]) -> None:
    print(
        f"{payload['rows']:,} rows x {WIDTH} in {payload['shards']} shards; "
        f"{payload['processor']}, {payload['cpus']} CPUs, lookup threads {payload['threads']}; "
        f"hot tier {payload['hot_tier_rows']:,} rows; baseline = np.take of the same rows from an "
        "in-RAM BF16 array, timed in pairs; ratio = median of op/take (p10-p90); "
        f"ids {payload['ids_per_repeat']} each repeat"
    )
    huge = ", ".join(
        f"{k} {v:.0%}" for k, v in payload["maps_on_huge_pages"].items() if v is not None
    )
    print(f"mapped shard files on 2 MiB pages: {huge or 'unknown'}")
    head = f"{'format':7}{'residency':10}{'ids':>8} {'op':12}{'ms':>9}{'Mrows/s':>9}{'take ms':>9}"
    print(head + f"{'ratio':>7}  spread")
    for r in payload["results"] + payload["thread_scaling"]:
        label = r["residency"] if "threads" not in r else f"mmap t={r['threads']}"
        print(
            f"{r['format']:7}{label:10}{r['ids']:>8,} {r['op']:12}{r['ms']:>9.3f}"
            f"{r['rows_per_s'] / 1e6:>9.1f}{r['take_ms']:>9.3f}{r['ratio']:>7.2f}"
            f"  {r['ratio_p10']:.2f}-{r['ratio_p90']:.2f}"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shards", type=int, default=RELEASED_SHARDS)
    add_shard_rows_option(parser, default=200_000)
    parser.add_argument("--dir", type=Path, default=None, help="where to write the sidecars")
    parser.add_argument("--repeats", type=int, default=15, help="x20 for 512 ids")
    parser.add_argument("--hot-fraction", type=float, default=0.05)
    parser.add_argument("--formats", type=lambda s: s.split(","), default=["fp8", "int4", "nvfp4"])
    parser.add_argument(
        "--threads-sweep", type=lambda s: [int(x) for x in s.split(",") if x], default=[]
    )
    parser.add_argument("--ids", choices=["fresh", "repeat"], default="fresh")
    parser.add_argument("--seed", type=int, default=None, help="default: a fresh one, printed")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    seed = args.seed if args.seed is not None else int(np.random.SeedSequence().entropy % 2**63)
    print(f"seed {seed}", file=sys.stderr)
    rng = np.random.default_rng(seed)
    tmp = tempfile.TemporaryDirectory(prefix="flashnext-bench-") if args.dir is None else None
    root = Path(tmp.name if tmp else args.dir)
    root.mkdir(parents=True, exist_ok=True)
    try:
        payload = {"seed": seed, **run(args, root, rng)}
    finally:
        if tmp:
            tmp.cleanup()
    if args.json:
        sys.stdout.write(dumps(make_record("flashnext.bench.lookup", payload)))
    else:
        print_tables(payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

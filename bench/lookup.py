"""Benchmark: PLETable.lookup against numpy take from an in-RAM BF16 array, same run.

    python bench/lookup.py [--rows N] [--dir DIR] [--repeats K] [--json]

Writes int4, fp8 and nvfp4 sidecars of random (valid) stored tensors, ``--rows`` rows in shards
of the released checkpoint's 2,500,012 rows, then times ``lookup`` of 512 ids (a 32-request
decode step) and 131,072 ids (an 8K-token prefill) for each format, memory-mapped and
resident, and the baseline: ``np.take`` of the same rows from a BF16 array in RAM (no
dequantization). Prints medians and the ratio lookup / baseline.
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

import ml_dtypes
import numpy as np

from flashnext import __version__
from flashnext.ple import open_table
from flashnext.ple.sidecar import SidecarWriter

SHARD_ROWS = 2_500_012
WIDTH = 160


def random_shard(fmt: str, rows: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    if fmt == "fp8":
        q = rng.integers(0, 256, size=(rows, WIDTH), dtype=np.uint8)
        q[(q & 0x7F) == 0x7F] = 0x30
        return {
            "weight_fp8": q.view(ml_dtypes.float8_e4m3fn),
            "weight_scale": rng.random(rows, dtype=np.float32) * 0.01,
        }
    if fmt == "int4":
        return {
            "weight_i4": rng.integers(0, 256, size=(rows, WIDTH // 2), dtype=np.uint8),
            "weight_scale": (rng.random((rows, 10), dtype=np.float32) * 0.01).astype(np.float16),
        }
    if fmt == "nvfp4":
        return {
            "weight_e2m1": rng.integers(0, 256, size=(rows, WIDTH // 2), dtype=np.uint8),
            "weight_scale": rng.integers(0x08, 0x70, size=(rows, 10), dtype=np.uint8).view(
                ml_dtypes.float8_e4m3fn
            ),
            "weight_scale_2": np.array(1e-4, dtype=np.float32),
        }
    raise ValueError(fmt)


def build(root: Path, fmt: str, rows: int, rng: np.random.Generator) -> Path:
    path = root / fmt
    writer = SidecarWriter(path, fmt, WIDTH, rows, SHARD_ROWS)
    for i in range(writer.num_shards):
        start, end = writer.shard_rows(i)
        writer.write_shard(i, random_shard(fmt, end - start, rng))
    writer.finish()
    return path


def median_seconds(fn, arg, repeats: int) -> float:
    fn(arg)  # warm: page cache, first touch
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn(arg)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=2 * SHARD_ROWS)
    parser.add_argument("--dir", type=Path, default=None, help="where to write the sidecars")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    rng = np.random.default_rng()
    tmp = tempfile.TemporaryDirectory(prefix="flashnext-bench-") if args.dir is None else None
    root = Path(tmp.name if tmp else args.dir)
    root.mkdir(parents=True, exist_ok=True)
    print(f"writing {args.rows:,}-row sidecars under {root}", file=sys.stderr)
    paths = {fmt: build(root, fmt, args.rows, rng) for fmt in ("int4", "fp8", "nvfp4")}
    bf16 = rng.standard_normal((args.rows, WIDTH), dtype=np.float32).astype(ml_dtypes.bfloat16)

    results = []
    for n in (512, 131_072):
        ids = rng.integers(0, args.rows, size=n)
        base = median_seconds(lambda i: np.take(bf16, i, axis=0), ids, args.repeats)
        for fmt, path in paths.items():
            for residency in ("mmap", "resident"):
                table = open_table(path, residency)
                t = median_seconds(table.lookup, ids, args.repeats)
                results.append(
                    {
                        "format": fmt,
                        "residency": residency,
                        "ids": n,
                        "lookup_ms": t * 1e3,
                        "numpy_take_bf16_ms": base * 1e3,
                        "ratio": t / base,
                    }
                )
                table.close()
    env = {
        "flashnext": __version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "cpus": __import__("os").cpu_count(),
        "rows": args.rows,
        "command": " ".join(sys.argv),
    }
    if args.json:
        print(json.dumps({"schema_version": 1, "environment": env, "results": results}, indent=2))
    else:
        print(
            f"rows {args.rows:,} x {WIDTH}; medians of {args.repeats}; baseline = np.take of "
            "the same rows from an in-RAM BF16 array (no dequantization)"
        )
        print(f"{'format':8}{'residency':10}{'ids':>9}{'lookup ms':>12}{'take ms':>10}{'ratio':>8}")
        for r in results:
            print(
                f"{r['format']:8}{r['residency']:10}{r['ids']:>9,}{r['lookup_ms']:>12.3f}"
                f"{r['numpy_take_bf16_ms']:>10.3f}{r['ratio']:>8.1f}"
            )
    if tmp:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

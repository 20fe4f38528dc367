"""Quantizer throughput from a checkpoint: compiled vs numpy codec, 1 and N workers, and
the lossless copy, against a plain sequential read, in one run.

    python bench/quantize.py [--base 20000] [--parts 128] [--workers 1,8] [--repeats 2] [--json]

Writes a real checkpoint (safetensors, real tensor names, the real PLE geometry scaled down by
``ngram_vocab_size_base``: 20000 -> 320,000 rows x 160, in the released layout's 128 shards) to
a temporary directory, then measures, page cache warm:

- ``read``: a plain sequential read of the checkpoint files (8 MiB ``readinto``), the bound of
  any converter;
- ``quantize``: ``quantize_table(open_row_source(ckpt), ...)`` (what ``flashnext ple quantize
  CKPT ...`` runs) per output format, engine (``numpy``: the reference codec; ``auto``: the
  compiled kernels) and worker count, ``--repeats`` times (median and range); the ratio column
  is compiled over numpy at the same worker count, and ``identical`` says whether the two
  engines wrote the same shard bytes;
- ``copy``: for a bf16, an fp8 and an nvfp4 checkpoint of the same geometry, the lossless copy
  into the same format (stored MB/s and the ratio to reading those files).

Input MB/s counts bf16 checkpoint bytes (320 B per row), as the issue's targets do; ``102 GB``
projects the time for the released 102.4 GB table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from flashnext import __version__
from flashnext.checkpoint.sources import open_row_source
from flashnext.ple.formats import E4M3, get_codec
from flashnext.ple.geometry import PLEGeometry
from flashnext.store.quantize import quantize_table
from flashnext.store.quantize_kernels import (
    compiled_matches_reference,
    load_kernels,
    quantize_block,
)
from flashnext.synthetic import flash_next_config

SCHEMA_VERSION = 2
REAL_TABLE_BYTES = 102.4e9


def _stored(fmt: str, x: np.ndarray) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """A table's checkpoint tensors (per-row, one-per-table) from float32 rows."""
    if fmt == "bf16":
        return {"weight": x.astype(ml_dtypes.bfloat16)}, {}
    if fmt == "fp8":
        return {"weight": (x / 1e-3).astype(E4M3)}, {"weight_scale": np.array(1e-3, np.float32)}
    q, _, _ = quantize_block(get_codec("nvfp4"), x, {"weight_scale_2": 1e-4})
    per_row = {"weight": q["weight_e2m1"], "weight_scale": q["weight_scale"]}
    return per_row, {"weight_scale_2": np.array(1e-4, np.float32)}


def build(root: Path, base: int, parts: int, fmt: str, rng: np.random.Generator) -> list[Path]:
    """One PLE layer (decoder layer 1) in the numbered-shard layout, over two files."""
    config = {
        "architectures": ["Qwen4ExpForCausalLM"],
        **flash_next_config(ngram_vocab_size_base=base, split_ngram_parts=parts, ple_layer_ids=[1]),
    }
    geo = PLEGeometry.from_config(config)
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(config, indent=2))
    name = "model.language_model.layers.0.ple.ple_embedding.ngram_embedding"
    S = geo.shard_rows()
    files: dict[str, dict[str, np.ndarray]] = {}
    for k in range(parts):
        rows = min((k + 1) * S, geo.num_rows) - k * S
        x = rng.standard_normal((rows, geo.width), dtype=np.float32) * 0.05
        per_row, glob = _stored(fmt, x)
        fname = f"model-{k % 2 + 1:05d}-of-00002.safetensors"
        for kind, arr in per_row.items():
            files.setdefault(fname, {})[f"{name}.shard_{k}.{kind}"] = arr
    for kind, arr in glob.items():
        files["model-00001-of-00002.safetensors"][f"{name}.{kind}"] = arr
    weight_map = {}
    for fname, tensors in files.items():
        save_file(tensors, str(root / fname))
        weight_map.update(dict.fromkeys(tensors, fname))
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return [root / f for f in sorted(files)]


def sequential_read(paths: list[Path]) -> tuple[int, float]:
    buf = bytearray(8 << 20)
    total = 0
    t0 = time.perf_counter()
    for p in paths:
        with open(p, "rb", buffering=0) as fh:
            while n := fh.readinto(buf):
                total += n
    return total, time.perf_counter() - t0


def _shards(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.glob("shard_*.safetensors"))}


def time_quantize(src, scratch: Path, fmt: str, engine: str, workers: int, repeats: int):
    """Seconds of each repeat, the last output's shard bytes and rel. RMSE."""
    times = []
    for r in range(repeats):
        dst = scratch / f"out-{fmt}-{engine}-{workers}-{r}"
        t0 = time.perf_counter()
        res = quantize_table(
            src, dst, fmt, src.rows_per_shard, workers=workers, engine=engine, requantize=True
        )
        times.append(time.perf_counter() - t0)
        shards = _shards(dst)
        shutil.rmtree(dst)
    return times, shards, res.rel_rmse


def pool_start(scratch: Path, workers: int, rng: np.random.Generator) -> float:
    """Seconds a quantize_table run with ``workers`` processes costs beyond its work: the same
    call on a table of ``workers`` 16-row shards (spawn, imports, the kernels' self-check)."""
    write = scratch / "tiny"
    build(write, 1, workers, "bf16", rng)
    src = open_row_source(write)
    t0 = time.perf_counter()
    quantize_table(src, scratch / "tiny-out", "int4", src.rows_per_shard, workers=workers)
    seconds = time.perf_counter() - t0
    shutil.rmtree(scratch / "tiny-out")
    shutil.rmtree(write)
    return seconds


def quantize_rows(args, src, scratch: Path, read_mb_s: float, table_bytes: int) -> list[dict]:
    results = []
    for fmt in args.formats.split(","):
        for workers in (int(w) for w in args.workers.split(",")):
            start = pool_start(scratch, workers, np.random.default_rng(0)) if workers > 1 else 0.0
            by_engine = {}
            for engine in ("numpy", "auto"):
                repeats = args.numpy_repeats if engine == "numpy" else args.repeats
                times, shards, rmse = time_quantize(src, scratch, fmt, engine, workers, repeats)
                mb_s = [table_bytes / t / 1e6 for t in times]
                by_engine[engine] = (statistics.median(mb_s), shards)
                row = {
                    "what": "quantize",
                    "format": fmt,
                    "engine": engine,
                    "workers": workers,
                    "seconds": times,
                    "mb_per_s": statistics.median(mb_s),
                    "mb_per_s_range": [min(mb_s), max(mb_s)],
                    "vs_read": statistics.median(mb_s) / read_mb_s,
                    "real_table_minutes": REAL_TABLE_BYTES / (statistics.median(mb_s) * 1e6) / 60,
                    "rel_rmse": rmse,
                    "pool_start_s": start,
                    # None when the pool's start is most of the run (too noisy to subtract)
                    "mb_per_s_without_pool_start": table_bytes
                    / (statistics.median(times) - start)
                    / 1e6
                    if statistics.median(times) > 2 * start
                    else None,
                }
                results.append(row)
                print(
                    f"{fmt:6} {engine:5} workers={workers:2}: {row['mb_per_s']:8.1f} MB/s "
                    f"({min(mb_s):.1f}-{max(mb_s):.1f}), 102 GB in "
                    f"{row['real_table_minutes']:.1f} min",
                    file=sys.stderr,
                    flush=True,
                )
            row["vs_numpy"] = by_engine["auto"][0] / by_engine["numpy"][0]
            row["identical"] = by_engine["auto"][1] == by_engine["numpy"][1]
    return results


def copy_rows(args, scratch: Path, rng: np.random.Generator) -> list[dict]:
    """The lossless copy per checkpoint format, against reading the same files."""
    results = []
    for fmt in ("bf16", "fp8", "nvfp4"):
        files = build(scratch / f"ck-{fmt}", args.base, args.parts, fmt, rng)
        src = open_row_source(scratch / f"ck-{fmt}")
        stored = src.info.nbytes
        sequential_read(files)  # warm
        times, reads = [], []
        for r in range(args.repeats):
            reads.append(sequential_read(files)[1])
            dst = scratch / f"copy-{fmt}-{r}"
            t0 = time.perf_counter()
            res = quantize_table(src, dst, fmt, src.rows_per_shard)
            times.append(time.perf_counter() - t0)
            assert res.conversion == "copy" and res.rel_rmse == 0.0
            shutil.rmtree(dst)
        file_mb_s = sum(p.stat().st_size for p in files) / statistics.median(reads) / 1e6
        mb_s = [stored / t / 1e6 for t in times]
        results.append(
            {
                "what": "copy",
                "format": fmt,
                "stored_bytes": stored,
                "seconds": times,
                "mb_per_s": statistics.median(mb_s),
                "mb_per_s_range": [min(mb_s), max(mb_s)],
                "read_mb_per_s": file_mb_s,
                "vs_read": statistics.median(mb_s) / file_mb_s,
            }
        )
        print(f"copy {fmt}: {statistics.median(mb_s):.1f} MB/s stored", file=sys.stderr)
        shutil.rmtree(scratch / f"ck-{fmt}")
    return results


def _number(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def print_table(record: dict) -> None:
    ck = record["checkpoint"]
    print(
        f"\n{ck['rows']:,} rows x {ck['width']} bf16 in {ck['shards']} shards "
        f"({ck['table_bytes'] / 1e6:.0f} MB), {record['cpus']} CPUs, load average "
        f"{record['loadavg_start'][0]:.2f} at start, {record['loadavg_end'][0]:.2f} at end; "
        f"sequential read {record['read_mb_per_s']:.0f} MB/s; compiled path "
        f"{'on' if record['compiled'] else 'OFF (differs from numpy here)'}\n"
    )
    print(
        "| format | engine | workers | input MB/s (range) | vs numpy | identical | 102 GB in "
        "| without pool start |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in record["results"]:
        if r["what"] != "quantize":
            continue
        lo, hi = r["mb_per_s_range"]
        print(
            f"| {r['format']} | {r['engine']} | {r['workers']} | {r['mb_per_s']:.1f} "
            f"({lo:.1f}-{hi:.1f}) | {r.get('vs_numpy', 1.0):.1f}x | "
            f"{'yes' if r.get('identical', True) else 'NO'} | {r['real_table_minutes']:.1f} min | "
            f"{_number(r['mb_per_s_without_pool_start'])} ({r['pool_start_s']:.1f} s) |"
        )
    print("\n| copy from | stored MB/s (range) | read MB/s | vs read |")
    print("|---|---|---|---|")
    for r in record["results"]:
        if r["what"] == "copy":
            lo, hi = r["mb_per_s_range"]
            print(
                f"| {r['format']} | {r['mb_per_s']:.1f} ({lo:.1f}-{hi:.1f}) | "
                f"{r['read_mb_per_s']:.0f} | {r['vs_read']:.2f} |"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", type=int, default=20000, help="ngram_vocab_size_base (rows ~ 16x)")
    ap.add_argument("--parts", type=int, default=128, help="split_ngram_parts (shards)")
    ap.add_argument("--formats", default="bf16,fp8,int4,nvfp4")
    ap.add_argument("--workers", default="1,8")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument(
        "--numpy-repeats", type=int, default=None, help="repeats of the numpy codec [--repeats]"
    )
    ap.add_argument("--no-copy", action="store_true", help="skip the lossless-copy section")
    ap.add_argument("--dir", type=Path, default=None, help="scratch directory (default: temp)")
    ap.add_argument("--json", type=Path, default=None, help="also write the JSON record here")
    args = ap.parse_args()
    args.numpy_repeats = args.numpy_repeats or args.repeats

    load_start = os.getloadavg()  # other processes on the host skew every number: record it
    seed = int.from_bytes(os.urandom(4), "little")
    rng = np.random.default_rng(seed)
    compiled = compiled_matches_reference()
    load_kernels()  # compiled (or loaded) before timing
    scratch = Path(tempfile.mkdtemp(prefix="fn-bench-", dir=args.dir))
    try:
        files = build(scratch / "ckpt", args.base, args.parts, "bf16", rng)
        src = open_row_source(scratch / "ckpt")
        table_bytes = src.info.nbytes
        sequential_read(files)  # warm the cache
        nbytes, secs = sequential_read(files)
        read_mb_s = nbytes / secs / 1e6
        results = quantize_rows(args, src, scratch, read_mb_s, table_bytes)
        if not args.no_copy:
            results += copy_rows(args, scratch, rng)
        record = {
            "schema_version": SCHEMA_VERSION,
            "flashnext_version": __version__,
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "python": platform.python_version(),
            "numpy": np.__version__,
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "loadavg_start": load_start,
            "loadavg_end": os.getloadavg(),
            "seed": seed,
            "compiled": compiled,
            "read_mb_per_s": read_mb_s,
            "checkpoint": {
                "rows": src.num_rows,
                "width": src.width,
                "shards": args.parts,
                "table_bytes": table_bytes,
            },
            "results": results,
        }
        if args.json:
            args.json.write_text(json.dumps(record, indent=2))
        print_table(record)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()

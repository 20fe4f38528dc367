"""Quantizer throughput straight from a checkpoint, against a plain sequential read.

    .venv/bin/python bench/quantize.py [--base 20000] [--parts 8] [--workers 1,2] [--json]

Writes a real checkpoint (safetensors, real tensor names, the real PLE geometry scaled down by
``ngram_vocab_size_base``: 20000 -> 320,000 rows x 160) to a temporary directory, then in the
same run measures:

- ``read``: a plain sequential read of the same safetensors files (8 MiB ``readinto``), the
  baseline any converter is bounded by;
- ``source``: the checkpoint row source alone (``read_rows`` in 65,536-row blocks: layout
  mapping, positioned reads, dequantization to float32), what the quantizer pays to read;
- ``quantize``: ``quantize_table(open_table_source(ckpt), ...)`` per output format and worker
  count, as ``flashnext ple quantize CKPT ...`` runs it.

Input MB/s counts checkpoint bytes consumed (for a bf16 table, 320 B per row). Each number is
taken twice: ``cold`` after asking the kernel to drop the files from the page cache
(``posix_fadvise(DONTNEED)`` after ``fsync``; best effort, no root needed) and ``warm`` with
the files cached. The ratio column is quantizer MB/s over read MB/s in the same cache state.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from flashnext import __version__
from flashnext.checkpoint import open_table_source
from flashnext.ple.geometry import PLEGeometry
from flashnext.ple.quantize import quantize_table
from flashnext.synthetic import flash_next_config

SCHEMA_VERSION = 1


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
        fname = f"model-{k % 2 + 1:05d}-of-00002.safetensors"
        if fmt == "bf16":
            files.setdefault(fname, {})[f"{name}.shard_{k}.weight"] = x.astype(ml_dtypes.bfloat16)
        else:  # fp8 with one global scale
            files.setdefault(fname, {})[f"{name}.shard_{k}.weight"] = (x / 1e-3).astype(
                ml_dtypes.float8_e4m3fn
            )
    if fmt == "fp8":
        files["model-00001-of-00002.safetensors"][f"{name}.weight_scale"] = np.array(
            1e-3, dtype=np.float32
        )
    weight_map = {}
    for fname, tensors in files.items():
        save_file(tensors, str(root / fname))
        weight_map.update(dict.fromkeys(tensors, fname))
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return [root / f for f in sorted(files)]


def drop_cache(paths: list[Path]) -> None:
    """Ask the kernel to evict ``paths`` from the page cache (best effort)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def sequential_read(paths: list[Path]) -> tuple[int, float]:
    buf = bytearray(8 << 20)
    total = 0
    t0 = time.perf_counter()
    for p in paths:
        with open(p, "rb", buffering=0) as fh:
            while n := fh.readinto(buf):
                total += n
    return total, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", type=int, default=20000, help="ngram_vocab_size_base (rows ~ 16x)")
    ap.add_argument("--parts", type=int, default=8, help="split_ngram_parts (shards)")
    ap.add_argument("--src-format", choices=["bf16", "fp8"], default="bf16")
    ap.add_argument("--formats", default="bf16,fp8,int4,nvfp4")
    ap.add_argument("--workers", default="1,2")
    ap.add_argument(
        "--dir", type=Path, default=None, help="scratch directory (default: a temp dir)"
    )
    ap.add_argument("--json", action="store_true", help="print the JSON record on stdout")
    args = ap.parse_args()

    load_start = os.getloadavg()  # other processes on the host skew every number: record it
    seed = int.from_bytes(os.urandom(4), "little")
    rng = np.random.default_rng(seed)
    scratch = Path(tempfile.mkdtemp(prefix="fn-bench-", dir=args.dir))
    try:
        files = build(scratch / "ckpt", args.base, args.parts, args.src_format, rng)
        src = open_table_source(scratch / "ckpt", 0)
        table_bytes = src.info.nbytes
        file_bytes = sum(p.stat().st_size for p in files)
        results = []
        for cache in ("cold", "warm"):
            if cache == "cold":
                drop_cache(files)
            else:
                sequential_read(files)  # warm the cache
            nbytes, secs = sequential_read(files)
            read_mb_s = nbytes / secs / 1e6
            results.append({"what": "read", "cache": cache, "mb_per_s": read_mb_s, "seconds": secs})
            # the checkpoint row source alone: layout mapping + dequantization to float32
            if cache == "cold":
                drop_cache(files)
            t0 = time.perf_counter()
            for lo in range(0, src.num_rows, 65536):
                src.read_rows(lo, min(lo + 65536, src.num_rows))
            secs = time.perf_counter() - t0
            results.append(
                {
                    "what": "source",
                    "cache": cache,
                    "mb_per_s": table_bytes / secs / 1e6,
                    "rows_per_s": src.num_rows / secs,
                    "vs_read": table_bytes / secs / 1e6 / read_mb_s,
                    "seconds": secs,
                }
            )
            for fmt in args.formats.split(","):
                for workers in (int(w) for w in args.workers.split(",")):
                    dst = scratch / f"out-{fmt}-{workers}-{cache}"
                    if cache == "cold":
                        drop_cache(files)
                    t0 = time.perf_counter()
                    res = quantize_table(src, dst, fmt, src.rows_per_shard, workers=workers)
                    secs = time.perf_counter() - t0
                    mb_s = table_bytes / secs / 1e6
                    results.append(
                        {
                            "what": "quantize",
                            "cache": cache,
                            "format": fmt,
                            "workers": workers,
                            "seconds": secs,
                            "mb_per_s": mb_s,
                            "rows_per_s": src.num_rows / secs,
                            "vs_read": mb_s / read_mb_s,
                            "rel_rmse": res.rel_rmse,
                        }
                    )
                    shutil.rmtree(dst)
                    print(
                        f"{cache:4} {fmt:6} workers={workers}: {mb_s:8.1f} MB/s "
                        f"({mb_s / read_mb_s:.3f} x read {read_mb_s:.0f} MB/s), "
                        f"{src.num_rows / secs:,.0f} rows/s, rel. RMSE {res.rel_rmse:.4f}",
                        file=sys.stderr,
                    )
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
            "checkpoint": {
                "format": args.src_format,
                "rows": src.num_rows,
                "width": src.width,
                "shards": args.parts,
                "table_bytes": table_bytes,
                "file_bytes": file_bytes,
            },
            "results": results,
        }
        if args.json:
            print(json.dumps(record, indent=2))
        else:
            print(
                f"\n{src.num_rows:,} rows x {src.width} {args.src_format} "
                f"({table_bytes / 1e6:.0f} MB), {os.cpu_count()} CPUs, load average "
                f"{load_start[0]:.2f} at start, {os.getloadavg()[0]:.2f} at end\n"
            )
            print("| cache | what | workers | input MB/s | vs read | rows/s | rel. RMSE |")
            print("|---|---|---|---|---|---|---|")
            for r in results:
                if r["what"] == "read":
                    print(
                        f"| {r['cache']} | sequential read | - | {r['mb_per_s']:.1f} | 1.000 | - | - |"
                    )
                elif r["what"] == "source":
                    print(
                        f"| {r['cache']} | row source only (read_rows) | - | {r['mb_per_s']:.1f} | "
                        f"{r['vs_read']:.3f} | {r['rows_per_s']:,.0f} | - |"
                    )
                else:
                    print(
                        f"| {r['cache']} | quantize {r['format']} | {r['workers']} | "
                        f"{r['mb_per_s']:.1f} | {r['vs_read']:.3f} | {r['rows_per_s']:,.0f} | "
                        f"{r['rel_rmse']:.4f} |"
                    )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()

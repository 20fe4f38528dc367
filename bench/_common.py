"""Helpers the bench scripts share (run as ``python bench/NAME.py``: this folder is on the path).

The synthetic tables every script builds have one layout, defined here: the released
checkpoint's ``RELEASED_SHARDS`` shards of ``ceil(rows / 128)`` rows (2,500,012 at the released
320,001,536 rows), or an explicit ``--shard-rows``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

#: The released checkpoints' ``split_ngram_parts`` and rows per shard (FACTS.md).
RELEASED_SHARDS = 128
RELEASED_SHARD_ROWS = 2_500_012
WIDTH = 160


def say(msg: str) -> None:
    """Diagnostics go to stderr."""
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def spread(values: list[float]) -> dict[str, Any]:
    """Median, min, max and the values themselves."""
    return {
        "median": round(statistics.median(values), 3),
        "min": round(min(values), 3),
        "max": round(max(values), 3),
        "values": [round(v, 3) for v in values],
    }


# -- the synthetic tables' shard layout --------------------------------------------------------
def shard_rows_for(rows: int, shard_rows: int | None = None) -> int:
    """Rows per shard of a ``rows``-row table: ``shard_rows`` when given, else the released
    layout's ``ceil(rows / 128)`` (2,500,012 at 320,001,536 rows)."""
    if shard_rows is not None:
        return int(shard_rows)
    return -(-int(rows) // RELEASED_SHARDS)


def shard_starts(rows: int, shard_rows: int | None = None) -> np.ndarray:
    """int64 [S]: the first global row of each shard (see :func:`shard_rows_for`)."""
    return np.arange(0, rows, shard_rows_for(rows, shard_rows), dtype=np.int64)


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, found {value}")
    return value


def device_refusal(device: str, cuda_available: bool) -> str | None:
    """The one ``error:`` line a GPU benchmark exits with for ``--device`` ``device`` (``cuda``
    or ``cpu``) here, or None: ``cuda`` needs a CUDA GPU, ``cpu`` Triton's interpreter."""
    if device == "cuda" and not cuda_available:
        return ("error: needs a CUDA GPU; --device cpu runs under Triton's interpreter "
                "(TRITON_INTERPRET=1)")  # fmt: skip
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return "error: --device cpu needs TRITON_INTERPRET=1 in the environment"
    return None


def add_shard_rows_option(parser: argparse.ArgumentParser, default: int | None = None) -> None:
    """``--shard-rows N`` (the help says what no value means)."""
    what = f"{default:,}" if default else "ceil(rows / 128), the released layout"
    parser.add_argument(
        "--shard-rows", type=positive_int, default=default, help=f"rows per shard (default {what})"
    )


def random_shard(fmt: str, rows: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Random valid stored tensors of ``rows`` rows (no NaN codes, positive scales)."""
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
    raise ValueError(f"no random rows for format {fmt!r}")


def build_sidecar(
    root: Path,
    fmt: str,
    rows: int,
    rng: np.random.Generator,
    shard_rows: int | None = None,
    geometry: dict[str, Any] | None = None,
) -> Path:
    """A ``fmt`` sidecar ``root/fmt`` of ``rows`` random rows in the layout above."""
    from flashnext.store.destination import SidecarWriter

    path = root / fmt
    writer = SidecarWriter(path, fmt, WIDTH, rows, shard_rows_for(rows, shard_rows), geometry)
    for i in range(writer.num_shards):
        start, end = writer.shard_rows(i)
        writer.write_shard(i, random_shard(fmt, end - start, rng))
    writer.finish()
    return path


def build_repeated(
    root: Path,
    fmt: str,
    rows: int,
    rng: np.random.Generator,
    shard_rows: int | None = None,
    threads: int = 8,
) -> Path:
    """Like :func:`build_sidecar` (same layout), but every shard holds the bytes of one random
    shard, written by ``threads`` threads: a 320M-row table in about a minute, not several.
    For timings that depend on which addresses are read, not on the values."""
    from concurrent.futures import ThreadPoolExecutor

    from flashnext.store.destination import SidecarWriter
    from flashnext.store.sidecar import write_shard_file

    path = root / fmt
    writer = SidecarWriter(path, fmt, WIDTH, rows, shard_rows_for(rows, shard_rows))
    writer.start()
    tensors = random_shard(fmt, writer.rows_per_shard, rng)

    def one(i: int) -> dict[str, Any]:
        start, end = writer.shard_rows(i)
        part = {k: v[: end - start] if v.ndim else v for k, v in tensors.items()}
        return write_shard_file(path, writer.codec, WIDTH, i, start, end - start, part,
                                table_rows=writer.num_rows)  # fmt: skip

    with ThreadPoolExecutor(threads) as pool:
        for record in pool.map(one, range(writer.num_shards)):
            writer.adopt(record)
    writer.finish()
    return path

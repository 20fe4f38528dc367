"""Streaming, parallel, resumable conversion of a PLE table into a sidecar.

The source is anything that yields float32 rows by range (:class:`RowSource`): a sidecar of
any format here, a checkpoint's table in :mod:`flashnext.checkpoint`. Each output shard is
read in blocks of ``block_rows`` rows, so memory stays at one shard's quantized tensors plus
one float32 block per worker, never the whole table.

Resume: after every finished shard, ``.flashnext-quantize.json`` in the destination records
the job's parameters and each finished shard's sha256. Run again with the same arguments and
shards whose files still hash to the recorded value are kept; the rest are redone. Output is
deterministic, so the result is byte-identical to an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from flashnext import __version__
from flashnext.atomic import write_json
from flashnext.errors import FormatError, SidecarError
from flashnext.ple.formats import get_codec
from flashnext.ple.sidecar import (
    META_NAME,
    Sidecar,
    SidecarWriter,
    open_sidecar,
    shard_name,
    write_shard_file,
)
from flashnext.ple.table import PLETable, open_table
from flashnext.safetensors_file import sha256_file

STATE_NAME = ".flashnext-quantize.json"
DEFAULT_BLOCK_ROWS = 65536


class RowSource(Protocol):
    """Float32 rows by global range; must pickle (it travels to worker processes)."""

    num_rows: int
    width: int
    rows_per_shard: int  # the source's own shard size: the default for the output

    def read_rows(self, start: int, end: int) -> np.ndarray:
        """float32 [end - start, width]."""
        ...

    def describe(self) -> dict[str, Any]:
        """JSON-ready description recorded as META.json ``source``."""
        ...


class SidecarSource:
    """Rows of an existing sidecar (any format), dequantized to float32."""

    def __init__(self, path: str | os.PathLike[str]):
        sidecar = open_sidecar(path)
        self.path = str(Path(path).resolve())
        self.num_rows = sidecar.num_rows
        self.width = sidecar.width
        self.rows_per_shard = sidecar.rows_per_shard
        self.format = sidecar.format
        self.geometry = sidecar.geometry
        self._table: PLETable | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_table": None}

    def read_rows(self, start: int, end: int) -> np.ndarray:
        if self._table is None:
            self._table = open_table(self.path, "mmap")
        return self._table.lookup(np.arange(start, end, dtype=np.int64))

    def describe(self) -> dict[str, Any]:
        return {"kind": "sidecar", "path": self.path, "format": self.format}


@dataclass
class ShardResult:
    index: int
    record: dict[str, Any]  # META.json record: file, rows, sha256, rel_rmse, sq_err, sq_ref
    seconds: float


@dataclass
class QuantizeResult:
    """What a conversion did: the sidecar, its relative RMSE, shards kept vs written, timing."""

    sidecar: Sidecar
    rel_rmse: float
    shards_written: int
    shards_kept: int
    seconds: float
    source_bytes: int
    per_shard_rmse: list[float] = field(default_factory=list)


def quantize_shard(
    source: RowSource,
    dst: str,
    fmt: str,
    index: int,
    start: int,
    end: int,
    rows_per_shard: int,
    block_rows: int = DEFAULT_BLOCK_ROWS,
) -> ShardResult:
    """Quantize rows ``[start, end)`` of ``source`` into ``dst/shard_{index}.safetensors``.

    Reads ``block_rows`` rows at a time. Non-finite source values raise :class:`FormatError`
    naming the global row id.
    """
    t0 = time.perf_counter()
    codec = get_codec(fmt)
    width = source.width
    n = end - start
    # nvfp4's per-shard scale needs the shard's absmax before any block is quantized.
    scalars: dict[str, float] = {}
    if any(not s.per_row for s in codec.specs):
        amax = 0.0
        for lo in range(start, end, block_rows):
            block = _checked(source.read_rows(lo, min(lo + block_rows, end)), lo)
            amax = max(amax, float(np.abs(block).max()) if block.size else 0.0)
        scalars = codec.shard_scalars(amax)
    out = {s.name: np.empty(s.shape(n, width), dtype=s.dtype) for s in codec.specs if s.per_row}
    sq_err = sq_ref = 0.0
    for lo in range(start, end, block_rows):
        hi = min(lo + block_rows, end)
        block = _checked(source.read_rows(lo, hi), lo)
        q = codec.quantize(block, scalars or None)
        for name, arr in out.items():
            arr[lo - start : hi - start] = q[name]
        diff = codec.dequantize(q).astype(np.float64) - block
        sq_err += float((diff * diff).sum())
        sq_ref += float(np.square(block, dtype=np.float64).sum())
    tensors: dict[str, np.ndarray] = dict(out)
    for name, value in scalars.items():
        tensors[name] = np.array(value, dtype=np.float32)
    rel = float(np.sqrt(sq_err / sq_ref)) if sq_ref > 0 else 0.0
    record = write_shard_file(
        Path(dst),
        codec,
        width,
        index,
        start,
        n,
        tensors,
        rel_rmse=rel,
        sq_err=sq_err,
        sq_ref=sq_ref,
    )
    return ShardResult(index, record, time.perf_counter() - t0)


def _checked(block: np.ndarray, first_row: int) -> np.ndarray:
    block = np.asarray(block, dtype=np.float32)
    finite = np.isfinite(block)
    if not finite.all():
        r, c = np.argwhere(~finite)[0]
        bad_rows = int((~finite.all(axis=1)).sum())
        raise FormatError(
            f"source row {first_row + int(r)} column {int(c)} is {block[r, c]} "
            f"({bad_rows} non-finite row(s) in rows [{first_row}, {first_row + len(block)})); "
            "refusing to quantize a corrupt table"
        )
    return block


def _params(source: RowSource, fmt: str, rows_per_shard: int) -> dict[str, Any]:
    return {
        "format": fmt,
        "rows_per_shard": rows_per_shard,
        "num_rows": source.num_rows,
        "width": source.width,
        "source": source.describe(),
        "flashnext_version": __version__,
    }


def _load_state(dst: Path, params: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """Finished shards of an earlier run with the same parameters: index -> META record.

    Reads the in-progress state file, or the META.json of a finished run.
    """
    for name in (STATE_NAME, META_NAME):
        try:
            state = json.loads((dst / name).read_text())
        except (OSError, ValueError):
            continue
        if name == STATE_NAME and state.get("params") == params:
            return {int(k): v for k, v in state.get("shards", {}).items()}
        if name == META_NAME and _meta_params(state) == params:
            return {
                i: rec for i, rec in enumerate(state.get("shards", [])) if isinstance(rec, dict)
            }
    return {}


def _meta_params(meta: dict[str, Any]) -> dict[str, Any]:
    return {
        "format": meta.get("format"),
        "rows_per_shard": meta.get("rows_per_shard"),
        "num_rows": meta.get("num_rows"),
        "width": meta.get("width"),
        "source": meta.get("source"),
        "flashnext_version": meta.get("flashnext_version"),
    }


def quantize_table(
    source: RowSource,
    dst: str | os.PathLike[str],
    fmt: str,
    rows_per_shard: int,
    *,
    workers: int = 1,
    geometry: dict[str, Any] | None = None,
    block_rows: int = DEFAULT_BLOCK_ROWS,
    on_shard: Callable[[ShardResult | None, int], None] | None = None,
) -> QuantizeResult:
    """Convert ``source`` into a ``fmt`` sidecar at ``dst``, resuming a previous run.

    Args:
        source: float32 rows by range (:class:`RowSource`).
        dst: destination directory; created if missing.
        fmt: ``bf16``, ``fp8``, ``int4`` or ``nvfp4``.
        rows_per_shard: rows per output shard (the last may hold fewer).
        workers: processes quantizing shards in parallel (1 = in this process).
        geometry: recorded in META.json when known.
        block_rows: rows read and quantized at a time (bounds memory).
        on_shard: called after each shard with its result (``None`` for a kept shard) and the
            shard's row count; drives progress bars.

    Raises:
        SidecarError, FormatError: bad arguments, or a non-finite source value (named by row).
    """
    t0 = time.perf_counter()
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    codec = get_codec(fmt)
    codec.check_width(source.width)
    if rows_per_shard <= 0:
        raise SidecarError(f"rows_per_shard must be positive, found {rows_per_shard}")
    params = _params(source, fmt, rows_per_shard)
    writer = SidecarWriter(
        dst, fmt, source.width, source.num_rows, rows_per_shard, geometry, source.describe()
    )
    done = _load_state(dst, params)
    (dst / META_NAME).unlink(missing_ok=True)  # META.json marks a finished sidecar; not yet
    # A run killed mid-write leaves its temporary files (atomic_write's ".NAME.tmp-PID").
    for leftover in dst.glob(".*.tmp-*"):
        if leftover.name.startswith((".shard_", f".{META_NAME}", f".{STATE_NAME}")):
            leftover.unlink(missing_ok=True)
    kept: dict[int, dict[str, Any]] = {}
    for index, record in done.items():
        path = dst / shard_name(index)
        if (
            index < writer.num_shards
            and path.exists()
            and sha256_file(path) == record.get("sha256")
        ):
            kept[index] = record
    state = {"params": params, "shards": {str(k): v for k, v in kept.items()}}
    write_json(dst / STATE_NAME, state)
    for index, record in kept.items():
        writer.adopt(record)
        if on_shard:
            start, end = writer.shard_rows(index)
            on_shard(None, end - start)

    todo = [i for i in range(writer.num_shards) if i not in kept]
    results: list[ShardResult] = []

    def finished(res: ShardResult) -> None:
        writer.adopt(res.record)
        results.append(res)
        state["shards"][str(res.index)] = res.record
        write_json(dst / STATE_NAME, state)
        if on_shard:
            on_shard(res, res.record["rows"])

    jobs: Iterable[tuple[Any, ...]] = [
        (source, str(dst), fmt, i, *writer.shard_rows(i), rows_per_shard, block_rows) for i in todo
    ]
    if workers <= 1 or len(todo) <= 1:
        for job in jobs:
            finished(quantize_shard(*job))
    else:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
            pending = {pool.submit(quantize_shard, *job) for job in jobs}
            try:
                while pending:
                    complete, pending = wait(pending, return_when=FIRST_COMPLETED)
                    for fut in complete:
                        finished(fut.result())
            except BaseException:
                for fut in pending:
                    fut.cancel()
                raise

    for stale in dst.glob("shard_*.safetensors"):  # left by an earlier run with other arguments
        suffix = stale.name[len("shard_") : -len(".safetensors")]
        if not suffix.isdigit() or int(suffix) >= writer.num_shards:
            stale.unlink()
    records = [writer.records[i] for i in range(writer.num_shards)]
    sq_err = sum(float(r.get("sq_err", 0.0)) for r in records)
    sq_ref = sum(float(r.get("sq_ref", 0.0)) for r in records)
    rel = float(np.sqrt(sq_err / sq_ref)) if sq_ref > 0 else 0.0
    sidecar = writer.finish(quantization={"rel_rmse": rel, "method": get_codec(fmt).method})
    (dst / STATE_NAME).unlink(missing_ok=True)
    written = sum(r.record["rows"] for r in results)
    return QuantizeResult(
        sidecar=sidecar,
        rel_rmse=rel,
        shards_written=len(results),
        shards_kept=len(kept),
        seconds=time.perf_counter() - t0,
        source_bytes=written * source.width * 4,
        per_shard_rmse=[float(r.get("rel_rmse", 0.0)) for r in records],
    )


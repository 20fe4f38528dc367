"""Streaming, parallel, resumable conversion of a PLE table into a sidecar.

The source is anything that yields float32 rows by range (:class:`RowSource`): a sidecar of
any format or a checkpoint's table (:mod:`flashnext.checkpoint.sources`). Each output shard is
read in blocks of ``block_rows`` rows, so memory stays at one shard's quantized tensors plus
one float32 block per worker, never the whole table.

The destination's rules (refusal, ``force``, lock, resume, commit) belong to
:class:`~flashnext.store.destination.SidecarDestination`; the README repeats them.

- Besides the relative RMSE, every shard measures its per-row error
  (:mod:`flashnext.store.row_error`): the worst row, a histogram for the 99.9th percentile, and
  the rows quantized to all-zero from a non-zero source.
- A sidecar source whose shards fail their own recorded sha256 is refused unless
  ``ignore_checksums=True`` (the mismatch is then recorded in META.json's ``source``).
- ``workers`` is capped at the shards to write and the CPUs this process may use
  (:func:`effective_workers`).
- Worker processes die with the parent (Linux ``PR_SET_PDEATHSIG``; elsewhere a thread in
  each worker watches the parent's pid).
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from flashnext.errors import FormatError, SidecarError
from flashnext.ple.formats import Codec, get_codec, stored_non_finite
from flashnext.ple.geometry import PLEGeometry
from flashnext.store import row_error
from flashnext.store.destination import DestinationLock, SidecarDestination, SidecarWriter
from flashnext.store.sidecar import (
    STATE_NAME,
    Sidecar,
    write_shard_file,
)

__all__ = [
    "CONVERSIONS",
    "ENGINES",
    "STATE_NAME",
    "QuantizeResult",
    "RowSource",
    "ShardResult",
    "StoredRowSource",
    "can_copy",
    "effective_workers",
    "quantize_from",
    "quantize_shard",
    "quantize_table",
    "usable_cpus",
]

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
        """JSON-ready identity recorded as META.json ``source``: where the rows come from and
        what identifies that content (sizes, checksums); resume compares it."""
        ...


@dataclass
class ShardResult:
    index: int
    record: dict[str, Any]  # META.json record: file, rows, sha256, rel_rmse, sq_err[, sq_ref]
    seconds: float


@dataclass
class QuantizeResult:
    """What a conversion did: the sidecar, its relative RMSE, shards kept vs written, timing."""

    sidecar: Sidecar
    rel_rmse: float
    shards_written: int
    shards_kept: int
    seconds: float
    source_bytes: int  # bytes read: float32 rows quantized, or stored tensors copied
    per_shard_rmse: list[float] = field(default_factory=list)
    conversion: str = "quantize"  # one of CONVERSIONS
    row_error: dict[str, Any] = field(default_factory=dict)  # row_error.summarize's
    workers: int = 1  # processes used (after effective_workers)

    def summary(self, source: RowSource, destination: str | os.PathLike[str]) -> dict[str, Any]:
        """JSON-ready summary (the ``ple quantize --json`` payload)."""
        return {
            "source": source.describe(),
            "destination": str(destination),
            "format": self.sidecar.format,
            "conversion": self.conversion,
            "num_rows": self.sidecar.num_rows,
            "width": self.sidecar.width,
            "num_shards": len(self.sidecar.shards),
            "shards_written": self.shards_written,
            "shards_kept": self.shards_kept,
            "size_bytes": self.sidecar.nbytes,
            "rel_rmse": self.rel_rmse,
            "worst_shard_rel_rmse": max(self.per_shard_rmse, default=0.0),
            "row_error": self.row_error,
            "workers": self.workers,
            "seconds": self.seconds,
            "input_mb_per_s": self.source_bytes / 1e6 / self.seconds if self.seconds else None,
        }


#: How a shard is made: quantized from float32 rows, or copied from a source that already
#: stores the rows in the target format (exact; see :func:`can_copy`).
CONVERSIONS = ("quantize", "copy")
_COPY_METHOD = "copied from the source's stored tensors (exact)"
#: ``auto``: the compiled kernels when they reproduce the numpy codec on this platform
#: (:func:`~flashnext.store.quantize_kernels.compiled_matches_reference`), else numpy.
ENGINES = ("auto", "numpy")


class StoredRowSource(RowSource, Protocol):
    """A source that can also hand out its stored tensors (a lossless copy reads these)."""

    format: str

    def read_stored(self, start: int, end: int) -> dict[str, np.ndarray]:
        """The tensors of codec ``format`` for rows ``[start, end)``: per-row tensors
        [end - start, ...] and per-shard scalars as 0-d arrays."""
        ...


def can_copy(source: RowSource, fmt: str) -> bool:
    """Whether ``source`` stores its rows in ``fmt`` exactly (a byte copy reproduces them).

    True for sources with ``read_stored`` (checkpoints: bf16, fp8 with its global scale as
    every row's scale, nvfp4 with its global scale as every shard's ``weight_scale_2``).
    """
    return callable(getattr(source, "read_stored", None)) and getattr(source, "format", None) == fmt


def quantize_shard(
    source: RowSource,
    dst: str,
    fmt: str,
    index: int,
    start: int,
    end: int,
    rows_per_shard: int,
    block_rows: int = DEFAULT_BLOCK_ROWS,
    conversion: str = "quantize",
    engine: str = "auto",
) -> ShardResult:
    """Quantize (or copy) rows ``[start, end)`` of ``source`` into ``dst/shard_{index}.safetensors``.

    Reads ``block_rows`` rows at a time. ``conversion`` is one of :data:`CONVERSIONS`
    (``copy`` needs :func:`can_copy`), ``engine`` one of :data:`ENGINES` or ``compiled`` (the
    kernels, their self-check already passed in this run); the shard's bytes do not depend on
    the engine.

    Raises:
        FormatError: a non-finite source value (named by global row id), or a stored tensor
            that does not fit the format.
    """
    t0 = time.perf_counter()
    codec = get_codec(fmt)
    if conversion == "copy":
        tensors, extra = _copy_rows(source, codec, start, end, block_rows)  # type: ignore[arg-type]
    else:
        tensors, extra = _quantize_rows(source, codec, start, end, block_rows, _compiled(engine))
    record = write_shard_file(
        Path(dst),
        codec,
        source.width,
        index,
        start,
        end - start,
        tensors,
        table_rows=source.num_rows,
        **extra,
    )
    return ShardResult(index, record, time.perf_counter() - t0)


def _compiled(engine: str) -> bool:
    """Whether to run the compiled kernels (``compiled``: the caller has checked them)."""
    if engine in ("numpy", "compiled"):
        return engine == "compiled"
    from flashnext.store.quantize_kernels import compiled_matches_reference

    return compiled_matches_reference()


def _blocks(
    source: RowSource, start: int, end: int, block_rows: int, compiled: bool
) -> Iterator[tuple[int, np.ndarray, float | None]]:
    """(first row, float32 block, its absmax when the scan found it) of rows [start, end),
    non-finite values refused (:func:`_checked`'s message)."""
    for lo in range(start, end, block_rows):
        block = np.asarray(source.read_rows(lo, min(lo + block_rows, end)), dtype=np.float32)
        if not compiled:
            yield lo, _checked(block, lo), None
            continue
        from flashnext.store.quantize_kernels import block_absmax

        amax, bad = block_absmax(block)
        if bad >= 0:
            _checked(block, lo)  # raises, naming the row
        yield lo, block, amax


def _quantize_rows(
    source: RowSource, codec: Codec, start: int, end: int, block_rows: int, compiled: bool
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The shard's tensors and its META.json extras (rel_rmse, sq_err, sq_ref)."""
    n = end - start
    # nvfp4's per-shard scale needs the shard's absmax before any block is quantized.
    scalars: dict[str, float] = {}
    if codec.scalar_specs:
        amax = 0.0
        for _, block, found in _blocks(source, start, end, block_rows, compiled):
            if found is None:
                found = float(np.abs(block).max()) if block.size else 0.0
            amax = max(amax, found)
        scalars = codec.shard_scalars(amax)
    out = {s.name: np.empty(s.shape(n, source.width), dtype=s.dtype) for s in codec.row_specs}
    sq_err = sq_ref = 0.0
    rows = row_error.RowErrors()
    for lo, block, _ in _blocks(source, start, end, block_rows, compiled):
        if compiled:
            from flashnext.store.quantize_kernels import quantize_block

            # each row's error comes from the kernel's own sums: dequantizing the block
            # again in numpy cost the nvfp4 quantizer ~40% of its throughput
            sums = np.empty((len(block), 3))
            q, err, ref = quantize_block(codec, block, scalars or None, finite=True, row_sums=sums)
            rows.add_sums(sums, lo)
        else:
            q = codec.quantize(block, scalars or None)
            restored = codec.dequantize(q)
            diff = restored.astype(np.float64) - block
            err = float((diff * diff).sum())
            ref = float(np.square(block, dtype=np.float64).sum())
            rows.add(block, restored, lo)
        for name, arr in out.items():
            arr[lo - start : lo - start + len(block)] = q[name]
        sq_err += err
        sq_ref += ref
    tensors: dict[str, np.ndarray] = dict(out)
    for name, value in scalars.items():
        tensors[name] = np.array(value, dtype=np.float32)
    rel = float(np.sqrt(sq_err / sq_ref)) if sq_ref > 0 else 0.0
    extra = {"rel_rmse": rel, "sq_err": sq_err, "sq_ref": sq_ref, "row_error": rows.to_record()}
    return tensors, extra


def _copy_rows(
    source: StoredRowSource, codec: Codec, start: int, end: int, block_rows: int
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The shard's tensors copied from the source's stored ones (exact: rel. RMSE 0)."""
    n = end - start
    out = {s.name: np.empty(s.shape(n, source.width), dtype=s.dtype) for s in codec.row_specs}
    scalars: dict[str, np.ndarray] = {}
    for lo in range(start, end, block_rows):
        hi = min(lo + block_rows, end)
        stored = source.read_stored(lo, hi)
        for spec in codec.specs:
            arr = np.asarray(stored[spec.name])
            if arr.dtype != spec.dtype or arr.shape != spec.shape(hi - lo, source.width):
                raise FormatError(
                    f"source rows [{lo}, {hi}): stored tensor {spec.name} is {arr.dtype} "
                    f"{list(arr.shape)}, expected {spec.dtype} "
                    f"{list(spec.shape(hi - lo, source.width))}; use --requantize"
                )
            _refuse_non_finite(spec.name, arr, lo)
            if spec.per_row:
                out[spec.name][lo - start : hi - start] = arr
            elif scalars.setdefault(spec.name, arr).tobytes() != arr.tobytes():
                raise FormatError(
                    f"source rows [{start}, {end}): {spec.name} changes inside one output shard "
                    f"({scalars[spec.name]} vs {arr}); use --requantize or other --rows-per-shard"
                )
    extra = {"rel_rmse": 0.0, "sq_err": 0.0, "conversion": "copy", "row_error": row_error.exact()}
    return {**out, **scalars}, extra


def _refuse_non_finite(name: str, arr: np.ndarray, first_row: int) -> None:
    bad = stored_non_finite(arr)
    if bad.any():
        where = tuple(np.argwhere(bad)[0])
        row = first_row + int(where[0]) if arr.ndim else first_row
        raise FormatError(
            f"source row {row}: stored {name} value {arr[where]} is not finite; refusing to "
            "copy a corrupt table"
        )


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


def _die_with_parent(parent: int) -> None:
    """Worker initializer: exit when the parent process dies, even by SIGKILL."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)
    else:

        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(0.5)
            os._exit(1)

        threading.Thread(target=watch, daemon=True, name="flashnext-parent-watch").start()
    if os.getppid() != parent:  # the parent died before the signal was armed
        os._exit(1)


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the platform has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def effective_workers(requested: int, shards: int) -> int:
    """Worker processes for ``shards`` shards: at most one per shard and per usable CPU.

    More processes than CPUs only add memory (each holds a shard's tensors and a block).
    """
    return max(1, min(requested, shards, usable_cpus()))


def _run_shards(
    jobs: list[tuple[Any, ...]], workers: int, finished: Callable[[ShardResult], None]
) -> None:
    """Quantize ``jobs`` (arguments of :func:`quantize_shard`) here or in worker processes.

    On any failure or interrupt (SIGTERM turned into an exception by the CLI included) the
    workers are stopped and the pool shut down before the exception goes on, so no process
    and no semaphore outlives the run.
    """
    if workers <= 1 or len(jobs) <= 1:
        for job in jobs:
            finished(quantize_shard(*job))
        return
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    pool = ProcessPoolExecutor(
        max_workers=workers,
        mp_context=ctx,
        initializer=_die_with_parent,
        initargs=(os.getpid(),),
    )
    try:
        pending = {pool.submit(quantize_shard, *job) for job in jobs}
        while pending:
            complete, pending = wait(pending, return_when=FIRST_COMPLETED)
            for fut in complete:
                finished(fut.result())
    except BaseException:
        _stop_workers(pool)
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _stop_workers(pool: ProcessPoolExecutor) -> None:
    """Cancel what has not started and end the running workers now (their shards are lost;
    a temporary file they leave is removed by the next run)."""
    processes = list((getattr(pool, "_processes", None) or {}).values())
    manager = getattr(pool, "_executor_manager_thread", None)
    pool.shutdown(wait=False, cancel_futures=True)
    for proc in processes:
        proc.terminate()
    for proc in processes:
        proc.join(timeout=10)
    # shutdown(wait=False) forgets the pool's manager thread, so no later shutdown joins it. Left
    # running, it closes its wakeup pipe while the interpreter's exit hook writes to that pipe
    # (CPython 3.11: "OSError: [Errno 9] Bad file descriptor" printed after our error line).
    if manager is not None:
        manager.join(timeout=30)


def _table_rmse(records: Iterable[Mapping[str, Any]]) -> float:
    """Relative RMSE of the whole table from the shards' squared-error sums."""
    records = list(records)
    sq_err = sum(float(r.get("sq_err", 0.0)) for r in records)
    sq_ref = sum(float(r.get("sq_ref", 0.0)) for r in records)
    return float(np.sqrt(sq_err / sq_ref)) if sq_ref > 0 else 0.0


def quantize_from(
    open_source: Callable[[], RowSource],
    dst: str | os.PathLike[str],
    fmt: str,
    rows_per_shard: int | None = None,
    *,
    on_source: Callable[[RowSource], None] | None = None,
    **options: Any,
) -> tuple[RowSource, QuantizeResult]:
    """:func:`quantize_table` of the source ``open_source()`` opens, opened under ``dst``'s
    :class:`~flashnext.store.destination.DestinationLock`: opening a sidecar source hashes it
    (minutes for a large table), and a second writer of ``dst`` is refused at once, not after.

    ``rows_per_shard`` defaults to the source's own; ``on_source(source)`` is called once the
    source is open, before a row is read (a progress bar learns the row count); ``options``
    are :func:`quantize_table`'s keyword arguments (``lock`` aside: this holds it), with
    ``geometry`` the source's when it has one.

    Returns:
        The opened source and the result.

    Raises:
        SidecarError: another process is writing ``dst``, or as :func:`quantize_table` and
            the source's opener.
    """
    with DestinationLock(Path(dst)) as lock:
        source = open_source()
        if on_source is not None:
            on_source(source)
        per_shard = rows_per_shard if rows_per_shard is not None else source.rows_per_shard
        options.setdefault("geometry", getattr(source, "geometry", None))
        return source, quantize_table(source, dst, fmt, per_shard, lock=lock, **options)


def quantize_table(
    source: RowSource,
    dst: str | os.PathLike[str],
    fmt: str,
    rows_per_shard: int,
    *,
    workers: int = 1,
    geometry: PLEGeometry | Mapping[str, Any] | None = None,
    block_rows: int = DEFAULT_BLOCK_ROWS,
    on_shard: Callable[[ShardResult | None, int], None] | None = None,
    force: bool = False,
    requantize: bool = False,
    engine: str = "auto",
    max_row_error: float = row_error.DEFAULT_MAX_ROW_ERROR,
    inputs: Iterable[str | os.PathLike[str]] = (),
    lock: DestinationLock | None = None,
) -> QuantizeResult:
    """Convert ``source`` into a ``fmt`` sidecar at ``dst``, resuming a previous run.

    Length: the docstring documents every argument; the body is a dozen lines.

    When the source already stores ``fmt`` exactly (:func:`can_copy`), its tensors are copied
    (rel. RMSE 0, at the speed of the reads and writes) unless ``requantize``.

    Args:
        source: float32 rows by range (:class:`RowSource`).
        dst: destination directory (:class:`~flashnext.store.destination.SidecarDestination`
            says what may be there; it may not be, hold or lie inside the source).
        fmt: ``bf16``, ``fp8``, ``int4`` or ``nvfp4``.
        rows_per_shard: rows per output shard (the last may hold fewer).
        workers: processes quantizing shards in parallel (1 = in this process), capped by
            :func:`effective_workers`.
        geometry: recorded in META.json when known.
        block_rows: rows read and quantized at a time (bounds memory).
        on_shard: called after each shard with its result (``None`` for a kept shard) and the
            shard's row count; drives progress bars.
        force: replace a destination that holds anything else (written beside, swapped in).
        requantize: quantize from float32 rows even when a copy would be exact.
        engine: ``auto`` (compiled kernels when they match numpy here) or ``numpy``
            (:data:`ENGINES`); the output bytes are the same.
        max_row_error: the result's ``row_error["ok"]`` is False when a row's relative error
            exceeds it (the table is written either way; the CLI then exits 1).
        inputs: more paths ``dst`` must stay clear of (the source's own path always counts).
        lock: a held :class:`~flashnext.store.destination.DestinationLock` on ``dst`` (taken by
            the caller before opening the source); else one is taken here.

    Raises:
        SidecarError: bad arguments, a destination that holds something else (without
            ``force``), is an input or is being written by another process, or a file that
            cannot be read or written.
        FormatError: a non-finite source value (named by row).
    """
    get_codec(fmt).check_width(source.width)
    if rows_per_shard <= 0:
        raise SidecarError(f"rows_per_shard must be positive, found {rows_per_shard}")
    conversion = "copy" if can_copy(source, fmt) and not requantize else "quantize"
    options = _Options(workers, block_rows, conversion, engine, force, max_row_error, lock)
    described = source.describe()
    inputs = [*inputs, *([described["path"]] if described.get("path") else [])]
    try:
        return _quantize(
            source, Path(dst), fmt, rows_per_shard, geometry, options, on_shard, inputs
        )
    except OSError as exc:
        where = exc.filename or dst
        raise SidecarError(
            f"{where}: {exc.strerror or exc} (while quantizing into {dst}); "
            + _os_hint(exc, force)
        ) from None


def _os_hint(exc: OSError, force: bool) -> str:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        # a --force run's partial table is removed (it holds the space; the old one is intact)
        kept = "the old table is intact" if force else "finished shards are kept for a rerun"
        return f"free space or choose another destination ({kept})"
    return "check the path and its permissions"


@dataclass(frozen=True)
class _Options:
    workers: int
    block_rows: int
    conversion: str  # one of CONVERSIONS
    engine: str  # one of ENGINES
    force: bool
    max_row_error: float
    lock: DestinationLock | None

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise SidecarError(f"engine {self.engine!r}: expected one of {list(ENGINES)}")


def _quantize(
    source: RowSource,
    dst: Path,
    fmt: str,
    rows_per_shard: int,
    geometry: PLEGeometry | Mapping[str, Any] | None,
    opt: _Options,
    on_shard: Callable[[ShardResult | None, int], None] | None,
    inputs: list[str | os.PathLike[str]],
) -> QuantizeResult:
    t0 = time.perf_counter()
    # A copy and a quantization of the same rows differ: resume must not mix them. (Only a
    # copy says so, so quantized outputs of earlier versions still resume.)
    settings = {"conversion": opt.conversion} if opt.conversion == "copy" else None
    writer = SidecarWriter(
        dst, fmt, source.width, source.num_rows, rows_per_shard, geometry, source.describe(),
        settings,
    )  # fmt: skip
    with SidecarDestination(dst, writer, force=opt.force, inputs=inputs, lock=opt.lock) as dest:
        for index in dest.kept:
            if on_shard:
                start, end = writer.shard_rows(index)
                on_shard(None, end - start)
        if dest.finished:
            return _result(dest.commit(), [], len(dest.kept), t0, source.width, opt, 0)
        dest.start()
        results: list[ShardResult] = []

        def finished(res: ShardResult) -> None:
            dest.adopt(res.record)
            results.append(res)
            if on_shard:
                on_shard(res, res.record["rows"])

        engine = opt.engine
        if opt.conversion == "quantize" and engine == "auto":  # the self-check once, not per worker
            engine = "compiled" if _compiled(engine) else "numpy"
        shared = (opt.block_rows, opt.conversion, engine)
        jobs = [
            (source, str(dest.workdir), fmt, i, *writer.shard_rows(i), rows_per_shard, *shared)
            for i in dest.todo
        ]
        workers = effective_workers(opt.workers, len(jobs))
        _run_shards(jobs, workers, finished)
        records = [writer.records[i] for i in range(writer.num_shards)]
        method = get_codec(fmt).method if opt.conversion == "quantize" else _COPY_METHOD
        sidecar = dest.commit(quantization={"rel_rmse": _table_rmse(records), "method": method,
                                            "max_row_error": opt.max_row_error})  # fmt: skip
    return _result(sidecar, results, len(dest.kept), t0, source.width, opt, workers)


def _result(
    sidecar: Sidecar,
    results: list[ShardResult],
    kept: int,
    t0: float,
    width: int,
    opt: _Options,
    workers: int,
) -> QuantizeResult:
    records = sidecar.meta.get("shards", [])
    written = sum(r.record["rows"] for r in results)
    settings = sidecar.meta.get("settings")
    conversion = settings.get("conversion") if isinstance(settings, dict) else None
    conversion = conversion if conversion in CONVERSIONS else "quantize"
    row_bytes = (
        get_codec(sidecar.format).bytes_per_row(width) if conversion == "copy" else width * 4
    )
    return QuantizeResult(
        sidecar=sidecar,
        rel_rmse=_table_rmse(records),
        shards_written=len(results),
        shards_kept=kept,
        seconds=time.perf_counter() - t0,
        source_bytes=written * row_bytes,
        per_shard_rmse=[float(r.get("rel_rmse", 0.0)) for r in records],
        conversion=conversion,
        row_error=row_error.summarize((r.get("row_error") for r in records), opt.max_row_error),
        workers=workers,
    )

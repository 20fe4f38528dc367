"""Streaming, parallel, resumable conversion of a PLE table into a sidecar.

The source is anything that yields float32 rows by range (:class:`RowSource`): a sidecar of
any format here, a checkpoint's table in :mod:`flashnext.checkpoint`. Each output shard is
read in blocks of ``block_rows`` rows, so memory stays at one shard's quantized tensors plus
one float32 block per worker, never the whole table.

The destination (the README repeats these rules):

- It is written only when it is missing, empty, or this command's own output for the same
  source and settings: unfinished (its state record, :data:`STATE_NAME`, matches) or
  finished (its META.json matches). Anything else is refused, naming what is there.
- ``force=True`` replaces it, but the new table is written beside it (``.DST.flashnext-new``)
  and swapped in only once complete: the old contents stay intact until then.
- Resume: the state record lists the settings, the source's identity (sizes and sha256 of a
  sidecar's shards; sizes and mtimes of a checkpoint's files) and each finished shard's
  sha256. Running the same command again keeps shards whose files still hash to the recorded
  value; a changed source or setting is refused (or replaced with ``force``). Output is
  deterministic, so a resumed result is byte-identical to an uninterrupted run.
- A sidecar source whose shards fail their own recorded sha256 is refused unless
  ``ignore_checksums=True`` (the mismatch is then recorded in META.json's ``source``).
- Worker processes die with the parent (Linux ``PR_SET_PDEATHSIG``; elsewhere a thread in
  each worker watches the parent's pid).
"""

from __future__ import annotations

import os
import shutil
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
from flashnext.ple.sidecar import (
    META_NAME,
    STATE_NAME,
    Sidecar,
    SidecarWriter,
    open_sidecar,
    read_meta,
    read_state,
    shard_name,
    write_shard_file,
)
from flashnext.ple.table import PLETable, open_table
from flashnext.safetensors_file import sha256_file

__all__ = [
    "CONVERSIONS",
    "ENGINES",
    "STATE_NAME",
    "QuantizeResult",
    "RowSource",
    "ShardResult",
    "SidecarSource",
    "StoredRowSource",
    "can_copy",
    "quantize_shard",
    "quantize_table",
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


class SidecarSource:
    """Rows of an existing sidecar (any format), dequantized to float32.

    Opening hashes every shard: the digests identify the source (resume notices a source
    regenerated at the same path), and shards whose recorded sha256 (META.json) differs are
    refused unless ``ignore_checksums``. ``progress(nbytes)`` is called while hashing.

    Raises:
        SidecarError: the sidecar is invalid or unfinished, or a shard fails its checksum.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        ignore_checksums: bool = False,
        progress: Callable[[int], None] | None = None,
    ):
        sidecar = open_sidecar(path)
        self.path = str(Path(path).resolve())
        self.num_rows = sidecar.num_rows
        self.width = sidecar.width
        self.rows_per_shard = sidecar.rows_per_shard
        self.format = sidecar.format
        self.geometry: PLEGeometry | None = sidecar.geometry
        self.nbytes = sidecar.nbytes
        self._identity = _sidecar_identity(sidecar, ignore_checksums, progress)
        self._table: PLETable | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_table": None}

    def read_rows(self, start: int, end: int) -> np.ndarray:
        if self._table is None:
            self._table = open_table(self.path, "mmap")
        return self._table.lookup(np.arange(start, end, dtype=np.int64))

    def describe(self) -> dict[str, Any]:
        return {"kind": "sidecar", "path": self.path, "format": self.format, **self._identity}


def _sidecar_identity(
    sidecar: Sidecar, ignore_checksums: bool, progress: Callable[[int], None] | None
) -> dict[str, Any]:
    """``{"files": {name: [size, sha256]}}``, plus the mismatches the caller accepted."""
    expected = sidecar.expected_checksums()
    files: dict[str, list[Any]] = {}
    mismatched = []
    for shard in sidecar.shards:
        try:
            digest = sha256_file(shard.path, progress=progress)
        except OSError as exc:
            raise SidecarError(f"{shard.path}: cannot read ({exc.strerror})") from None
        files[shard.path.name] = [shard.path.stat().st_size, digest]
        want = expected.get(shard.index)
        if want is not None and want != digest:
            mismatched.append(shard.path.name)
    if mismatched and not ignore_checksums:
        raise SidecarError(
            f"{sidecar.path}: source shard(s) {', '.join(mismatched[:5])} do not match the sha256 "
            f"in its {META_NAME}: the source is corrupt or changed after it was written; "
            "re-create it, or pass --ignore-source-checksums to quantize it anyway"
        )
    return {"files": files, **({"checksum_mismatch_accepted": mismatched} if mismatched else {})}


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
            "seconds": self.seconds,
            "input_mb_per_s": self.source_bytes / 1e6 / self.seconds if self.seconds else None,
        }


#: How a shard is made: quantized from float32 rows, or copied from a source that already
#: stores the rows in the target format (exact; see :func:`can_copy`).
CONVERSIONS = ("quantize", "copy")
_COPY_METHOD = "copied from the source's stored tensors (exact)"
#: ``auto``: the compiled kernels when they reproduce the numpy codec on this platform
#: (:func:`~flashnext.ple.quantize_kernels.compiled_matches_reference`), else numpy.
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
    from flashnext.ple.quantize_kernels import compiled_matches_reference

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
        from flashnext.ple.quantize_kernels import block_absmax

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
    for lo, block, _ in _blocks(source, start, end, block_rows, compiled):
        if compiled:
            from flashnext.ple.quantize_kernels import quantize_block

            q, err, ref = quantize_block(codec, block, scalars or None, finite=True)
        else:
            q = codec.quantize(block, scalars or None)
            diff = codec.dequantize(q).astype(np.float64) - block
            err = float((diff * diff).sum())
            ref = float(np.square(block, dtype=np.float64).sum())
        for name, arr in out.items():
            arr[lo - start : lo - start + len(block)] = q[name]
        sq_err += err
        sq_ref += ref
    tensors: dict[str, np.ndarray] = dict(out)
    for name, value in scalars.items():
        tensors[name] = np.array(value, dtype=np.float32)
    rel = float(np.sqrt(sq_err / sq_ref)) if sq_ref > 0 else 0.0
    return tensors, {"rel_rmse": rel, "sq_err": sq_err, "sq_ref": sq_ref}


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
    return {**out, **scalars}, {"rel_rmse": 0.0, "sq_err": 0.0, "conversion": "copy"}


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


@dataclass
class _Destination:
    """Where shards are written: ``dst`` itself, or a directory beside it swapped in at the end."""

    dst: Path
    workdir: Path
    kept: dict[int, dict[str, Any]]
    finished: bool  # the destination already is this exact output: nothing to write

    @property
    def replaces(self) -> bool:
        return self.workdir != self.dst


def _own_names(num_shards: int) -> Callable[[str], bool]:
    """Whether a file name is one this writer creates (shards, META, state, their temps)."""
    shard_names = {shard_name(i) for i in range(num_shards)}
    finals = shard_names | {META_NAME, STATE_NAME}

    def ours(name: str) -> bool:
        if name in finals:
            return True
        base, sep, pid = name.rpartition(".tmp-")  # atomic_write's ".NAME.tmp-PID"
        return bool(sep) and pid.isdigit() and base.startswith(".") and base[1:] in finals

    return ours


def _listing(directory: Path) -> list[str]:
    if not directory.exists():
        return []
    if not directory.is_dir():
        raise SidecarError(
            f"{directory}: exists and is not a directory; choose another destination"
        )
    try:
        return sorted(p.name for p in directory.iterdir())
    except OSError as exc:
        raise SidecarError(f"{directory}: cannot list ({exc.strerror})") from None


def _recorded_params(directory: Path) -> tuple[str, dict[str, Any] | None, dict[int, Any]]:
    """What an earlier run left: ("unfinished" | "finished" | "", its params, its shards)."""
    try:
        state = read_state(directory)
    except SidecarError:
        return "unfinished", None, {}
    if state is not None:
        done = state.get("shards")
        shards = done if isinstance(done, dict) else {}
        return "unfinished", state.get("params"), {int(k): v for k, v in shards.items()}
    try:
        meta = read_meta(directory)
    except SidecarError:
        return "", None, {}
    if not meta:
        return "", None, {}
    params = {"settings": meta.get("settings"), "source": meta.get("source")}
    listed = meta.get("shards")
    records = listed if isinstance(listed, list) else []
    return "finished", params, {i: r for i, r in enumerate(records) if isinstance(r, dict)}


def _differences(old: Mapping[str, Any] | None, new: Mapping[str, Any]) -> str:
    """What changed between two runs' params, in words."""
    if not isinstance(old, Mapping):
        return "made by another version or tool"

    def mapping(value: Any) -> Mapping[str, Any]:
        return value if isinstance(value, Mapping) else {}

    out = []
    old_settings = mapping(old.get("settings"))
    for key, value in new["settings"].items():
        if old_settings.get(key) != value:
            out.append(f"{key} {old_settings.get(key)!r} -> {value!r}")
    old_src, new_src = mapping(old.get("source")), new["source"]
    if old_src.get("path") != new_src.get("path"):
        out.append(f"source {old_src.get('path')} -> {new_src.get('path')}")
    elif old_src != new_src:
        old_files = mapping(old_src.get("files"))
        changed = [n for n, v in new_src.get("files", {}).items() if old_files.get(n) != v]
        out.append(f"source changed since ({', '.join(changed[:3]) or 'its description'})")
    return (
        "; ".join(out[:3] + (["..."] if len(out) > 3 else [])) or "made by another version or tool"
    )


def _existing_output(
    directory: Path, params: Mapping[str, Any], num_shards: int
) -> tuple[dict[int, dict[str, Any]], bool] | str:
    """Shards to keep and whether finished, if ``directory`` is this run's own output; else a
    description of what is there (for the refusal)."""
    names = _listing(directory)
    if not names:
        return {}, False
    status, old, shards = _recorded_params(directory)
    ours = _own_names(max(num_shards, len(shards)))
    foreign = [n for n in names if not ours(n)]
    there = []
    if status and old != params:
        article = "an" if status == "unfinished" else "a"
        there.append(f"{article} {status} table that differs ({_differences(old, params)})")
    if foreign:
        more = f" and {len(foreign) - 5} more" if len(foreign) > 5 else ""
        there.append(f"files this command did not write ({', '.join(foreign[:5])}{more})")
    if not status and not foreign:
        there.append(f"{', '.join(names[:3])} but no flashnext {META_NAME} or run state")
    if there:
        return "holds " + " and ".join(there)
    kept = {}
    for index, record in shards.items():
        path = directory / shard_name(index)
        ok = 0 <= index < num_shards and path.is_file()
        if ok and sha256_file(path) == record.get("sha256"):
            kept[index] = dict(record)
    return kept, status == "finished" and len(kept) == num_shards


def _prepare_destination(
    dst: Path, params: Mapping[str, Any], num_shards: int, force: bool
) -> _Destination:
    """Decide where to write: refuse foreign contents unless ``force``, resume our own.

    Raises:
        SidecarError: ``dst`` holds something else and ``force`` is not set (the message names
            what is there), or is not a directory.
    """
    found = _existing_output(dst, params, num_shards)
    if not isinstance(found, str):
        kept, finished = found
        return _Destination(dst, dst, kept, finished)
    if not force:
        raise SidecarError(
            f"{dst}: {found}. Refusing to overwrite it: choose a new or empty directory, or pass "
            "--force to replace it (the old contents stay until the new table is complete)"
        )
    stage = dst.with_name(f".{dst.name}.flashnext-new")
    staged = _existing_output(stage, params, num_shards)
    if isinstance(staged, str):
        if not _listing(stage) or all(map(_own_names(1 << 20), _listing(stage))):
            shutil.rmtree(stage, ignore_errors=True)  # an earlier --force run's leftovers
            staged = ({}, False)
        else:
            raise SidecarError(f"{stage}: {staged}; remove it")
    return _Destination(dst, stage, staged[0], False)


def _swap_in(dest: _Destination) -> None:
    """Replace ``dst`` by the finished work directory; the old contents go last."""
    old = dest.dst.with_name(f".{dest.dst.name}.flashnext-old")
    shutil.rmtree(old, ignore_errors=True)
    if dest.dst.exists():
        os.replace(dest.dst, old)
    os.replace(dest.workdir, dest.dst)
    shutil.rmtree(old, ignore_errors=True)


def _remove_own_temps(directory: Path, num_shards: int) -> None:
    """Temporary files a killed run left (only names this writer creates)."""
    ours = _own_names(num_shards)
    for name in _listing(directory):
        if ".tmp-" in name and ours(name):
            (directory / name).unlink(missing_ok=True)


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


def _run_shards(
    jobs: list[tuple[Any, ...]], workers: int, finished: Callable[[ShardResult], None]
) -> None:
    """Quantize ``jobs`` (arguments of :func:`quantize_shard`) here or in worker processes."""
    if workers <= 1 or len(jobs) <= 1:
        for job in jobs:
            finished(quantize_shard(*job))
        return
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(
        max_workers=workers,
        mp_context=ctx,
        initializer=_die_with_parent,
        initargs=(os.getpid(),),
    ) as pool:
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


def _table_rmse(records: Iterable[Mapping[str, Any]]) -> float:
    """Relative RMSE of the whole table from the shards' squared-error sums."""
    records = list(records)
    sq_err = sum(float(r.get("sq_err", 0.0)) for r in records)
    sq_ref = sum(float(r.get("sq_ref", 0.0)) for r in records)
    return float(np.sqrt(sq_err / sq_ref)) if sq_ref > 0 else 0.0


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
) -> QuantizeResult:
    """Convert ``source`` into a ``fmt`` sidecar at ``dst``, resuming a previous run.

    When the source already stores ``fmt`` exactly (:func:`can_copy`), its tensors are copied
    (rel. RMSE 0, at the speed of the reads and writes) unless ``requantize``.

    Args:
        source: float32 rows by range (:class:`RowSource`).
        dst: destination directory (see the module docstring for what may be there).
        fmt: ``bf16``, ``fp8``, ``int4`` or ``nvfp4``.
        rows_per_shard: rows per output shard (the last may hold fewer).
        workers: processes quantizing shards in parallel (1 = in this process).
        geometry: recorded in META.json when known.
        block_rows: rows read and quantized at a time (bounds memory).
        on_shard: called after each shard with its result (``None`` for a kept shard) and the
            shard's row count; drives progress bars.
        force: replace a destination that holds anything else (written beside, swapped in).
        requantize: quantize from float32 rows even when a copy would be exact.
        engine: ``auto`` (compiled kernels when they match numpy here) or ``numpy``
            (:data:`ENGINES`); the output bytes are the same.

    Raises:
        SidecarError: bad arguments, a destination that holds something else (without
            ``force``), or a file that cannot be read or written.
        FormatError: a non-finite source value (named by row).
    """
    get_codec(fmt).check_width(source.width)
    if rows_per_shard <= 0:
        raise SidecarError(f"rows_per_shard must be positive, found {rows_per_shard}")
    if engine not in ENGINES:
        raise SidecarError(f"engine {engine!r}: expected one of {list(ENGINES)}")
    conversion = "copy" if can_copy(source, fmt) and not requantize else "quantize"
    options = _Options(workers, block_rows, conversion, engine, force)
    try:
        return _quantize(source, Path(dst), fmt, rows_per_shard, geometry, options, on_shard)
    except OSError as exc:
        where = exc.filename or dst
        raise SidecarError(
            f"{where}: {exc.strerror or exc} (while quantizing into {dst}); check the path and "
            "its permissions"
        ) from None


@dataclass(frozen=True)
class _Options:
    workers: int
    block_rows: int
    conversion: str  # one of CONVERSIONS
    engine: str  # one of ENGINES
    force: bool


def _quantize(
    source: RowSource,
    dst: Path,
    fmt: str,
    rows_per_shard: int,
    geometry: PLEGeometry | Mapping[str, Any] | None,
    opt: _Options,
    on_shard: Callable[[ShardResult | None, int], None] | None,
) -> QuantizeResult:
    t0 = time.perf_counter()
    described = source.describe()
    writer = SidecarWriter(
        dst, fmt, source.width, source.num_rows, rows_per_shard, geometry, described
    )
    # A copy and a quantization of the same rows differ: resume must not mix them. (Only a
    # copy says so, so quantized outputs of earlier versions still resume.)
    if opt.conversion == "copy":
        writer.settings["conversion"] = opt.conversion
    dest = _prepare_destination(dst, writer.params, writer.num_shards, opt.force)
    writer.path = dest.workdir
    for index in dest.kept:
        if on_shard:
            start, end = writer.shard_rows(index)
            on_shard(None, end - start)
    if dest.finished:
        return _result(open_sidecar(dst), [], len(dest.kept), t0, source.width)
    _remove_own_temps(dest.workdir, writer.num_shards)
    writer.start(dest.kept)
    results: list[ShardResult] = []

    def finished(res: ShardResult) -> None:
        writer.adopt(res.record)
        results.append(res)
        if on_shard:
            on_shard(res, res.record["rows"])

    engine = opt.engine
    if opt.conversion == "quantize" and engine == "auto":  # the self-check once, not per worker
        engine = "compiled" if _compiled(engine) else "numpy"
    shared = (opt.block_rows, opt.conversion, engine)
    jobs = [
        (source, str(dest.workdir), fmt, i, *writer.shard_rows(i), rows_per_shard, *shared)
        for i in range(writer.num_shards)
        if i not in dest.kept
    ]
    _run_shards(jobs, opt.workers, finished)
    records = [writer.records[i] for i in range(writer.num_shards)]
    method = get_codec(fmt).method if opt.conversion == "quantize" else _COPY_METHOD
    sidecar = writer.finish(quantization={"rel_rmse": _table_rmse(records), "method": method})
    if dest.replaces:
        _swap_in(dest)
        sidecar = open_sidecar(dst)
    return _result(sidecar, results, len(dest.kept), t0, source.width)


def _result(
    sidecar: Sidecar, results: list[ShardResult], kept: int, t0: float, width: int
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
    )

"""What ``flashnext ple info`` reports about a sidecar: layout, checksums, stored values, fit
in host RAM."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from flashnext.host.preflight import DEFAULT_HEADROOM, HostMemory, host_memory
from flashnext.ple.formats import BF16, E4M3, F16, F32
from flashnext.store import row_error
from flashnext.store.sidecar import META_NAME, Sidecar

#: Float dtypes as (bits of one value, mask of the exponent bits that are all ones exactly for
#: inf and NaN; e4m3fn has no inf: its NaN is the 7 bits below the sign all ones).
_NON_FINITE: dict[np.dtype[Any], tuple[Any, int]] = {
    BF16: (np.uint16, 0x7F80),
    F16: (np.uint16, 0x7C00),
    F32: (np.uint32, 0x7F800000),
    E4M3: (np.uint8, 0x7F),
}
_CHUNK = 64 << 20  # bytes scanned at a time


@dataclass
class SidecarInfo:
    """A sidecar's description; :meth:`to_dict` is the ``ple info --json`` payload."""

    path: str
    format: str
    num_rows: int
    width: int
    num_shards: int
    rows_per_shard: int
    bytes_per_row: int
    size_bytes: int
    has_meta: bool
    checksums: str  # "ok" | "N mismatched" | "not recorded (...)" | "not checked (--no-verify)"
    values: str  # "ok" | "N tensor(s) with inf/NaN" | "not checked (--no-verify)"
    problems: list[str]
    rel_rmse: float | None
    resident_bytes: int
    host_available_bytes: int
    resident_fits: bool
    geometry: dict[str, Any] | None
    memory: HostMemory = field(repr=False)
    #: A slice's rows (``[[start, end], ...]``, ``flashnext ple slice``); None: the whole table.
    rows_present: list[list[int]] | None = None
    #: :func:`flashnext.store.row_error.summarize` of the shards' records against the
    #: ``--max-row-error`` the table was made with; None when no shard measured it.
    row_error: dict[str, Any] | None = None
    #: Source shards whose own checksums did not match, taken with --ignore-source-checksums.
    source_checksums_ignored: list[Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        out.pop("memory")
        return out


def checksum_bytes(sidecar: Sidecar) -> int:
    """Bytes :func:`inspect_sidecar` hashes when verifying (shards with a recorded sha256)."""
    expected = sidecar.expected_checksums()
    return sum(s.path.stat().st_size for s in sidecar.shards if s.index in expected)


def value_bytes(sidecar: Sidecar) -> int:
    """Bytes :func:`scan_values` reads: every per-row floating-point tensor of every shard."""
    return sum(
        e.nbytes for s in sidecar.shards for e in s.tensors.values() if e.dtype in _NON_FINITE
    )


def scan_values(sidecar: Sidecar, progress: Callable[[int], None] | None = None) -> list[str]:
    """One problem line per shard tensor holding inf or NaN (bf16/fp8 weights, fp16/fp32/e4m3
    scales; integer codes cannot hold one), naming the count and the first row: such a row
    dequantizes to inf or NaN and poisons every activation that reads it. The writer refuses
    non-finite input, so only a damaged file or another tool's bug leaves one."""
    problems = []
    for shard in sidecar.shards:
        for entry in shard.tensors.values():
            if entry.dtype not in _NON_FINITE or entry.nbytes == 0:
                continue
            bits, mask = _NON_FINITE[entry.dtype]
            count, first = 0, -1
            per_row = entry.nbytes // (entry.shape[0] if entry.shape else 1)  # whole values
            data = np.memmap(shard.path, np.uint8, "r", entry.offset, (entry.nbytes,))
            step = max(per_row, _CHUNK // per_row * per_row)
            masked = np.empty(step // np.dtype(bits).itemsize, bits)  # no allocation per chunk
            hit = np.empty(masked.size, bool)
            for start in range(0, entry.nbytes, step):
                words = np.asarray(data[start : start + step]).view(bits)
                n = words.size
                np.bitwise_and(words, bits(mask), out=masked[:n])
                bad = int(np.count_nonzero(np.equal(masked[:n], mask, out=hit[:n])))
                if bad and first < 0:
                    at = int(np.argmax(hit[:n])) * words.itemsize
                    first = shard.row_start + (start + at) // per_row
                count += bad
                if progress is not None:
                    progress(words.nbytes)
            del data
            if count:
                problems.append(
                    f"{shard.path.name}: {entry.name} holds {count:,} inf/NaN value"
                    f"{'s' if count > 1 else ''} (first in "
                    f"row {first:,}); the rows that read them dequantize to inf/NaN: re-create "
                    "this shard from its source"
                )
    return problems


def inspect_sidecar(
    sidecar: Sidecar,
    *,
    verify: bool = True,
    progress: Callable[[int], None] | None = None,
    memory: HostMemory | None = None,
) -> SidecarInfo:
    """Describe ``sidecar``; with ``verify`` re-hash its shards against META.json and scan
    their floating-point values (:func:`scan_values`).

    ``progress(nbytes)`` is called while hashing and scanning; ``memory`` defaults to this
    host's.
    """
    checks, values, problems = _verify(sidecar, verify, progress)
    memory = memory or host_memory()
    bytes_per_row = sidecar.codec.bytes_per_row(sidecar.width)
    present = sidecar.rows_present or ((0, sidecar.num_rows),)
    resident = sum(hi - lo for lo, hi in present) * bytes_per_row  # a slice: its rows only
    quant = sidecar.meta.get("quantization")
    rmse = quant.get("rel_rmse") if isinstance(quant, dict) else None
    rows_err = _row_error(sidecar.meta, quant)
    if rows_err is not None and not rows_err["ok"]:
        problems.append(_row_error_problem(rows_err))
    source = sidecar.meta.get("source")
    ignored = source.get("checksum_mismatch_accepted") if isinstance(source, dict) else None
    geometry = sidecar.geometry
    return SidecarInfo(
        path=str(sidecar.path),
        format=sidecar.format,
        num_rows=sidecar.num_rows,
        width=sidecar.width,
        num_shards=len(sidecar.shards),
        rows_per_shard=sidecar.rows_per_shard,
        bytes_per_row=bytes_per_row,
        size_bytes=sidecar.nbytes,
        has_meta=(sidecar.path / META_NAME).exists(),
        checksums=checks,
        values=values,
        problems=problems,
        rel_rmse=rmse if isinstance(rmse, (int, float)) else None,
        resident_bytes=resident,
        host_available_bytes=memory.available,
        resident_fits=resident + DEFAULT_HEADROOM <= memory.available,
        geometry=geometry.to_dict() if geometry is not None else None,
        memory=memory,
        rows_present=[list(r) for r in sidecar.rows_present] if sidecar.rows_present else None,
        row_error=rows_err,
        source_checksums_ignored=list(ignored) if isinstance(ignored, list) and ignored else None,
    )


def _verify(
    sidecar: Sidecar, verify: bool, progress: Callable[[int], None] | None
) -> tuple[str, str, list[str]]:
    """The checksum and value statuses and their problem lines (nothing read without
    ``verify``)."""
    expected = sidecar.expected_checksums()
    mismatched = sidecar.verify_checksums(progress) if verify and expected else []
    bad_values = scan_values(sidecar, progress) if verify else []
    if not expected:
        checks = "not recorded (no META.json checksums)"
    elif not verify:
        checks = "not checked (--no-verify)"
    else:
        checks = "ok" if not mismatched else f"{len(mismatched)} mismatched"
    n_bad = len(bad_values)
    values = f"{n_bad} tensor{'s' if n_bad > 1 else ''} with inf/NaN" if bad_values else "ok"
    if not verify:
        values = "not checked (--no-verify)"
    return checks, values, mismatched + bad_values


def _row_error_problem(rows_err: dict[str, Any]) -> str:
    zeroed = rows_err["zeroed_rows"]
    return (
        f"row {rows_err['worst_row']:,} has relative error {rows_err['worst']:.3g}, above "
        f"the --max-row-error {rows_err['max_row_error']:g} this table was made with"
        + (f"; {zeroed:,} rows quantized to all-zero from non-zero rows" if zeroed else "")
        + ": it does not hold the source's rows (re-create it in another format)"
    )


def _row_error(meta: dict[str, Any], quant: Any) -> dict[str, Any] | None:
    """The table's per-row error from META.json's shard records (None: none measured)."""
    shards = meta.get("shards")
    records = [r.get("row_error") for r in shards if isinstance(r, dict)] if isinstance(
        shards, list) else []  # fmt: skip
    limit = quant.get("max_row_error") if isinstance(quant, dict) else None
    if not isinstance(limit, (int, float)) or isinstance(limit, bool):
        limit = row_error.DEFAULT_MAX_ROW_ERROR
    found = row_error.summarize(records, float(limit))
    return found if found["measured_shards"] else None

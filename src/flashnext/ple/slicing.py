"""Per-rank sidecars: copy the shard files that hold some tensor-parallel ranks' rows.

Under tensor parallelism rank ``r`` of ``tp`` serves rows ``[r * P, (r + 1) * P)``,
``P = num_rows / tp`` (vLLM splits the padded table contiguously). A node needs only its ranks'
rows: :func:`slice_sidecar` copies, byte for byte, the whole shard files overlapping them,
checks each copy's sha256 against the source's META.json, and writes a META.json that says
which rows are present (``rows_present``, on shard bounds). ``open_table(row_range=...)`` serves
a rank from it when the rank's rows lie inside; otherwise it refuses naming the missing rows.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from flashnext.atomic import write_json
from flashnext.errors import SidecarError
from flashnext.ple.destination import destination_problem
from flashnext.ple.sidecar import META_NAME, Sidecar, open_sidecar
from flashnext.safetensors_file import sha256_file


def rank_rows(num_rows: int, tp: int, rank: int) -> tuple[int, int]:
    """Rows ``[start, end)`` rank ``rank`` of ``tp`` serves.

    Raises:
        SidecarError: ``tp`` does not divide ``num_rows`` or ``rank`` is not in ``[0, tp)``.
    """
    if tp < 1 or num_rows % tp:
        raise SidecarError(
            f"--tp {tp}: the table's {num_rows} rows do not split into {tp} equal rank ranges"
        )
    if not 0 <= rank < tp:
        raise SidecarError(f"--ranks: rank {rank} is not in [0, {tp}) for --tp {tp}")
    part = num_rows // tp
    return rank * part, (rank + 1) * part


def slice_rows(num_rows: int, tp: int, ranks: list[int]) -> tuple[int, int]:
    """The rows ``[start, end)`` of ``ranks`` together (they must be consecutive).

    Raises:
        SidecarError: no ranks, a bad rank, or ranks with a gap (slice those separately).
    """
    if not ranks:
        raise SidecarError("--ranks: give at least one rank")
    ordered = sorted(set(ranks))
    if ordered != list(range(ordered[0], ordered[-1] + 1)):
        raise SidecarError(
            f"--ranks {','.join(map(str, ranks))}: not consecutive; a slice holds one contiguous "
            "row range: slice each run of ranks into its own directory"
        )
    return rank_rows(num_rows, tp, ordered[0])[0], rank_rows(num_rows, tp, ordered[-1])[1]


def _check_destination(src: Path, dst: Path) -> None:
    """The shared destination rule, and a slice is always written into a new directory."""
    problem = destination_problem(dst, [src])
    if problem:
        raise SidecarError(problem)
    if dst.exists():
        raise SidecarError(f"{dst}: already exists; slice into a new directory")


def slice_sidecar(src: str | os.PathLike[str], dst: str | os.PathLike[str], tp: int,
                  ranks: list[int]) -> Sidecar:  # fmt: skip
    """Copy the shards of ``src`` holding ``ranks``' rows (of ``tp``) into a new ``dst``.

    Written under a temporary name beside ``dst`` and renamed when complete and verified.

    Raises:
        SidecarError: a bad ``tp``/``ranks``, rows the source does not hold, a destination that
            exists or overlaps the source, or a copy whose sha256 differs from the source's.
    """
    source = open_sidecar(src)
    start, end = slice_rows(source.num_rows, tp, ranks)
    lo, hi = source.rows_present
    if not (lo <= start and end <= hi):
        raise SidecarError(
            f"{source.path}: holds rows {lo}..{hi}, the ranks need {start}..{end}; slice the "
            "full sidecar"
        )
    dst = Path(dst)
    _check_destination(source.path, dst)
    shards = [s for s in source.shards if s.row_start < end and s.row_start + s.rows > start]
    checksums = source.expected_checksums()
    work = dst.with_name(f".{dst.name}.slice-partial")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        records = []
        for shard in shards:
            copy = work / shard.path.name
            shutil.copyfile(shard.path, copy)
            digest = sha256_file(copy)
            want = checksums.get(shard.index) or sha256_file(shard.path)
            if digest != want:
                raise SidecarError(
                    f"{shard.path}: the copy's sha256 {digest[:16]}... differs from "
                    f"{want[:16]}... recorded for it; the source changed or is damaged"
                )
            records.append({"file": shard.path.name, "rows": shard.rows, "sha256": digest})
        present = [shards[0].row_start, shards[-1].row_start + shards[-1].rows]
        write_json(work / META_NAME, _meta(source, records, present, tp, ranks, (start, end)))
        work.rename(dst)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return open_sidecar(dst)


def _meta(source: Sidecar, records: list[dict], present: list[int], tp: int, ranks: list[int],
          rows: tuple[int, int]) -> dict[str, Any]:  # fmt: skip
    meta = dict(source.meta)
    meta.update({
        "format": source.format, "width": source.width, "num_rows": source.num_rows,
        "rows_per_shard": source.rows_per_shard,
        "num_shards": -(-source.num_rows // source.rows_per_shard),
        "shards": records, "rows_present": present,
        "sliced_for": {"tp": tp, "ranks": sorted(set(ranks)), "rows": list(rows)},
    })  # fmt: skip
    meta.setdefault("format_version", 1)
    return meta

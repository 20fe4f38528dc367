"""Slices of a sidecar: the shard files some tensor-parallel ranks read, copied byte for byte.

Under tensor parallelism rank ``r`` of ``tp`` serves rows ``[r*P, (r+1)*P)``, ``P = num_rows /
tp`` (vLLM's contiguous split), so a node needs only the shards overlapping its ranks' rows.
:func:`plan_slice` says which; :func:`write_slice` copies them, checks each copy's sha256
against the source's META.json (where it records one), copies the profile (beside
or inside the sidecar) into the slice as ``profile.safetensors``, and writes META.json last with
``rows_present`` (the sidecar spec in
:mod:`flashnext.ple.sidecar`). Every file is written under a temporary name and renamed when
complete. A slice opens like any sidecar; :func:`flashnext.ple.table.open_table` serves a
``row_range`` inside the rows present and refuses one outside, naming the missing rows.

An interrupted slice resumes: the writers' state record (:data:`~flashnext.ple.sidecar.
STATE_NAME`, so readers refuse the directory as unfinished and name the command) is written
first with the plan and each copied shard's sha256; the same command again keeps the shards
whose files still hash to it (:func:`slice_owns` tells the destination rule which files are
this slice's own).

The destination rule (not an input, not inside one, no file replaced that this command did
not write) is the caller's: :func:`flashnext.ple.destination.destination_problem`.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flashnext import __version__
from flashnext.atomic import atomic_write, write_json
from flashnext.errors import SidecarError
from flashnext.ple.destination import DestinationLock
from flashnext.ple.profile import PROFILE_NAME, profile_files
from flashnext.ple.sidecar import (
    FORMAT_VERSION,
    META_NAME,
    STATE_NAME,
    Shard,
    Sidecar,
    read_state,
    shard_name,
    write_state,
)
from flashnext.safetensors_file import sha256_file

_CHUNK = 8 << 20  # bytes per read while copying


def rank_rows(num_rows: int, tp: int, rank: int) -> tuple[int, int]:
    """Rows ``[start, end)`` tensor-parallel ``rank`` of ``tp`` serves (vLLM's even split).

    Raises:
        SidecarError: ``rank`` is not in the group, or the rows do not split evenly.
    """
    if tp <= 0 or not 0 <= rank < tp:
        raise SidecarError(f"--ranks {rank}: not a rank of a tensor-parallel group of {tp}")
    if num_rows % tp:
        raise SidecarError(f"--tp {tp}: the table's {num_rows} rows do not split evenly")
    per = num_rows // tp
    return rank * per, (rank + 1) * per


@dataclass(frozen=True)
class SlicePlan:
    """What a slice holds: the ranks' rows, the shards that hold them, the rows present."""

    tp: int
    ranks: tuple[int, ...]
    rank_rows: tuple[tuple[int, int], ...]
    shards: tuple[Shard, ...]
    rows_present: tuple[tuple[int, int], ...]

    @property
    def nbytes(self) -> int:
        """Bytes of the shard files to copy."""
        return sum(sh.path.stat().st_size for sh in self.shards)


def plan_slice(sidecar: Sidecar, tp: int, ranks: Sequence[int]) -> SlicePlan:
    """The shards of ``sidecar`` that ranks ``ranks`` of ``tp`` read.

    Raises:
        SidecarError: a rank outside the group, rows that do not split evenly, or (slicing a
            slice) ranks whose rows the source does not hold.
    """
    wanted = tuple(sorted(set(ranks)))
    spans = tuple(rank_rows(sidecar.num_rows, tp, r) for r in wanted)
    for r, (lo, hi) in zip(wanted, spans, strict=True):
        missing = sidecar.missing_rows(lo, hi)
        if missing:
            raise SidecarError(
                f"{sidecar.path}: rank {r} of {tp} serves rows {lo}..{hi}, but this slice holds "
                f"only rows {sidecar.present_text()}: slice the full sidecar"
            )
    shards = tuple(
        sh
        for sh in sidecar.shards
        if any(sh.row_start < hi and lo < sh.row_start + sh.rows for lo, hi in spans)
    )
    present: list[tuple[int, int]] = []
    for sh in shards:
        if present and present[-1][1] == sh.row_start:
            present[-1] = (present[-1][0], sh.row_start + sh.rows)
        else:
            present.append((sh.row_start, sh.row_start + sh.rows))
    return SlicePlan(tp, wanted, spans, shards, tuple(present))


def slice_file_names(plan: SlicePlan, sidecar: Sidecar) -> list[str]:
    """Every name :func:`write_slice` writes in the destination (for the destination rule)."""
    names = [shard_name(sh.index) for sh in plan.shards] + [META_NAME]
    return names + ([PROFILE_NAME] if source_profile(sidecar) else [])


def source_profile(sidecar: Sidecar) -> Path | None:
    """The sidecar's profile: beside it (``ple profile``'s default) or inside it."""
    return next((p for p in profile_files(sidecar.path) if p.is_file()), None)


def write_slice(
    sidecar: Sidecar,
    dst: str | os.PathLike[str],
    plan: SlicePlan,
    progress: Callable[[int], None] | None = None,
) -> Path:
    """Copy ``plan``'s shards (and the profile) into ``dst``, then write META.json.

    Args:
        sidecar: the source (a whole sidecar or a slice holding the ranks' rows).
        dst: the destination directory (created; the caller has applied the destination rule;
            this takes its lock for the whole copy).
        plan: :func:`plan_slice`'s answer for ``sidecar``.
        progress: called with the bytes copied since the last call.

    Raises:
        SidecarError: another process is writing ``dst``; a copy's sha256 differs from the one the source's META.json records
            (the copy is removed; the source changed after it was written).
        OSError: a file cannot be read or written (naming it).
    """
    out = Path(dst)
    with DestinationLock(out):  # a second writer is refused, naming this one
        out.mkdir(parents=True, exist_ok=True)
        expected = sidecar.expected_checksums()
        params = slice_params(sidecar, plan)
        done = _resumable(out, params)
        records: dict[int, dict[str, Any]] = {}
        write_state(out, len(plan.shards), params, records)  # unfinished from here on
        for sh in plan.shards:
            name = shard_name(sh.index)
            kept = done.get(sh.index)
            if kept is not None and (out / name).is_file() and sha256_file(out / name) == kept:
                digest = kept  # an interrupted run's copy, still whole
                if progress is not None:
                    progress(sh.path.stat().st_size)
            else:
                digest = copy_checked(sh.path, out / name, expected.get(sh.index), progress)
            records[sh.index] = {"file": name, "rows": sh.rows, "sha256": digest}
            write_state(out, len(plan.shards), params, records)
        profile = source_profile(sidecar)
        if profile is not None:  # inside the slice: the destination holds everything it writes
            copy_checked(profile, out / PROFILE_NAME, None, progress)
        write_json(out / META_NAME, slice_meta(sidecar, plan, list(records.values())))
        (out / STATE_NAME).unlink()  # finished
    return out


def slice_params(sidecar: Sidecar, plan: SlicePlan) -> dict[str, Any]:
    """What makes two slice runs the same run (the state record's ``params``)."""
    return {"slice": {"source": str(sidecar.path.resolve()), "tp": plan.tp,
                      "ranks": list(plan.ranks)}}  # fmt: skip


def slice_owns(dst: Path, params: dict[str, Any]) -> bool:
    """Whether ``dst`` is an unfinished slice of the same run (its files may be replaced)."""
    try:
        state = read_state(dst)
    except SidecarError:
        return False
    return state is not None and state.get("params") == params


def _resumable(out: Path, params: dict[str, Any]) -> dict[int, str]:
    """Shard index -> sha256 of the copies an interrupted run of the same slice recorded."""
    try:
        state = read_state(out)
    except SidecarError:
        return {}
    if state is None or state.get("params") != params:
        return {}
    shards = state.get("shards")
    return {
        int(k): v["sha256"]
        for k, v in (shards.items() if isinstance(shards, dict) else ())
        if isinstance(v, dict) and isinstance(v.get("sha256"), str)
    }


def copy_checked(
    src: Path, dst: Path, sha256: str | None, progress: Callable[[int], None] | None = None
) -> str:
    """Copy ``src`` to ``dst`` byte for byte (atomically), hashing what was read; refuse (and
    leave no ``dst``) when ``sha256`` is given and differs. Returns the hex digest."""
    h = hashlib.sha256()
    with open(src, "rb") as fin, atomic_write(dst) as fout:
        while chunk := fin.read(_CHUNK):
            h.update(chunk)
            fout.write(chunk)
            if progress is not None:
                progress(len(chunk))
        digest = h.hexdigest()
        if sha256 is not None and digest != sha256:
            raise SidecarError(
                f"{src}: sha256 {digest[:16]}..., expected {sha256[:16]}... from its "
                f"{META_NAME}; the file changed after it was written: re-create it (nothing "
                f"was written to {dst})"
            )
    return digest


def slice_meta(sidecar: Sidecar, plan: SlicePlan, records: list[dict[str, Any]]) -> dict[str, Any]:
    """The slice's META.json: the source's, with the shards present and ``rows_present``."""
    num_shards = -(-sidecar.num_rows // sidecar.rows_per_shard)
    return {
        **sidecar.meta,
        "format_version": FORMAT_VERSION,
        "format": sidecar.format,
        "width": sidecar.width,
        "rows_per_shard": sidecar.rows_per_shard,
        "num_rows": sidecar.num_rows,
        "num_shards": num_shards,
        "shards": records,
        "rows_present": [list(r) for r in plan.rows_present],
        "slice": {"tp": plan.tp, "ranks": list(plan.ranks), "source": str(sidecar.path.resolve())},
        "flashnext_version": __version__,
    }

"""Slices of a sidecar: the shard files some tensor-parallel ranks read, copied byte for byte.

Under tensor parallelism rank ``r`` of ``tp`` serves rows ``[r*P, (r+1)*P)``, ``P = num_rows /
tp`` (vLLM's contiguous split), so a node needs only the shards overlapping its ranks' rows.
:func:`plan_slice` says which; :func:`write_slice` copies them, checks each copy's sha256
against the source's META.json (where it records one), copies the profile (beside
or inside the sidecar) into the slice as ``profile.safetensors``, and writes META.json last with
``rows_present`` (the sidecar spec in
:mod:`flashnext.store.sidecar`). Every file is written under a temporary name and renamed when
complete. A slice opens like any sidecar; :func:`flashnext.host.table.open_table` serves a
``row_range`` inside the rows present and refuses one outside, naming the missing rows.

The destination's life is every sidecar writer's (:class:`~flashnext.store.destination.
SidecarDestination`, which takes the lock): the state record (:data:`~flashnext.store.sidecar.
STATE_NAME`, so readers refuse the directory as unfinished and name the command) is written
first with the plan and each copied shard's sha256; the same command again keeps the shards
whose files still hash to it; anything else is refused, or replaced with ``force``.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from flashnext import __version__
from flashnext.atomic import atomic_write, write_json
from flashnext.errors import SidecarError
from flashnext.store.destination import SidecarDestination
from flashnext.store.profile import PROFILE_NAME, profile_files
from flashnext.store.sidecar import (
    FORMAT_VERSION,
    META_NAME,
    STATE_NAME,
    Shard,
    Sidecar,
    open_sidecar,
    shard_index,
    shard_name,
    write_state,
)

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


def source_profile(sidecar: Sidecar) -> Path | None:
    """The sidecar's profile: beside it (``ple profile``'s default) or inside it."""
    return next((p for p in profile_files(sidecar.path) if p.is_file()), None)


class SliceWriter:
    """Writes one slice for :class:`~flashnext.store.destination.SidecarDestination`: the
    shard copies (:meth:`copy`), then, in :meth:`finish`, the profile and META.json.

    Its ``params`` are what the slice's META.json says of it (the source table's settings and
    source, and ``slice``: source path, tp, ranks), so the destination knows its own finished
    slice as well as an unfinished one (the state record holds the same params).
    """

    extra_names: ClassVar[tuple[str, ...]] = (PROFILE_NAME,)

    def __init__(self, sidecar: Sidecar, plan: SlicePlan) -> None:
        self.sidecar = sidecar
        self.plan = plan
        self.path = sidecar.path  # the destination points it at its work directory
        self.num_shards = -(-sidecar.num_rows // sidecar.rows_per_shard)
        self.records: dict[int, dict[str, Any]] = {}
        self._by_index = {sh.index: sh for sh in plan.shards}

    @property
    def indices(self) -> Sequence[int]:
        return [sh.index for sh in self.plan.shards]

    @property
    def params(self) -> dict[str, Any]:
        meta = self.sidecar.meta
        return {"settings": meta.get("settings"), "source": meta.get("source"),
                "slice": _slice_record(self.sidecar, self.plan)}  # fmt: skip

    def start(self, kept: Mapping[int, Mapping[str, Any]] | None = None) -> None:
        """Mark the directory unfinished (creating it), counting ``kept`` copies as done."""
        self.path.mkdir(parents=True, exist_ok=True)
        self.records = {int(i): dict(r) for i, r in (kept or {}).items()}
        self._save_state()
        (self.path / META_NAME).unlink(missing_ok=True)

    def _save_state(self) -> None:
        write_state(self.path, len(self.plan.shards), self.params, self.records)

    def adopt(self, record: Mapping[str, Any]) -> None:
        index = shard_index(str(record.get("file", "")))
        if index is None:
            raise SidecarError(f"{self.path}: record {record!r} names no shard file")
        self.records[index] = dict(record)
        self._save_state()

    def copy(self, index: int, progress: Callable[[int], None] | None = None) -> None:
        """Copy source shard ``index``, checked against the source's recorded sha256."""
        sh = self._by_index[index]
        name = shard_name(index)
        expected = self.sidecar.expected_checksums().get(index)
        digest = copy_checked(sh.path, self.path / name, expected, progress)
        self.adopt({"file": name, "rows": sh.rows, "sha256": digest})

    def finish(self, quantization: Mapping[str, Any] | None = None) -> Sidecar:
        """The profile (inside the slice: the destination holds all it writes), META.json,
        then the state record goes: finished."""
        missing = [i for i in self.indices if i not in self.records]
        if missing:
            raise SidecarError(f"{self.path}: cannot finish, shards {missing[:8]} not copied")
        profile = source_profile(self.sidecar)
        if profile is not None:
            copy_checked(profile, self.path / PROFILE_NAME, None)
        records = [self.records[i] for i in self.indices]
        write_json(self.path / META_NAME, slice_meta(self.sidecar, self.plan, records))
        (self.path / STATE_NAME).unlink()
        return open_sidecar(self.path)


def write_slice(
    sidecar: Sidecar,
    dst: str | os.PathLike[str],
    plan: SlicePlan,
    progress: Callable[[int], None] | None = None,
    *,
    force: bool = False,
) -> Path:
    """Copy ``plan``'s shards (and the profile) into ``dst``, then write META.json.

    ``dst``'s life is :class:`~flashnext.store.destination.SidecarDestination`'s, as for every
    sidecar writer: its lock for the whole copy, an interrupted slice of the same source and
    ranks resumed (copies that still hash to their recorded sha256 are kept), the same slice
    already finished left as it is, anything else refused, or with ``force`` replaced by a
    slice written beside it and swapped in once complete.

    Args:
        sidecar: the source (a whole sidecar or a slice holding the ranks' rows).
        dst: the destination directory (created).
        plan: :func:`plan_slice`'s answer for ``sidecar``.
        progress: called with the bytes copied (or kept) since the last call.
        force: replace a ``dst`` that holds anything else.

    Raises:
        SidecarError: another process is writing ``dst``; ``dst`` holds anything else (without
            ``force``); a copy's sha256 differs from the one the source's META.json records
            (the copy is removed; the source changed after it was written).
        OSError: a file cannot be read or written (naming it).
    """
    writer = SliceWriter(sidecar, plan)
    with SidecarDestination(dst, writer, force=force, inputs=[sidecar.path]) as dest:
        if not dest.finished:  # else: this very slice is there already
            dest.start()
            if progress is not None:  # kept copies count as copied: the bar ends full
                progress(sum(sh.path.stat().st_size for sh in plan.shards if sh.index in dest.kept))
            for index in dest.todo:
                writer.copy(index, progress)
        elif progress is not None:
            progress(plan.nbytes)
        return dest.commit().path


def _slice_record(sidecar: Sidecar, plan: SlicePlan) -> dict[str, Any]:
    """META.json's ``slice``: what makes two slices the same slice."""
    return {"tp": plan.tp, "ranks": list(plan.ranks), "source": str(sidecar.path.resolve())}


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
        "slice": _slice_record(sidecar, plan),
        "flashnext_version": __version__,
    }

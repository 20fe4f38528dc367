"""What to download: a checkpoint's files from its index, with the PLE table shards set apart.

The released Flash-Next checkpoints are 186 GB, 102 GB of it PLE table shards that a sidecar
replaces. From ``model.safetensors.index.json`` alone (no hub access) this lists every file,
which of them hold only PLE table tensors (skippable when a sidecar serves the table), which mix
table and other tensors (never skippable), and the ``hf download`` command that skips the
former. Sizes come from the files where they are on disk; the index only knows the total.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from flashnext.errors import CheckpointError, FlashnextError, SidecarError
from flashnext.user_files import JSON_LIMIT, UserFileError, read_user_text

INDEX_NAME = "model.safetensors.index.json"
#: Tensors of a PLE table (any layout) and its geometry buffers: a sidecar replaces them all.
_PLE_TENSOR = re.compile(
    r"(^|\.)ple\.ple_embedding\.(ngram_embedding\.|layer_multipliers$|ngram_heads_)"
)
Role = Literal["ple-only", "mixed", "weights"]


@dataclass(frozen=True)
class PlannedFile:
    """One weight file named by the index."""

    name: str
    tensors: int
    ple_tensors: int
    size: int | None  # bytes on disk, None when not downloaded yet

    @property
    def role(self) -> Role:
        if self.ple_tensors == 0:
            return "weights"
        return "ple-only" if self.ple_tensors == self.tensors else "mixed"


@dataclass
class DownloadPlan:
    """Files of a checkpoint and what a sidecar lets you skip."""

    index: Path
    repo_id: str | None
    total_size: int | None  # from the index's metadata
    files: list[PlannedFile]
    notes: list[str] = field(default_factory=list)

    @property
    def skippable(self) -> list[PlannedFile]:
        return [f for f in self.files if f.role == "ple-only"]

    @property
    def mixed(self) -> list[PlannedFile]:
        return [f for f in self.files if f.role == "mixed"]

    def hf_download_command(self, local_dir: str | None = None) -> list[str]:
        """``hf download`` argv fetching everything but the PLE-only shard files."""
        cmd = ["hf", "download", self.repo_id or "<org>/<model>"]
        if self.skippable:
            cmd += ["--exclude", *(f.name for f in self.skippable)]
        if local_dir:
            cmd += ["--local-dir", local_dir]
        return cmd


def _repo_id_from_cache(path: Path) -> str | None:
    """``org/name`` when ``path`` sits in a hub cache (``models--org--name/snapshots/rev``)."""
    for part in (path, *path.parents):
        if part.name.startswith("models--"):
            return part.name[len("models--") :].replace("--", "/", 1)
    return None


def _read_index(index: Path) -> tuple[dict[str, str], int | None]:
    try:
        data = json.loads(
            read_user_text(index, "the index (model.safetensors.index.json)", JSON_LIMIT)
        )
    except OSError as exc:
        raise CheckpointError(f"{index}: cannot read ({exc.strerror})") from None
    except (json.JSONDecodeError, RecursionError) as exc:
        raise CheckpointError(f"{index}: not valid JSON ({exc})") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index}: no 'weight_map' object naming tensor -> file")
    bad = [k for k, v in weight_map.items() if not isinstance(v, str) or "/" in v or v == ".."]
    if bad:
        raise CheckpointError(
            f"{index}: weight_map entry {bad[0]!r} -> {weight_map[bad[0]]!r} is not a plain "
            "file name in the snapshot"
        )
    meta = data.get("metadata") if isinstance(data.get("metadata"), dict) else {}
    total = meta.get("total_size")
    return weight_map, int(total) if isinstance(total, (int, float)) else None


def plan_download(index_or_dir: str | os.PathLike[str], repo_id: str | None = None) -> DownloadPlan:
    """Plan a download from an index file or a (partial) snapshot directory holding one.

    Raises:
        CheckpointError: no index there, or the index is unreadable or malformed (the message
            names the file and the entry).
    """
    path = Path(index_or_dir)
    index = path / INDEX_NAME if path.is_dir() else path
    if index.exists() and not index.is_file():  # a FIFO, device or socket: the opener says so
        _read_index(index)
    if not index.is_file():
        raise CheckpointError(
            f"{index}: not found (expected {INDEX_NAME} or a directory holding it)"
        )
    weight_map, total = _read_index(index)
    counts: dict[str, list[int]] = {}
    for tensor, fname in weight_map.items():
        c = counts.setdefault(fname, [0, 0])
        c[0] += 1
        c[1] += bool(_PLE_TENSOR.search(tensor))
    files = []
    for fname in sorted(counts):
        on_disk = index.parent / fname
        size = on_disk.stat().st_size if on_disk.is_file() else None
        files.append(PlannedFile(fname, counts[fname][0], counts[fname][1], size))
    plan = DownloadPlan(index, repo_id or _repo_id_from_cache(index.parent), total, files)
    if plan.mixed:
        plan.notes.append(
            f"{len(plan.mixed)} file(s) hold PLE table tensors together with other weights "
            f"(e.g. {plan.mixed[0].name}): they must be downloaded even with a sidecar"
        )
    if not any(f.ple_tensors for f in files):
        plan.notes.append("the index names no PLE table tensors: nothing for a sidecar to replace")
    if plan.repo_id is None:
        plan.notes.append("repository id unknown (not a hub cache path): pass --repo ORG/NAME")
    return plan


@dataclass(frozen=True)
class SidecarCover:
    """What one sidecar directory replaces: its format, rows and the table it must match."""

    path: Path
    format: str
    rows: int
    expected_rows: int | None  # from config.json's geometry, when the config is there
    ok: bool
    message: str


#: The plugin's own check of a sidecar against a layer: (sidecar, layer name, rows, width,
#: the model's geometry) -> None, raising a FlashnextError when the plugin would refuse it.
GeometryCheck = Callable[[Any, str, int, int, Any], None]


def check_sidecar(
    plan: DownloadPlan,
    sidecar_dir: str | os.PathLike[str],
    geometry_check: GeometryCheck | None = None,
) -> SidecarCover:
    """Does ``sidecar_dir`` fit the checkpoint's PLE table (geometry from config.json)?

    ``geometry_check`` is the serving policy's check (``flashnext.serve.serving``, passed in:
    kernels sit above this module); it compares the whole geometry (rows, width, head sizes, offsets, multipliers)
    of the layer the sidecar's META.json names. Without it, only the row count is compared.

    Raises:
        SidecarError: ``sidecar_dir`` is not a readable sidecar (from :func:`open_sidecar`).
    """
    from flashnext.ple.geometry import PLEGeometry
    from flashnext.ple.sidecar import open_sidecar

    sidecar = open_sidecar(sidecar_dir)
    config_path = plan.index.parent / "config.json"

    def cover(expected: int | None, ok: bool, message: str) -> SidecarCover:
        return SidecarCover(sidecar.path, sidecar.format, sidecar.num_rows, expected, ok, message)

    if not config_path.is_file():
        return cover(None, True, f"{sidecar.path}: {sidecar.format}, {sidecar.num_rows} rows; "
                     "no config.json beside the index to compare it with")  # fmt: skip
    ordinal = sidecar.geometry.layer_ordinal if sidecar.geometry is not None else 0
    try:
        config = json.loads(read_user_text(config_path, "config.json", JSON_LIMIT))
        model = PLEGeometry.from_config(config, layer_ordinal=ordinal)
    except (OSError, ValueError, UserFileError) as exc:
        return cover(None, False, f"{config_path}: cannot derive the table geometry ({exc})")
    layer = f"PLE layer ordinal {ordinal} of {config_path}"
    try:
        if geometry_check is not None:
            geometry_check(sidecar, layer, model.num_rows, model.width, model)
        elif model.num_rows != sidecar.num_rows:
            raise SidecarError(
                f"{sidecar.path}: {sidecar.num_rows} rows, but {config_path} describes "
                f"{model.num_rows} rows per PLE table: not this checkpoint's table"
            )
    except FlashnextError as exc:
        return cover(model.num_rows, False, str(exc))
    whole = geometry_check is not None and sidecar.geometry is not None
    what = "geometry" if whole else "row count (its META.json records no geometry)"
    return cover(model.num_rows, True, f"{sidecar.path}: {sidecar.format}, {sidecar.num_rows} "
                 f"rows; its {what} matches config.json ({layer}); replaces that layer's "
                 "table")  # fmt: skip

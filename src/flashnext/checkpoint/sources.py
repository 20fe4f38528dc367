"""Rows to quantize or serve, from whatever directory the user names.

Lives in :mod:`flashnext.checkpoint` rather than :mod:`flashnext.store` because it dispatches
to both checkpoints and sidecars, and a sidecar source reads its rows through the host table
(:mod:`flashnext.host`), which the quantizer, a writer below the table, cannot import.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from flashnext import hub_cache
from flashnext.checkpoint.ple_tensors import CheckpointTableSource
from flashnext.errors import CheckpointError, SidecarError
from flashnext.host.table import PLETable, open_table
from flashnext.ple.geometry import PLEGeometry
from flashnext.safetensors_file import sha256_file
from flashnext.store.quantize import RowSource
from flashnext.store.sidecar import META_NAME, Sidecar, open_sidecar


def is_checkpoint(path: str | os.PathLike[str]) -> bool:
    """A model directory (config.json) or a hub-cache repo folder (snapshots/)."""
    root = Path(path)
    return (root / "config.json").exists() or hub_cache.has_snapshots(root)


def open_row_source(
    path: str | os.PathLike[str],
    layer: int | None = None,
    *,
    ignore_checksums: bool = False,
    progress: Callable[[int], None] | None = None,
) -> RowSource:
    """Float32 rows of the PLE table at ``path``: a checkpoint (any layout and format, PLE
    layer ordinal ``layer``; a :class:`CheckpointRows`, which can also be copied losslessly)
    or a sidecar directory (any format).

    ``ignore_checksums`` and ``progress(nbytes)`` apply to sidecar sources, whose shards are
    hashed on opening (see :class:`SidecarSource`).

    Raises:
        CheckpointError: ``layer`` given for a sidecar, or as :func:`open_table_source`.
        SidecarError: as :class:`SidecarSource`.
    """
    if is_checkpoint(path):
        from flashnext.checkpoint.ple_tensors import open_table_source

        return CheckpointRows.of(open_table_source(path, layer))
    if layer not in (None, 0):
        raise CheckpointError(
            f"{path}: --layer {layer} applies to checkpoint sources only; this is a sidecar"
        )
    return SidecarSource(path, ignore_checksums=ignore_checksums, progress=progress)


class CheckpointRows(CheckpointTableSource):
    """A checkpoint table source that also reads its stored tensors (for a lossless copy).

    ``read_stored`` returns the tensors of the table's own format as the codec names them
    (:meth:`~flashnext.ple.formats.Codec.from_checkpoint`): fp8's global scale becomes every
    row's ``weight_scale``, nvfp4's becomes the ``weight_scale_2`` of every output shard.
    """

    @classmethod
    def of(cls, source: CheckpointTableSource) -> CheckpointRows:
        rows = cls.__new__(cls)
        rows.__dict__.update(source.__dict__)
        return rows

    def read_stored(self, start: int, end: int) -> dict[str, np.ndarray]:
        """Codec tensors of rows ``[start, end)``: per-row [end - start, ...], scalars 0-d.

        Raises:
            CheckpointError: as :meth:`read_rows`.
        """
        codec = self.info.codec
        parts = self._parts
        pieces: dict[int, dict[str, np.ndarray]] = {}
        for copy in self.info.row_map(start, end):
            part = parts[copy.tensor]
            arr = self._read(part, copy.src_offset, copy.rows)
            pieces.setdefault(copy.dst_offset, {})[part.kind] = arr
        stored = [codec.from_checkpoint(p, self.info.scalars) for _, p in sorted(pieces.items())]
        return {
            spec.name: np.concatenate([s[spec.name] for s in stored])
            if spec.per_row and len(stored) > 1
            else stored[0][spec.name]
            for spec in codec.specs
        }


class SidecarSource:
    """Rows of an existing sidecar (any format), dequantized to float32.

    Opening hashes every shard: the digests identify the source (resume notices a source
    regenerated at the same path), and shards whose recorded sha256 (META.json) differs are
    refused unless ``ignore_checksums``. ``progress(nbytes)`` is called while hashing.

    Raises:
        SidecarError: the sidecar is invalid, unfinished or a slice, or a shard fails its
            checksum.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        ignore_checksums: bool = False,
        progress: Callable[[int], None] | None = None,
    ):
        sidecar = open_sidecar(path)
        if sidecar.rows_present is not None:  # before a destination exists: nothing to resume
            raise SidecarError(
                f"{path}: a slice (rows {sidecar.present_text()} of {sidecar.num_rows}, "
                "`flashnext ple slice`): quantize the full sidecar, then slice the result"
            )
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

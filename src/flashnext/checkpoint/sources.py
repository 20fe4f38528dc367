"""Rows to quantize or serve, from whatever directory the user names.

Lives in :mod:`flashnext.checkpoint` rather than :mod:`flashnext.ple` because it dispatches to
both: ``ple`` knows sidecars only and imports nothing above it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

from flashnext.checkpoint.ple_tensors import CheckpointTableSource
from flashnext.errors import CheckpointError
from flashnext.ple.quantize import RowSource, SidecarSource


def is_checkpoint(path: str | os.PathLike[str]) -> bool:
    """A model directory (config.json) or a hub-cache repo folder (snapshots/)."""
    root = Path(path)
    return (root / "config.json").exists() or (root / "snapshots").is_dir()


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
    hashed on opening (see :class:`flashnext.ple.quantize.SidecarSource`).

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

"""Rows to quantize or serve, from whatever directory the user names.

Lives in :mod:`flashnext.checkpoint` rather than :mod:`flashnext.ple` because it dispatches to
both: ``ple`` knows sidecars only and imports nothing above it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

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
    layer ordinal ``layer``) or a sidecar directory (any format).

    ``ignore_checksums`` and ``progress(nbytes)`` apply to sidecar sources, whose shards are
    hashed on opening (see :class:`flashnext.ple.quantize.SidecarSource`).

    Raises:
        CheckpointError: ``layer`` given for a sidecar, or as :func:`open_table_source`.
        SidecarError: as :class:`SidecarSource`.
    """
    if is_checkpoint(path):
        from flashnext.checkpoint.ple_tensors import open_table_source

        return open_table_source(path, layer)
    if layer not in (None, 0):
        raise CheckpointError(
            f"{path}: --layer {layer} applies to checkpoint sources only; this is a sidecar"
        )
    return SidecarSource(path, ignore_checksums=ignore_checksums, progress=progress)

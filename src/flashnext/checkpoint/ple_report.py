"""What ``flashnext checkpoint ple`` reports: each PLE table found, the notes that apply to it,
and (for a tensor-parallel size) the rows each rank copies from which tensor.

Kept apart from :mod:`~flashnext.checkpoint.ple_tensors` (which finds and shape-checks the
tables) so that the command line only prints: every decision and every note is data here.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any

from flashnext.checkpoint.ple_tensors import PLETableInfo, RowCopy, find_ple_tables
from flashnext.records import CHECKPOINT_PLE

RECORD_KIND = CHECKPOINT_PLE
SCHEMA_VERSION = 1

#: What a user must know about a table layout, by layout name.
LAYOUT_NOTES: dict[str, str] = {
    "empty-shard": (
        "vLLM 0.33.0 rejects the empty shard index ('shard_.weight'); the flashnext loader "
        "accepts it after this shape check"
    ),
}


@dataclass
class TableReport:
    """One PLE table as reported: the table, its notes, and each TP rank's row copies.

    Attributes:
        table: the table as found (layout, format, shapes checked).
        notes: what a user must know about this table (one sentence each).
        tp_size: the tensor-parallel size the rank maps are for, or None.
        ranks: per rank ``r`` in ``[0, tp_size)``, the :class:`RowCopy` list it loads.
    """

    table: PLETableInfo
    notes: list[str] = field(default_factory=list)
    tp_size: int | None = None
    ranks: list[list[RowCopy]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the table's summary plus ``notes`` and, with a TP size, ``tp``."""
        doc = self.table.to_dict()
        doc["notes"] = list(self.notes)
        if self.tp_size is not None:
            doc["tp"] = {
                "size": self.tp_size,
                "ranks": [[asdict(c) for c in copies] for copies in self.ranks],
            }
        return doc


def report_ple_tables(
    path: str | os.PathLike[str], tp_size: int | None = None
) -> list[TableReport]:
    """Find every PLE table of the checkpoint at ``path`` and say what to know about each.

    Args:
        path: a snapshot directory (any layout :func:`resolve_snapshot` accepts).
        tp_size: also map each rank's rows for this tensor-parallel size.

    Raises:
        CheckpointError: see :func:`~flashnext.checkpoint.ple_tensors.find_ple_tables`; the rows
            do not split evenly over ``tp_size`` ranks.
        GeometryError: config.json's PLE fields are invalid (the message names the file).
    """
    out = []
    for table in find_ple_tables(path):
        notes = [LAYOUT_NOTES[table.layout]] if table.layout in LAYOUT_NOTES else []
        ranks = [table.tp_row_map(tp_size, r) for r in range(tp_size)] if tp_size else []
        out.append(TableReport(table, notes, tp_size, ranks))
    return out


def row_copy_text(copy: RowCopy) -> str:
    """``shard_3.weight[0:125] -> [0:125]``: one rank's copy, short tensor name."""
    short = ".".join(copy.tensor.rsplit(".", 2)[-2:])
    return (
        f"{short}[{copy.src_offset}:{copy.src_offset + copy.rows}] -> "
        f"[{copy.dst_offset}:{copy.dst_offset + copy.rows}]"
    )

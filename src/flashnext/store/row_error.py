"""Per-row quantization error: what a table-wide RMSE hides.

One huge value in a table of small ones can wipe out whole rows (nvfp4's per-shard scale puts
every small row below the smallest block scale) while the table's relative RMSE, dominated by
the huge value, stays tiny. So the quantizer also measures each row's relative error
``||dequant(q) - x|| / ||x||`` (rows that are zero in the source are skipped) and counts rows
quantized to all-zero while the source row is not (their error is 1).

A shard keeps ``{"worst", "worst_row", "zeroed_rows", "rows", "hist"}`` in its META.json record;
``hist`` counts rows per bin of ``floor(BINS_PER_DECADE * log10(error))`` (``[bin, count]``
pairs, exact errors of 0 in bin ``None``), so a whole table's percentile is merged from its
shards without keeping every row's error. A percentile read from the histogram is the upper
edge of its bin (at most ``10 ** (1 / BINS_PER_DECADE)`` = 2.3% above the exact value), capped
by the exact worst row.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

BINS_PER_DECADE = 100
#: Default refusal threshold of ``ple quantize``: a row whose relative error exceeds it is
#: not a quantization of the source any more (all-zero rows have error 1).
DEFAULT_MAX_ROW_ERROR = 0.5
PERCENTILE = 99.9


class RowErrors:
    """Accumulates the per-row error of one shard, block by block."""

    def __init__(self) -> None:
        self.worst = 0.0
        self.worst_row = -1
        self.zeroed = 0
        self.rows = 0
        self.hist: Counter[int | None] = Counter()

    def add(self, source: np.ndarray, restored: np.ndarray, first_row: int) -> None:
        """Count rows ``first_row ..`` of float32 ``source`` [n, w] against ``restored`` [n, w]."""
        x = np.asarray(source, dtype=np.float64)
        diff = np.asarray(restored, dtype=np.float64) - x
        sums = np.empty((len(x), 3))
        sums[:, 0] = np.einsum("ij,ij->i", diff, diff)
        sums[:, 1] = np.einsum("ij,ij->i", x, x)
        sums[:, 2] = np.asarray(restored).any(axis=1)
        self.add_sums(sums, first_row)

    def add_sums(self, sums: np.ndarray, first_row: int) -> None:
        """Count rows ``first_row ..`` from their float64 sums [n, 3]: squared error, squared
        source, and non-zero restored values (0 = the row was quantized to all-zero); what
        the compiled quantizer's ``row_sums`` holds, so no block is dequantized again."""
        err = np.sqrt(sums[:, 0])
        ref = np.sqrt(sums[:, 1])
        live = ref > 0
        rel = np.zeros(len(sums))
        rel[live] = err[live] / ref[live]
        self.zeroed += int((live & (sums[:, 2] == 0)).sum())
        self.rows += int(live.sum())
        if live.any():
            i = int(np.argmax(np.where(live, rel, -1.0)))
            if rel[i] > self.worst:
                self.worst, self.worst_row = float(rel[i]), first_row + i
        values = rel[live]
        exact = values == 0
        self.hist[None] += int(exact.sum())
        bins = np.floor(BINS_PER_DECADE * np.log10(values[~exact])).astype(np.int64)
        self.hist.update(Counter(bins.tolist()))

    def to_record(self) -> dict[str, Any]:
        """JSON-ready: the shard's META.json ``row_error`` field."""
        hist = sorted(((b, c) for b, c in self.hist.items() if c), key=_bin_order)
        return {
            "worst": self.worst,
            "worst_row": self.worst_row,
            "zeroed_rows": self.zeroed,
            "rows": self.rows,
            "hist": [[b, c] for b, c in hist],
        }


def exact() -> dict[str, Any]:
    """The record of a shard copied without loss (every row's error is 0)."""
    return RowErrors().to_record()


def _bin_order(item: tuple[int | None, int]) -> float:
    return -math.inf if item[0] is None else float(item[0])


def summarize(
    records: Iterable[Mapping[str, Any] | None], max_row_error: float = DEFAULT_MAX_ROW_ERROR
) -> dict[str, Any]:
    """The table's per-row error from its shards' ``row_error`` records.

    Returns ``{"worst", "worst_row", "p99_9", "zeroed_rows", "rows", "max_row_error", "ok",
    "measured_shards", "shards"}``; ``ok`` is False when the worst row's error exceeds
    ``max_row_error``. Shards written by versions that did not measure it are not counted
    (``measured_shards`` < ``shards``).
    """
    records = list(records)
    measured = [r for r in records if isinstance(r, Mapping) and "hist" in r]
    worst = max(measured, key=lambda r: float(r["worst"]), default=None)
    hist: Counter[int | None] = Counter()
    for r in measured:
        for b, c in r["hist"]:
            hist[b] += int(c)
    rows = sum(int(r["rows"]) for r in measured)
    worst_value = float(worst["worst"]) if worst else 0.0
    return {
        "worst": worst_value,
        "worst_row": int(worst["worst_row"]) if worst else -1,
        "p99_9": min(_percentile(hist, rows, PERCENTILE), worst_value),
        "zeroed_rows": sum(int(r["zeroed_rows"]) for r in measured),
        "rows": rows,
        "max_row_error": max_row_error,
        "ok": worst_value <= max_row_error,
        "measured_shards": len(measured),
        "shards": len(records),
    }


def _percentile(hist: Mapping[int | None, int], rows: int, q: float) -> float:
    """The upper edge of the bin holding the ``q``-th percentile row (0 for no rows)."""
    if rows == 0:
        return 0.0
    rank = math.ceil(rows * q / 100)
    seen = 0
    for b, c in sorted(hist.items(), key=_bin_order):
        seen += c
        if seen >= rank:
            return 0.0 if b is None else 10 ** ((b + 1) / BINS_PER_DECADE)
    return math.inf

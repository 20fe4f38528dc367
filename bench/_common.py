"""Helpers the bench scripts share (run as ``python bench/NAME.py``: this folder is on the path)."""

from __future__ import annotations

import statistics
import sys
from typing import Any


def say(msg: str) -> None:
    """Diagnostics go to stderr."""
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def spread(values: list[float]) -> dict[str, Any]:
    """Median, min, max and the values themselves."""
    return {
        "median": round(statistics.median(values), 3),
        "min": round(min(values), 3),
        "max": round(max(values), 3),
        "values": [round(v, 3) for v in values],
    }

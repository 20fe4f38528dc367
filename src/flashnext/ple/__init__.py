"""The PLE n-gram embedding table: geometry, hashing, formats, sidecars, quantizing, lookup.

Pure numpy: nothing here needs a GPU. The names below are loaded on first use (module
``__getattr__``), so importing one submodule, e.g. :mod:`flashnext.ple.geometry` for the
planner or ``flashnext check``, does not load the table and its numba kernels.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flashnext.ple.destination import SidecarWriter, write_sidecar
    from flashnext.ple.formats import FORMATS, detect_format, get_codec
    from flashnext.ple.geometry import PLEGeometry
    from flashnext.ple.hashing import next_context, ngram_ids, ngram_ids_packed
    from flashnext.ple.quantize import quantize_table
    from flashnext.ple.sidecar import Sidecar, open_sidecar
    from flashnext.ple.table import PLETable, StoredSegment, StoredTable, open_table

#: Each exported name and the submodule that defines it.
_EXPORTS = {
    "FORMATS": "formats",
    "detect_format": "formats",
    "get_codec": "formats",
    "PLEGeometry": "geometry",
    "next_context": "hashing",
    "ngram_ids": "hashing",
    "ngram_ids_packed": "hashing",
    "quantize_table": "quantize",
    "Sidecar": "sidecar",
    "SidecarWriter": "destination",
    "open_sidecar": "sidecar",
    "write_sidecar": "destination",
    "PLETable": "table",
    "StoredSegment": "table",
    "StoredTable": "table",
    "open_table": "table",
}

__all__ = [
    "FORMATS",
    "PLEGeometry",
    "PLETable",
    "Sidecar",
    "SidecarWriter",
    "StoredSegment",
    "StoredTable",
    "detect_format",
    "get_codec",
    "next_context",
    "ngram_ids",
    "ngram_ids_packed",
    "open_sidecar",
    "open_table",
    "quantize_table",
    "write_sidecar",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'flashnext.ple' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"flashnext.ple.{_EXPORTS[name]}"), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))

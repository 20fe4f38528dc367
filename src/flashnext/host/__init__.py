"""Serving a PLE sidecar from host RAM: the table (mmap or resident, the hot tier), its
mapping, the numba lookup kernels, the memory preflight, page-out and ``ple info``'s report.

The names below are loaded on first use (module ``__getattr__``), so importing
:mod:`flashnext.host.preflight` does not load the table and its numba kernels.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flashnext.host.table import PLETable, StoredSegment, StoredTable, open_table

#: Each exported name and the submodule that defines it.
_EXPORTS = {
    "PLETable": "table",
    "StoredSegment": "table",
    "StoredTable": "table",
    "open_table": "table",
}

__all__ = [
    "PLETable",
    "StoredSegment",
    "StoredTable",
    "open_table",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'flashnext.host' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"flashnext.host.{_EXPORTS[name]}"), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))

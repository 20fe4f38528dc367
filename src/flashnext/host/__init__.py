"""Serving a PLE sidecar from host RAM: the table (mmap or resident, the hot tier), its
mapping, the numba lookup kernels, the memory preflight, page-out and ``ple info``'s report.

The names below are loaded on first use (module ``__getattr__``), so importing
:mod:`flashnext.host.preflight` does not load the table and its numba kernels.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from flashnext.lazy_exports import lazy_exports

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


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

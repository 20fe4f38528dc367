"""PLE sidecars on disk: the spec and reader, the destination every writer goes through,
quantizing, slicing and the row-use profile.

numpy and numba, no GPU. The names below are loaded on first use (module ``__getattr__``), so
importing one submodule does not load the quantizer and its numba kernels.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from flashnext.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from flashnext.store.destination import SidecarWriter, write_sidecar
    from flashnext.store.quantize import quantize_table
    from flashnext.store.sidecar import Sidecar, open_sidecar

#: Each exported name and the submodule that defines it.
_EXPORTS = {
    "quantize_table": "quantize",
    "Sidecar": "sidecar",
    "SidecarWriter": "destination",
    "open_sidecar": "sidecar",
    "write_sidecar": "destination",
}

__all__ = [
    "Sidecar",
    "SidecarWriter",
    "open_sidecar",
    "quantize_table",
    "write_sidecar",
]


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

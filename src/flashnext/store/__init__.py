"""PLE sidecars on disk: the spec and reader, the destination every writer goes through,
quantizing, slicing and the row-use profile.

numpy and numba, no GPU. The names below are loaded on first use (module ``__getattr__``), so
importing one submodule does not load the quantizer and its numba kernels.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

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


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'flashnext.store' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"flashnext.store.{_EXPORTS[name]}"), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))

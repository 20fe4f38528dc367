"""The PLE contract: formats, geometry and hashing of the n-gram embedding table.

Pure numpy, and nothing here touches files: sidecars on disk are :mod:`flashnext.store`,
serving one from host RAM is :mod:`flashnext.host`. The names below are loaded on first use
(module ``__getattr__``), so importing one submodule, e.g. :mod:`flashnext.ple.geometry` for the
planner or ``flashnext check``, loads no more than it needs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from flashnext.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from flashnext.ple.formats import FORMATS, detect_format, get_codec
    from flashnext.ple.geometry import PLEGeometry
    from flashnext.ple.hashing import next_context, ngram_ids, ngram_ids_packed

#: Each exported name and the submodule that defines it.
_EXPORTS = {
    "FORMATS": "formats",
    "detect_format": "formats",
    "get_codec": "formats",
    "PLEGeometry": "geometry",
    "next_context": "hashing",
    "ngram_ids": "hashing",
    "ngram_ids_packed": "hashing",
}

__all__ = [
    "FORMATS",
    "PLEGeometry",
    "detect_format",
    "get_codec",
    "next_context",
    "ngram_ids",
    "ngram_ids_packed",
]


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

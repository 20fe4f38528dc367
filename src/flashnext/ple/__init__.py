"""The PLE n-gram embedding table: geometry, hashing, formats, sidecars, lookup.

Pure numpy: nothing here needs a GPU.
"""

from flashnext.ple.destination import SidecarWriter, write_sidecar
from flashnext.ple.formats import FORMATS, detect_format, get_codec
from flashnext.ple.geometry import PLEGeometry
from flashnext.ple.hashing import next_context, ngram_ids, ngram_ids_packed
from flashnext.ple.sidecar import Sidecar, open_sidecar
from flashnext.ple.table import PLETable, StoredSegment, StoredTable, open_table

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
    "write_sidecar",
]

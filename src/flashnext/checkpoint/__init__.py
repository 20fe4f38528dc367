"""A Hugging Face model snapshot on disk: verify a download, find the PLE table, configs.

- :mod:`~flashnext.checkpoint.snapshot`: is the download complete? (index, headers, sizes,
  leftovers, hashes)
- :mod:`~flashnext.checkpoint.ple_tensors`: each PLE layer's table in any layout and format,
  shape-checked; row maps for tensor-parallel ranks; a row source for the quantizer.
- :mod:`~flashnext.checkpoint.config`: config.json and its PLE fields.
- :mod:`~flashnext.checkpoint.override`: ``layer_types`` renames and dense attention, recorded with
  their reason.
"""

from flashnext.checkpoint.config import read_config
from flashnext.checkpoint.override import override_layer_types
from flashnext.checkpoint.ple_tensors import (
    CheckpointTableSource,
    PLETableInfo,
    RowCopy,
    find_ple_tables,
    open_table_source,
)
from flashnext.checkpoint.snapshot import VerifyReport, tensor_map, verify_snapshot

__all__ = [
    "CheckpointTableSource",
    "PLETableInfo",
    "RowCopy",
    "VerifyReport",
    "find_ple_tables",
    "open_table_source",
    "override_layer_types",
    "read_config",
    "tensor_map",
    "verify_snapshot",
]

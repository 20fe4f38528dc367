"""GPU PLE lookups (extra ``flashnext[gpu]``: torch, triton): fused gather + dequantize.

:class:`GpuTable` serves one table (or one tensor-parallel rank's rows) from GPU memory or
pinned host memory (UVA), with an optional device cache of a profile's rows; :class:`StagedTable`
serves a memory-mapped table through pinned staging buffers, and :class:`GraphStagedTable`
does so inside a CUDA graph (the graph waits on a host-written flag).
:mod:`flashnext.kernels.records`
(the per-row record packing) is pure numpy. torch and triton are imported on first use of
the GPU classes, with a one-line install hint when missing.
"""

from __future__ import annotations

from typing import Any

__all__ = ["GpuTable", "GraphStagedTable", "StagedTable"]


def __getattr__(name: str) -> Any:
    if name == "GpuTable":
        from flashnext.kernels.table import GpuTable

        return GpuTable
    if name == "StagedTable":
        from flashnext.kernels.staged import StagedTable

        return StagedTable
    if name == "GraphStagedTable":
        from flashnext.kernels.graph_staged import GraphStagedTable

        return GraphStagedTable
    raise AttributeError(f"module 'flashnext.kernels' has no attribute {name!r}")

"""MoE guards: route sanitizing and shared expert workspaces (no vLLM import here).

:func:`sanitize_routes` turns the padding expert ids vLLM writes into top-k ids (``-1`` for
CUDA-graph padding rows, dummy runs and graph capture) into routes a kernel can index: expert 0
with routing weight 0. :class:`WorkspacePool` lets every MoE layer with the same configuration
share one set of workspace and output buffers instead of allocating its own.
"""

from flashnext.moe.routes import InvalidRouteCounter, sanitize_routes
from flashnext.moe.workspaces import (
    SharedWorkspaces,
    WorkspaceConflictError,
    WorkspaceKey,
    WorkspacePool,
    WorkspaceSizes,
)

__all__ = [
    "InvalidRouteCounter",
    "SharedWorkspaces",
    "WorkspaceConflictError",
    "WorkspaceKey",
    "WorkspacePool",
    "WorkspaceSizes",
    "sanitize_routes",
]

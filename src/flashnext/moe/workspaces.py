"""Shared MoE workspaces: one set of buffers per MoE configuration, not one per layer.

FlashInfer's ``B12xMoEWrapper`` allocates a static workspace, an optional dynamic workspace and
a ``[max_tokens, hidden]`` output per MoE layer (about 400 MiB a layer in the deployment notes,
x 48 layers); its constructor accepts ``shared_static_workspace``, ``shared_dynamic_workspace``
and ``shared_output``, which vLLM 0.33 never passes. :class:`WorkspacePool` allocates those
buffers once per :class:`WorkspaceKey` and hands the same objects to every wrapper with that key.

Assumption (why sharing is safe): the decoder layers run one after another on one CUDA stream,
so at most one MoE layer uses the buffers at a time and each layer is done with them before the
next starts. A second stream asking for buffers of a key already bound to another stream breaks
that assumption, and the pool refuses it with :class:`WorkspaceConflictError` instead of letting
two layers overwrite each other's workspace.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from flashnext._extras import require
from flashnext.errors import FlashnextError


class WorkspaceConflictError(FlashnextError, RuntimeError):
    """Buffers of one key were asked for from a second stream, or with other sizes."""


@dataclass(frozen=True)
class WorkspaceKey:
    """Everything that decides a MoE layer's workspace shapes; equal keys share buffers."""

    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    max_tokens: int
    local_experts: int
    output_dtype: str  # e.g. "bfloat16"
    device: str  # e.g. "cuda:0"
    activation: str  # e.g. "silu"
    quant_mode: str  # e.g. "nvfp4"
    source_format: str  # e.g. "modelopt_fp4"


@dataclass(frozen=True)
class WorkspaceSizes:
    """Bytes of the static and dynamic workspaces (0 = none) a wrapper asks for."""

    static_bytes: int
    dynamic_bytes: int = 0


@dataclass
class SharedWorkspaces:
    """The buffers of one key: ``static``/``dynamic`` uint8 ``[bytes]`` (dynamic may be None)
    and ``output`` ``[max_tokens, hidden_size]`` of the key's output dtype."""

    key: WorkspaceKey
    sizes: WorkspaceSizes
    static: Any
    dynamic: Any
    output: Any
    stream: Any
    users: int = 0
    nbytes: int = 0

    def wrapper_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``B12xMoEWrapper(...)`` that make it use these buffers."""
        return {
            "shared_static_workspace": self.static,
            "shared_dynamic_workspace": self.dynamic,
            "shared_output": self.output,
        }


Allocator = Callable[[WorkspaceKey, WorkspaceSizes], tuple[Any, Any, Any]]


def torch_allocator(key: WorkspaceKey, sizes: WorkspaceSizes) -> tuple[Any, Any, Any]:
    """Allocate the three buffers with torch on ``key.device`` (uninitialised memory)."""
    torch = require("torch", "gpu", "flashnext.moe.WorkspacePool")
    dtype = getattr(torch, key.output_dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise WorkspaceConflictError(f"output_dtype {key.output_dtype!r} is not a torch dtype")
    static = torch.empty(sizes.static_bytes, dtype=torch.uint8, device=key.device)
    dynamic = (
        torch.empty(sizes.dynamic_bytes, dtype=torch.uint8, device=key.device)
        if sizes.dynamic_bytes
        else None
    )
    output = torch.empty((key.max_tokens, key.hidden_size), dtype=dtype, device=key.device)
    return static, dynamic, output


def _nbytes(buf: Any) -> int:
    if buf is None:
        return 0
    nbytes = getattr(buf, "nbytes", None)
    if nbytes is not None:
        return int(nbytes)
    if hasattr(buf, "numel"):
        return int(buf.numel() * buf.element_size())
    # A workspace object (FlashInfer's B12x workspaces hold tensors as attributes).
    held = vars(buf).values() if hasattr(buf, "__dict__") else ()
    return sum(_nbytes(v) for v in held if hasattr(v, "nbytes") or hasattr(v, "numel"))


def current_stream(device: str) -> Any:
    """An identity for the stream that work on ``device`` goes to now (``"cpu"`` off CUDA)."""
    if not device.startswith("cuda"):
        return "cpu"
    torch = require("torch", "gpu", "flashnext.moe.WorkspacePool")
    return torch.cuda.current_stream(torch.device(device)).cuda_stream


@dataclass
class WorkspacePool:
    """Buffers allocated once per :class:`WorkspaceKey`, shared by every wrapper with that key.

    ``allocator(key, sizes) -> (static, dynamic, output)`` defaults to torch on ``key.device``.
    Thread-safe; one pool per process (vLLM builds each worker's model in its own process).
    """

    allocator: Allocator = torch_allocator
    _entries: dict[WorkspaceKey, SharedWorkspaces] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def get(self, key: WorkspaceKey, sizes: WorkspaceSizes, stream: Any = None) -> SharedWorkspaces:
        """The shared buffers for ``key``, allocated on first request.

        Args:
            key: the layer's MoE configuration.
            sizes: workspace bytes the wrapper needs; must equal the first request's for a key.
            stream: identity of the stream the layer runs on (default: the current stream of
                ``key.device``, or ``"cpu"``).

        Raises:
            WorkspaceConflictError: a different stream, or different sizes, for a bound key.
        """
        stream = current_stream(key.device) if stream is None else stream
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                static, dynamic, output = self.allocator(key, sizes)
                entry = SharedWorkspaces(key, sizes, static, dynamic, output, stream)
                entry.nbytes = _nbytes(static) + _nbytes(dynamic) + _nbytes(output)
                self._entries[key] = entry
            elif entry.stream != stream:
                raise WorkspaceConflictError(
                    f"MoE workspaces for {_describe(key)} are bound to stream {entry.stream!r}; "
                    f"stream {stream!r} asked for them too. Sharing is only safe when the MoE "
                    "layers run one after another on one stream: give the other stream its own "
                    "pool or disable workspace sharing"
                )
            elif entry.sizes != sizes:
                raise WorkspaceConflictError(
                    f"MoE workspaces for {_describe(key)} were allocated for {entry.sizes}, "
                    f"a wrapper with the same key asked for {sizes}: the key misses a field "
                    "that decides the workspace size"
                )
            entry.users += 1
            return entry

    @property
    def allocated_bytes(self) -> int:
        """Bytes the pool holds (one set of buffers per key)."""
        return sum(e.nbytes for e in self._entries.values())

    @property
    def saved_bytes(self) -> int:
        """Bytes not allocated because wrappers shared: (users - 1) x buffer bytes per key."""
        return sum(max(e.users - 1, 0) * e.nbytes for e in self._entries.values())

    def report(self) -> dict[str, Any]:
        """JSON-ready summary: per key its users and bytes; totals allocated and saved."""
        return {
            "keys": [
                {"key": asdict(e.key), "users": e.users, "bytes": e.nbytes}
                for e in self._entries.values()
            ],
            "allocated_bytes": self.allocated_bytes,
            "saved_bytes": self.saved_bytes,
        }


def _describe(key: WorkspaceKey) -> str:
    return (
        f"experts={key.num_experts} top_k={key.top_k} hidden={key.hidden_size} "
        f"intermediate={key.intermediate_size} max_tokens={key.max_tokens} on {key.device}"
    )

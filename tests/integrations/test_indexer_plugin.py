"""The plugin's ``drop_indexer`` wrapper with real torch tensors (the vllm venv's torch; no vLLM
import): indexer tensors are dropped by name, and logged with their bytes, only while the model's
config has no ``indexer_n_heads``. tests/e2e/test_override.py runs it inside a real vLLM server."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest

from devtools.e2e.runtime import E2eRuntime, ensure_e2e_runtime
from devtools.vllm_cpu import venv_child_env

CHILD = Path(__file__).with_name("indexer_child.py")
SRC = Path(__file__).parents[2] / "src"
TENSORS = [
    ["layers.0.linear_attn.in_proj_qkv.weight", [8, 4]],
    ["layers.1.self_attn.q_proj.weight", [8, 4]],
    ["layers.1.self_attn.indexer.index_qk_proj.weight", [6, 4]],
    ["layers.1.self_attn.indexer.q_layernorm.weight", [3]],
    ["layers.3.self_attn.indexer.k_layernorm.weight", [5]],
    ["layers.1.self_attn.o_proj.weight", [4, 8]],
]


@pytest.fixture(scope="module")
def runtime(pytestconfig: pytest.Config, vllm_venv: Path) -> E2eRuntime:
    """The vllm venv plus the e2e overlay (ml_dtypes, which flashnext.checkpoint imports)."""
    capture = pytestconfig.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
        return ensure_e2e_runtime()


def run_child(runtime: E2eRuntime, heads: int | None, seed: int) -> dict:
    spec = json.dumps({"indexer_n_heads": heads, "tensors": TENSORS, "seed": seed})
    run = subprocess.run(
        [str(runtime.python), str(CHILD), spec],
        capture_output=True, text=True, timeout=300, env=venv_child_env(SRC, runtime.overlay),
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout)


@pytest.mark.parametrize("heads", [None, 4])
def test_indexer_tensors_dropped_only_without_an_indexer(runtime, rng, heads):
    got = run_child(runtime, heads, int(rng.integers(1 << 31)))
    indexer = [t for t in TENSORS if ".self_attn.indexer." in t[0]]
    expected = TENSORS if heads else [t for t in TENSORS if t not in indexer]
    sizes = {name: math.prod(shape) for name, shape in TENSORS}
    assert got["seen"] == [[name, sizes[name]] for name, _ in expected]  # order kept
    if heads:
        assert got["log"] == []
    else:
        nbytes = 2 * sum(sizes[name] for name, _ in indexer)  # bf16
        assert len(got["log"]) == 1
        assert (
            f"drop_indexer: Model skipped 3 QSA indexer tensor(s), {nbytes:,} bytes, of layers "
            "[1, 3]"
        ) in got["log"][0]

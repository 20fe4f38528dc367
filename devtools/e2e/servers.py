"""Servers of the tiny Qwen4Exp: devtools.vllm_cpu.VllmServer with the e2e runtime around it.

Every e2e server runs stock vLLM (``python -m vllm.entrypoints.openai.api_server``, vLLM's files
unchanged) with ``--engram-config '{"cpu_offload": false}'`` (the pinned-host PLE table wants
CUDA) and ``--max-model-len 256``. ``plugin=True`` makes flashnext's plugin visible to it; the
plugin then acts only as its FLASHNEXT_* variables or ``--additional-config`` say.
"""

from __future__ import annotations

from collections.abc import Callable
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
    wrap: list[str] | None = None,
    fork: bool = False,
) -> VllmServer:
    """A not-yet-started server of ``model`` (``.launch()``/``.start()``/``start_all``; ``.stop()``).

    ``env`` and ``extra`` come on top of the e2e runtime's variables and arguments; ``tp2`` adds
    :data:`TP2_ARGS` / :data:`TP2_ENV`; ``wrap`` prefixes the command (a memory cgroup's
    :meth:`devtools.cgroup.MemoryCgroup.wrap`); ``fork`` starts it from a pre-imported zygote
    (:class:`devtools.vllm_cpu.VllmServer`).
    """
    log_dir.mkdir(parents=True, exist_ok=True)
    args = [*E2E_ARGS, *(TP2_ARGS if tp2 else []), *(extra or [])]
    full_env = {**runtime.env(plugin), **(TP2_ENV if tp2 else {}), **(env or {})}
    return VllmServer(runtime.python, model, log_dir, args, full_env, wrap, fork)


class ServerPool:
    """Named e2e servers launched in waves and stopped when no longer needed.

    ``specs`` maps a name to a zero-argument factory returning a not-yet-started server (see
    :func:`e2e_server`). :meth:`launch` starts servers without waiting (a boot is mostly
    single-threaded imports, so boots side by side use both cores); :meth:`healthy` waits for
    one; :meth:`stop` ends them.
    """

    def __init__(self, specs: dict[str, Callable[[], VllmServer]]) -> None:
        self.specs = specs
        self.servers: dict[str, VllmServer] = {}

    def launch(self, *names: str) -> None:
        """Start the named servers not started yet, without waiting."""
        for name in names:
            if name not in self.servers:
                self.servers[name] = self.specs[name]().launch()

    def healthy(self, name: str) -> VllmServer:
        """The named server, launched if needed, once /health answers."""
        self.launch(name)
        server = self.servers[name]
        server.wait_healthy()
        return server

    def stop(self, *names: str) -> None:
        """Stop the named servers (all when none is named); a later launch starts them afresh."""
        for name in names or tuple(self.servers):
            server = self.servers.pop(name, None)
            if server is not None:
                server.stop()


def log_text(server: VllmServer) -> str:
    """The whole log of the server's current process."""
    path = server.log_dir / f"vllm-{server.port}-{server.starts}.log"
    return path.read_text(errors="replace") if path.exists() else ""

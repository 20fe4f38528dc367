"""The server process behind a URL: found by port in /proc, or described by a container runtime.

Local processes are read from ``/proc/PID/cmdline``, ``environ`` and ``cwd``; the process that
listens on a port is found through ``/proc/net/tcp{,6}`` (socket inodes) and ``/proc/*/fd``.
Containers are read from ``docker inspect`` / ``podman inspect`` output (:func:`from_inspect`
parses it, so a saved inspect JSON can be used where no runtime is installed).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flashnext.errors import FlashnextError

#: Environment variables that decide how vLLM runs; the rest of a process environment is noise.
RELEVANT_ENV = re.compile(
    r"^(VLLM_|CUDA_|NCCL_|PYTORCH_|TORCH_|HF_|HUGGING_FACE_|TRANSFORMERS_|FLASHINFER_|"
    r"FLASHNEXT_|OMP_|MKL_|NVIDIA_|TRITON_|LD_LIBRARY_PATH$|PYTHONPATH$)"
)
_LISTEN = "0A"


class ProcessError(FlashnextError):
    """The server process cannot be found or read."""


@dataclass
class LaunchInfo:
    """How the server was started: argv, environment (relevant names only), where, by what."""

    source: str  # "pid", "port", "container"
    argv: list[str]
    env: dict[str, str]
    cwd: str | None = None
    pid: int | None = None
    container: dict[str, Any] = field(default_factory=dict)  # image, digest, mounts, gpus, name


def read_pid(pid: int, proc: Path = Path("/proc"), source: str = "pid") -> LaunchInfo:
    """argv, relevant environment and cwd of local process ``pid``.

    Raises:
        ProcessError: no such process, or it cannot be read (another user's, say).
    """
    base = proc / str(pid)
    try:
        argv = [
            a.decode(errors="replace") for a in (base / "cmdline").read_bytes().split(b"\0") if a
        ]
        raw_env = (base / "environ").read_bytes().split(b"\0")
        cwd = os.readlink(base / "cwd")
    except FileNotFoundError:
        raise ProcessError(f"pid {pid}: no such process") from None
    except PermissionError:
        raise ProcessError(
            f"pid {pid}: cannot read /proc/{pid} (run as its user or root)"
        ) from None
    env = {}
    for item in raw_env:
        name, eq, value = item.decode(errors="replace").partition("=")
        if eq and RELEVANT_ENV.match(name):
            env[name] = value
    return LaunchInfo(source, argv, env, cwd, pid)


def _listening_inodes(port: int, proc: Path) -> set[str]:
    inodes = set()
    for table in ("net/tcp", "net/tcp6"):
        try:
            lines = (proc / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            local, state, inode = cols[1], cols[3], cols[9]
            if state == _LISTEN and int(local.rsplit(":", 1)[1], 16) == port:
                inodes.add(inode)
    return inodes


def pid_listening_on(port: int, proc: Path = Path("/proc")) -> int:
    """The pid of the local process listening on TCP ``port``.

    Raises:
        ProcessError: nothing local listens there (a remote server, or another namespace).
    """
    inodes = _listening_inodes(port, proc)
    if inodes:
        targets = {f"socket:[{i}]" for i in inodes}
        for entry in proc.iterdir():
            if not entry.name.isdigit():
                continue
            try:
                fds = list((entry / "fd").iterdir())
            except OSError:
                continue
            for fd in fds:
                try:
                    if os.readlink(fd) in targets:
                        return int(entry.name)
                except OSError:
                    continue
    raise ProcessError(
        f"no local process listens on port {port} (remote server or another network namespace); "
        "pass --pid or --container"
    )


def from_inspect(data: Any, name: str) -> LaunchInfo:
    """LaunchInfo from ``docker inspect NAME`` output (a list of one object, or the object).

    Raises:
        ProcessError: the JSON is not an inspect result of a container.
    """
    obj = data[0] if isinstance(data, list) and data else data
    if not isinstance(obj, Mapping) or "Config" not in obj:
        raise ProcessError(f"container {name}: inspect output has no 'Config' object")
    config = obj.get("Config") or {}
    host = obj.get("HostConfig") or {}
    argv = [*(config.get("Entrypoint") or []), *(config.get("Cmd") or [])]
    env = {}
    for item in config.get("Env") or []:
        key, _eq, value = str(item).partition("=")
        env[key] = value
    gpus = [
        {"driver": d.get("Driver"), "count": d.get("Count"), "ids": d.get("DeviceIDs")}
        for d in host.get("DeviceRequests") or []
    ]
    mounts = [
        {"source": m.get("Source"), "destination": m.get("Destination"), "rw": m.get("RW", True)}
        for m in obj.get("Mounts") or []
    ]
    container = {
        "name": str(obj.get("Name", name)).lstrip("/"),
        "entrypoint": list(config.get("Entrypoint") or []),
        "cmd": list(config.get("Cmd") or []),
        "image": config.get("Image"),
        "image_id": obj.get("Image"),
        "restart_count": obj.get("RestartCount"),
        "network_mode": host.get("NetworkMode"),
        "ipc_mode": host.get("IpcMode"),
        "shm_size": host.get("ShmSize"),
        "ports": sorted((host.get("PortBindings") or {}).keys()),
        "mounts": mounts,
        "gpus": gpus,
    }
    return LaunchInfo("container", argv, env, config.get("WorkingDir") or None, None, container)


def inspect_container(name: str) -> LaunchInfo:
    """Run ``docker inspect`` (or ``podman inspect``) on ``name``.

    Raises:
        ProcessError: no container runtime on PATH, or the runtime does not know ``name``.
    """
    runtime = shutil.which("docker") or shutil.which("podman")
    if runtime is None:
        raise ProcessError(f"container {name}: neither docker nor podman is on PATH")
    done = subprocess.run([runtime, "inspect", name], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise ProcessError(f"container {name}: {runtime} inspect failed: {done.stderr.strip()}")
    info = from_inspect(json.loads(done.stdout), name)
    info.container["runtime"] = Path(runtime).name
    image = subprocess.run(
        [runtime, "image", "inspect", str(info.container["image_id"])],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    if image.returncode == 0:
        digests = (json.loads(image.stdout) or [{}])[0].get("RepoDigests") or []
        info.container["repo_digests"] = digests
    return info

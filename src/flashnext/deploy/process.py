"""The server process behind a URL: found by port in /proc, or described by a container runtime.

Local processes are read from ``/proc/PID/cmdline``, ``environ`` and ``cwd``; the process that
listens on a port is found through ``/proc/net/tcp{,6}`` (socket inodes) and ``/proc/*/fd``; the
files its stdout and stderr are written to through ``/proc/PID/fd/1`` and ``/proc/PID/fd/2``.
Containers are read from ``docker inspect`` / ``podman inspect`` output (:func:`from_inspect`
parses it, so a saved inspect JSON can be used where no runtime is installed).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
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


def output_files(pid: int, proc: Path = Path("/proc")) -> list[tuple[str, Path]]:
    """The regular files that process ``pid``'s stdout and stderr (fds 1 and 2) write to.

    Returns ``(name, path)`` pairs, one per distinct file (stderr redirected to stdout counts
    once): ``name`` is the link target (what the file was called when it was opened), ``path``
    is ``/proc/PID/fd/N``, which opens the same file even if it was renamed or deleted since.
    A pipe, socket, terminal or /dev/null is not a file and is left out.

    Raises:
        ProcessError: no such process, or its fds cannot be read (another user's).
    """
    out: list[tuple[str, Path]] = []
    seen: set[tuple[int, int]] = set()
    for fd in (1, 2):
        link = proc / str(pid) / "fd" / str(fd)
        try:
            name = os.readlink(link)
            st = os.stat(link)
        except FileNotFoundError:
            if not (proc / str(pid)).exists():
                raise ProcessError(f"pid {pid}: no such process") from None
            continue  # fd closed
        except PermissionError:
            raise ProcessError(
                f"pid {pid}: cannot read /proc/{pid}/fd (run as its user or root)"
            ) from None
        if stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            out.append((name, link))
    return out


def parent_pid(pid: int, proc: Path = Path("/proc")) -> int | None:
    """The parent of process ``pid`` from ``/proc/PID/stat``; None when it cannot be read."""
    try:
        stat_line = (proc / str(pid) / "stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its last ")".
    return int(stat_line.rsplit(")", 1)[1].split()[1])


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


def _inspect_env(items: list[Any]) -> tuple[dict[str, str], list[str]]:
    """``Config.Env`` as a mapping, and the names listed without a value (given as ``-e NAME``;
    a restore passes them the same way)."""
    env: dict[str, str] = {}
    bare: list[str] = []
    for item in items:
        key, eq, value = str(item).partition("=")
        if eq:
            env[key] = value
        else:
            bare.append(key)
    return env, bare


def _inspect_mounts(mounts: list[Any]) -> list[dict[str, Any]]:
    """Bind mounts and volumes; an anonymous volume (a 64-hex name docker made up) is kept by
    its destination only, so a restore asks for a fresh one instead of reusing the old data."""
    out = []
    for m in mounts:
        source = m.get("Source")
        if m.get("Type") == "volume":
            source = m.get("Name") or None
            if source and re.fullmatch(r"[0-9a-f]{64}", source):
                source = None  # anonymous
        out.append(
            {
                "type": m.get("Type", "bind"),
                "source": source,
                "destination": m.get("Destination"),
                "rw": m.get("RW", True),
            }
        )
    return out


def _inspect_ports(bindings: Mapping[str, Any] | None) -> list[dict[str, str]]:
    """``HostConfig.PortBindings`` flattened: one entry per (container port, host binding)."""
    out = []
    for port, binds in sorted((bindings or {}).items()):
        for b in binds or [{}]:  # null: exposed with no binding given, a random host port
            out.append(
                {
                    "container": port,
                    "host_ip": b.get("HostIp", ""),
                    "host_port": b.get("HostPort", ""),
                }
            )
    return out


def from_inspect(data: Any, name: str) -> LaunchInfo:
    """LaunchInfo from ``docker inspect NAME`` output (a list of one object, or the object).

    The container section keeps what ``docker run`` needs to recreate the container: image and
    image id, entrypoint and cmd, name, user, network and IPC modes, shared memory, memory
    limit, port bindings, mounts, devices, added capabilities, privileged, restart policy, GPU
    device requests and environment names given without a value. Labels, DNS, log driver and
    extra hosts are not kept.

    Raises:
        ProcessError: the JSON is not an inspect result of a container.
    """
    obj = data[0] if isinstance(data, list) and data else data
    if not isinstance(obj, Mapping) or "Config" not in obj:
        raise ProcessError(f"container {name}: inspect output has no 'Config' object")
    config = obj.get("Config") or {}
    host = obj.get("HostConfig") or {}
    argv = [*(config.get("Entrypoint") or []), *(config.get("Cmd") or [])]
    env, bare = _inspect_env(config.get("Env") or [])
    restart = host.get("RestartPolicy") or {}
    container = {
        "name": str(obj.get("Name", name)).lstrip("/"),
        "entrypoint": list(config.get("Entrypoint") or []),
        "cmd": list(config.get("Cmd") or []),
        "image": config.get("Image"),
        "image_id": obj.get("Image"),
        "user": config.get("User") or None,
        "restart_count": obj.get("RestartCount"),
        "restart_policy": restart.get("Name") or None,
        "network_mode": host.get("NetworkMode"),
        "ipc_mode": host.get("IpcMode"),
        "shm_size": host.get("ShmSize"),
        "memory": host.get("Memory") or None,
        "privileged": bool(host.get("Privileged")),
        "cap_add": list(host.get("CapAdd") or []),
        "devices": [
            f"{d.get('PathOnHost')}:{d.get('PathInContainer')}:{d.get('CgroupPermissions', 'rwm')}"
            for d in host.get("Devices") or []
        ],
        "ports": _inspect_ports(host.get("PortBindings")),
        "mounts": _inspect_mounts(obj.get("Mounts") or []),
        "gpus": [
            {"driver": d.get("Driver"), "count": d.get("Count"), "ids": d.get("DeviceIDs")}
            for d in host.get("DeviceRequests") or []
        ],
        "env_without_value": bare,
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

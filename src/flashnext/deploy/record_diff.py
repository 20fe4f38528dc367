"""Compare two deployment records, and turn one back into the launch that made it.

:func:`record_diff` separates what was changed (launch flags and source, environment, packages,
image, checkpoint, the sidecar tables' identities: the *variables*) from what the server reported differently as a consequence
(*observed*: context length, cache blocks), groups both (runtime, model, memory, parallelism,
environment), and warns when more than one variable changed: the validation guide's "change one
variable at a time". :func:`restore_command` rebuilds a ``docker run`` (same image digest, args,
env, mounts, GPUs) or the local command line; redacted secrets become ``${NAME:?...}``
placeholders that the shell fills from your environment.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from flashnext.deploy.serve_args import parse_serve_args
from flashnext.errors import FlashnextError
from flashnext.records import DEPLOY_RECORD, REDACTED, check_fields, check_record

GROUPS = ("runtime", "model", "memory", "parallelism", "environment")
_FLAG_GROUPS = {
    "memory": {
        "--gpu-memory-utilization", "--max-model-len", "--max-num-seqs", "--kv-cache-dtype",
        "--kv-cache-memory-bytes", "--block-size", "--max-num-batched-tokens", "--swap-space",
        "--cpu-offload-gb", "--enable-prefix-caching", "--no-enable-prefix-caching",
    },
    "parallelism": {
        "--tensor-parallel-size", "--pipeline-parallel-size", "--data-parallel-size",
        "--enable-expert-parallel", "--no-enable-expert-parallel", "--distributed-executor-backend",
    },
    "model": {
        "model", "--model", "--served-model-name", "--quantization", "--hf-overrides",
        "--revision", "--tokenizer", "--dtype", "--load-format", "--speculative-config",
    },
}  # fmt: skip


#: Container settings a diff compares (all but the name and the restart count).
CONTAINER_KEYS = (
    "image", "image_id", "repo_digests", "user", "network_mode", "ipc_mode", "shm_size", "memory",
    "privileged", "cap_add", "devices", "ports", "mounts", "gpus", "env_without_value",
    "restart_policy",
)  # fmt: skip


_OPT = type(None)
_TEXTS = ("entrypoint", "cmd", "repo_digests", "cap_add", "devices", "env_without_value")
_TEXT = ("image", "image_id", "name", "user", "restart_policy", "network_mode", "ipc_mode")
#: The fields :func:`record_diff` and :func:`restore_command` read, and their types: a record is
#: checked against them when read, so a hand-edited one fails with one line naming the field.
FIELDS: dict[str, type | tuple[type, ...]] = {
    "server": (dict, _OPT),
    "server.version": (str, _OPT),
    "server.models": (list, _OPT),
    "server.models[]": dict,
    "packages": (dict, _OPT),
    "packages{}": (str, _OPT),
    "checkpoint": (dict, _OPT),
    "checkpoint.weights": (list, _OPT),
    "plugin": (dict, _OPT),
    "plugin.sidecar": (dict, _OPT),
    "plugin.sidecar.present": (bool, _OPT),
    "plugin.sidecar.tables": (dict, _OPT),
    "plugin.sidecar.tables{}": dict,
    "launch": (dict, _OPT),
    "launch.source": (str, _OPT),
    "launch.argv": (list, _OPT),
    "launch.argv[]": str,
    "launch.env": (dict, _OPT),
    "launch.env{}": str,
    "launch.cwd": (str, _OPT),
    "launch.container": (dict, _OPT),
    **{f"launch.container.{k}": (str, _OPT) for k in _TEXT},
    **{f"launch.container.{k}": (list, _OPT) for k in _TEXTS},
    **{f"launch.container.{k}[]": str for k in _TEXTS},
    "launch.container.shm_size": (int, str, _OPT),
    "launch.container.memory": (int, str, _OPT),
    "launch.container.privileged": (bool, _OPT),
    "launch.container.gpus": (list, _OPT),
    "launch.container.gpus[]": dict,
    "launch.container.gpus[].ids": (list, _OPT),
    "launch.container.gpus[].ids[]": str,
    "launch.container.gpus[].count": (int, _OPT),
    "launch.container.ports": (list, _OPT),
    "launch.container.ports[]": dict,
    "launch.container.ports[].container": str,
    "launch.container.ports[].host_ip": (str, _OPT),
    "launch.container.ports[].host_port": (str, _OPT),
    "launch.container.mounts": (list, _OPT),
    "launch.container.mounts[]": dict,
    "launch.container.mounts[].destination": str,
    "launch.container.mounts[].source": (str, _OPT),
    "launch.container.mounts[].rw": (bool, _OPT),
}


def check_deployment_record(data: Any, source: str = "record") -> dict[str, Any]:
    """``data`` checked as a deployment record: the envelope, then every field this module reads
    (:data:`FIELDS`); returned as it is.

    Raises:
        RecordError: naming ``source`` and the first field that is not as expected.
    """
    record = check_record(data, kind=DEPLOY_RECORD, source=source)
    check_fields(record, FIELDS, source)
    return record


class RecordDiffError(FlashnextError):
    """Records that cannot be compared or restored."""


@dataclass(frozen=True)
class RecordChange:
    group: str
    name: str
    before: Any
    after: Any
    variable: bool  # False: observed (a consequence reported by the server)


def _flag_group(flag: str) -> str:
    return next((g for g, flags in _FLAG_GROUPS.items() if flag in flags), "runtime")


def _flags(record: Mapping[str, Any]) -> dict[str, Any]:
    launch = record.get("launch") or {}
    argv = list(launch.get("argv") or [])
    # Skip the interpreter and module/entry point: flags start at the first "-" or "serve".
    start = next((i for i, a in enumerate(argv) if a.startswith("-") or a == "serve"), len(argv))
    if start < len(argv) and argv[start] == "serve":
        start += 1
    args = argv[start:]
    if args and args[0] == "-m":  # python -m vllm.entrypoints.openai.api_server ...
        args = args[2:]
    flags = dict(parse_serve_args(args).flags)
    flags["(program)"] = " ".join(argv[:start])
    return flags


def _pairs(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    return [(k, a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


def record_diff(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[RecordChange]:
    """What changed from record ``a`` to ``b`` (capture times and pids ignored).

    Raises:
        RecordError: either is not a deployment record.
    """
    for rec, name in ((a, "first record"), (b, "second record")):
        check_deployment_record(rec, source=name)
    out: list[RecordChange] = []
    for flag, x, y in _pairs(_flags(a), _flags(b)):
        out.append(RecordChange(_flag_group(flag), flag, x, y, True))
    launch_a, launch_b = a.get("launch") or {}, b.get("launch") or {}
    for key in ("source", "cwd"):  # restore runs the command from the cwd, in the source's way
        if launch_a.get(key) != launch_b.get(key):
            out.append(RecordChange("runtime", f"launch {key}", launch_a.get(key),
                                    launch_b.get(key), True))  # fmt: skip
    env_a = launch_a.get("env") or {}
    env_b = launch_b.get("env") or {}
    out += [RecordChange("environment", k, x, y, True) for k, x, y in _pairs(env_a, env_b)]
    out += [
        RecordChange("runtime", f"package {k}", x, y, True)
        for k, x, y in _pairs(a.get("packages") or {}, b.get("packages") or {})
    ]
    cont_a = (a.get("launch") or {}).get("container") or {}
    cont_b = (b.get("launch") or {}).get("container") or {}
    for key in CONTAINER_KEYS:
        if cont_a.get(key) != cont_b.get(key):
            out.append(
                RecordChange("runtime", f"container {key}", cont_a.get(key), cont_b.get(key), True)
            )
    ck_a, ck_b = a.get("checkpoint") or {}, b.get("checkpoint") or {}
    for key in ("path", "revision", "config_sha256", "index_sha256", "weights"):
        if ck_a.get(key) != ck_b.get(key):
            change = RecordChange("model", f"checkpoint {key}", ck_a.get(key), ck_b.get(key), True)
            out.append(change)
    out += _sidecar_changes(a, b)
    srv_a, srv_b = a.get("server") or {}, b.get("server") or {}
    if srv_a.get("version") != srv_b.get("version"):
        out.append(
            RecordChange(
                "runtime", "server version", srv_a.get("version"), srv_b.get("version"), False
            )
        )
    if srv_a.get("models") != srv_b.get("models"):
        out.append(
            RecordChange("memory", "served models", srv_a.get("models"), srv_b.get("models"), False)
        )
    for k, x, y in _pairs(srv_a.get("cache_config") or {}, srv_b.get("cache_config") or {}):
        out.append(RecordChange("memory", f"cache_config {k}", x, y, False))
    for key, group in (("gpus", "memory"), ("host_memory_bytes", "memory")):
        if a.get(key) != b.get(key):
            out.append(RecordChange(group, key, a.get(key), b.get(key), False))
    return out


def _sidecar_changes(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[RecordChange]:
    """The sidecar tables' identities (``plugin.sidecar``): a table re-quantized or rewritten at
    the same path changes its format or META.json sha256, which the environment cannot show."""
    side_a = (a.get("plugin") or {}).get("sidecar") or {}
    side_b = (b.get("plugin") or {}).get("sidecar") or {}
    tables_a, tables_b = side_a.get("tables") or {}, side_b.get("tables") or {}
    out = []
    for name in sorted(set(tables_a) | set(tables_b)):
        x, y = tables_a.get(name) or {}, tables_b.get(name) or {}
        where = f"sidecar {name + ' ' if name else ''}"
        for key in ("format", "num_rows", "meta_sha256", "error"):
            if x.get(key) != y.get(key):
                out.append(RecordChange("model", where + key, x.get(key), y.get(key), True))
    if side_a.get("present") != side_b.get("present"):
        out.append(RecordChange("model", "sidecar present", side_a.get("present"),
                          side_b.get("present"), True))  # fmt: skip
    return out


def variables_changed(changes: list[RecordChange]) -> int:
    return sum(1 for c in changes if c.variable)


def _placeholder(name: str) -> str:
    var = "".join(ch if ch.isalnum() else "_" for ch in name.upper()).strip("_") or "SECRET"
    return f'"${{{var}:?set {var}, redacted from the record}}"'


def _word(word: str, secret_name: str) -> str:
    return _placeholder(secret_name) if word == REDACTED else shlex.quote(word)


def _argv_words(argv: list[str]) -> list[str]:
    words, prev = [], "SECRET"
    for arg in argv:
        name, eq, value = arg.partition("=")
        if eq and value == REDACTED:
            words.append(f"{shlex.quote(name + '=')}{_placeholder(name)}")
        else:
            words.append(_word(arg, prev))
        prev = arg
    return words


def restore_command(record: Mapping[str, Any]) -> str:
    """A shell command line that relaunches what ``record`` describes (nothing is run).

    Raises:
        RecordDiffError: the record has no launch section (a remote server captured without
            --pid/--container).
    """
    check_deployment_record(record)
    launch = record.get("launch")
    if not launch or not launch.get("argv"):
        raise RecordDiffError(
            "the record has no launch arguments (captured from a remote server without --pid or "
            "--container): nothing to restore"
        )
    env = launch.get("env") or {}
    env_words = [
        f"{k}={_placeholder(k)}" if v == REDACTED else f"{k}={shlex.quote(v)}"
        for k, v in sorted(env.items())
    ]
    if launch.get("source") == "container":
        return _docker_run(launch, env)
    cwd = launch.get("cwd")
    prefix = f"cd {shlex.quote(cwd)} && " if cwd else ""
    return prefix + " ".join(["env", *env_words, *_argv_words(list(launch["argv"]))])


def _gpu_words(gpus: list[Mapping[str, Any]]) -> list[str]:
    words = []
    for gpu in gpus:
        ids = gpu.get("ids")
        if ids:
            spec = f'"device={",".join(ids)}"'  # docker parses the value as CSV: quote it
        else:
            spec = "all" if gpu.get("count") == -1 else str(gpu.get("count"))
        words += ["--gpus", shlex.quote(spec)]
    return words


def _mount_words(mounts: list[Mapping[str, Any]]) -> list[str]:
    words = []
    for m in mounts:
        ro = "" if m.get("rw", True) else ":ro"
        src = f"{m['source']}:" if m.get("source") else ""  # no source: a fresh anonymous volume
        words += ["-v", shlex.quote(f"{src}{m['destination']}{ro}")]
    return words


def _port_words(ports: list[Mapping[str, str]]) -> list[str]:
    words = []
    for p in ports:
        host = ":".join(x for x in (p.get("host_ip"), p.get("host_port")) if x)
        words += ["-p", shlex.quote(f"{host}:{p['container']}" if host else p["container"])]
    return words


def _container_words(c: Mapping[str, Any]) -> list[str]:
    """Every ``docker run`` option of the container section except env, image and command."""
    words = ["--name", shlex.quote(c["name"])] if c.get("name") else []
    words += _gpu_words(c.get("gpus") or [])
    for key, flag in (
        ("user", "--user"),
        ("restart_policy", "--restart"),
        ("network_mode", "--network"),
        ("ipc_mode", "--ipc"),
        ("shm_size", "--shm-size"),
        ("memory", "--memory"),
    ):
        if c.get(key) and c.get(key) != "no":
            words += [flag, shlex.quote(str(c[key]))]
    if c.get("privileged"):
        words.append("--privileged")
    for cap in c.get("cap_add") or []:
        words += ["--cap-add", shlex.quote(cap)]
    for dev in c.get("devices") or []:
        words += ["--device", shlex.quote(dev)]
    return words + _port_words(c.get("ports") or []) + _mount_words(c.get("mounts") or [])


def _docker_run(launch: Mapping[str, Any], env: Mapping[str, str]) -> str:
    c = launch.get("container") or {}
    digests = c.get("repo_digests") or []
    image = digests[0] if digests else (c.get("image_id") or c.get("image"))
    words = ["docker", "run", "-d", *_container_words(c)]
    if launch.get("cwd"):
        words += ["-w", shlex.quote(launch["cwd"])]
    for k, v in sorted(env.items()):
        words += ["-e", f"{k}={_placeholder(k)}" if v == REDACTED else shlex.quote(f"{k}={v}")]
    for k in c.get("env_without_value") or []:
        words += ["-e", shlex.quote(k)]
    if c.get("entrypoint"):
        words += ["--entrypoint", shlex.quote(c["entrypoint"][0])]
    words.append(shlex.quote(str(image)))
    words += _argv_words([*(c.get("entrypoint") or [])[1:], *(c.get("cmd") or [])])
    return " ".join(words)

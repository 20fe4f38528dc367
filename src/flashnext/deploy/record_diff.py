"""Compare two deployment records, and turn one back into the launch that made it.

:func:`record_diff` separates what was changed (launch flags, environment, packages, image,
checkpoint: the *variables*) from what the server reported differently as a consequence
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
from flashnext.records import REDACTED, check_record

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


class RecordDiffError(FlashnextError):
    """Records that cannot be compared or restored."""


@dataclass(frozen=True)
class Change:
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


def record_diff(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[Change]:
    """What changed from record ``a`` to ``b`` (capture times and pids ignored).

    Raises:
        RecordError: either is not a deployment record.
    """
    for rec, name in ((a, "first record"), (b, "second record")):
        check_record(rec, kind="flashnext.deploy.record", source=name)
    out: list[Change] = []
    for flag, x, y in _pairs(_flags(a), _flags(b)):
        out.append(Change(_flag_group(flag), flag, x, y, True))
    env_a = (a.get("launch") or {}).get("env") or {}
    env_b = (b.get("launch") or {}).get("env") or {}
    out += [Change("environment", k, x, y, True) for k, x, y in _pairs(env_a, env_b)]
    out += [
        Change("runtime", f"package {k}", x, y, True)
        for k, x, y in _pairs(a.get("packages") or {}, b.get("packages") or {})
    ]
    cont_a = (a.get("launch") or {}).get("container") or {}
    cont_b = (b.get("launch") or {}).get("container") or {}
    for key in ("image", "image_id", "repo_digests", "mounts", "gpus", "shm_size", "ipc_mode"):
        if cont_a.get(key) != cont_b.get(key):
            out.append(
                Change("runtime", f"container {key}", cont_a.get(key), cont_b.get(key), True)
            )
    ck_a, ck_b = a.get("checkpoint") or {}, b.get("checkpoint") or {}
    for key in ("path", "revision", "config_sha256", "index_sha256", "weights"):
        if ck_a.get(key) != ck_b.get(key):
            out.append(Change("model", f"checkpoint {key}", ck_a.get(key), ck_b.get(key), True))
    srv_a, srv_b = a.get("server") or {}, b.get("server") or {}
    if srv_a.get("version") != srv_b.get("version"):
        out.append(
            Change("runtime", "server version", srv_a.get("version"), srv_b.get("version"), False)
        )
    if srv_a.get("models") != srv_b.get("models"):
        out.append(
            Change("memory", "served models", srv_a.get("models"), srv_b.get("models"), False)
        )
    for k, x, y in _pairs(srv_a.get("cache_config") or {}, srv_b.get("cache_config") or {}):
        out.append(Change("memory", f"cache_config {k}", x, y, False))
    for key, group in (("gpus", "memory"), ("host_memory_bytes", "memory")):
        if a.get(key) != b.get(key):
            out.append(Change(group, key, a.get(key), b.get(key), False))
    return out


def variables_changed(changes: list[Change]) -> int:
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
    check_record(record, kind="flashnext.deploy.record")
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


def _docker_run(launch: Mapping[str, Any], env: Mapping[str, str]) -> str:
    c = launch.get("container") or {}
    digests = c.get("repo_digests") or []
    image = digests[0] if digests else (c.get("image_id") or c.get("image"))
    words = ["docker", "run", "-d"]
    if c.get("name"):
        words += ["--name", shlex.quote(c["name"])]
    for gpu in c.get("gpus") or []:
        ids = gpu.get("ids")
        spec = (
            f"device={','.join(ids)}"
            if ids
            else ("all" if gpu.get("count") == -1 else str(gpu.get("count")))
        )
        words += ["--gpus", shlex.quote(spec)]
    for key, flag in (
        ("network_mode", "--network"),
        ("ipc_mode", "--ipc"),
        ("shm_size", "--shm-size"),
    ):
        if c.get(key):
            words += [flag, shlex.quote(str(c[key]))]
    for m in c.get("mounts") or []:
        words += [
            "-v",
            shlex.quote(f"{m['source']}:{m['destination']}" + ("" if m.get("rw", True) else ":ro")),
        ]
    for k, v in sorted(env.items()):
        words += ["-e", f"{k}={_placeholder(k)}" if v == REDACTED else shlex.quote(f"{k}={v}")]
    if c.get("entrypoint"):
        words += ["--entrypoint", shlex.quote(c["entrypoint"][0])]
    words.append(shlex.quote(str(image)))
    words += _argv_words([*(c.get("entrypoint") or [])[1:], *(c.get("cmd") or [])])
    return " ".join(words)

"""The planned ``vllm serve`` command line, read into the few settings the checks need.

Only what the checks use is interpreted; every other flag is kept verbatim in ``raw``. Both
``--flag value`` and ``--flag=value`` are accepted, and ``-tp`` as vLLM spells it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from flashnext.errors import FlashnextError
from flashnext.numbers import AUTO_MODEL_LEN, NumberError, human_int, model_len

#: Flags that take no value (vLLM's store_true flags the checks care about, and their negations).
_SWITCHES = {
    "--enable-expert-parallel",
    "--no-enable-expert-parallel",
    "--enforce-eager",
    "--enable-prefix-caching",
    "--no-enable-prefix-caching",
    "--trust-remote-code",
}
_ALIASES = {"-tp": "--tensor-parallel-size", "-pp": "--pipeline-parallel-size"}
#: Integer flags vLLM (0.32, 0.33) reads with ``human_readable_int``: 1k = 1,000, 1K = 1,024.
HUMAN_READABLE = {
    "--max-num-batched-tokens", "--max-num-scheduled-tokens", "--kv-cache-memory-bytes",
    "--safetensors-prefetch-block-size", "--max-num-queued-tokens", "--max-model-len",
}  # fmt: skip
#: vLLM 0.32's own lower bounds (pydantic ``Field(ge=...)`` in vllm/config/) for the integer
#: flags a check may read; ``--kv-cache-memory-bytes`` has none there.
MINIMUM = {
    "--max-num-seqs": 1, "--max-num-batched-tokens": 1, "--tensor-parallel-size": 1,
    "--pipeline-parallel-size": 1, "--data-parallel-size": 1, "--block-size": 1,
    "--kv-cache-memory-bytes": 0,
}  # fmt: skip


class ServeArgsError(FlashnextError, ValueError):
    """The planned vLLM arguments cannot be read (bad value, bad JSON)."""


@dataclass(frozen=True)
class ServeArgs:
    """Settings read from ``vllm serve`` arguments and the serving environment."""

    raw: tuple[str, ...]
    flags: Mapping[str, str | bool]
    env: Mapping[str, str] = field(default_factory=dict)

    def get(self, flag: str, default: Any = None) -> Any:
        return self.flags.get(flag, default)

    def int_flag(self, flag: str, minimum: int = 1) -> int | None:
        """The integer value of ``flag`` as vLLM reads it (``128k`` where vLLM accepts it);
        None when absent.

        Raises:
            ServeArgsError: not an integer vLLM accepts, or below ``minimum``.
        """
        value = self.flags.get(flag)
        if value is None or isinstance(value, bool):
            return None
        number = vllm_int(flag, str(value))
        if number < minimum:
            raise ServeArgsError(f"{flag} {value!r}: expected an integer >= {minimum}")
        return number

    @property
    def max_model_len(self) -> int | None:
        """``--max-model-len``; None when absent or ``auto``/``-1`` (vLLM then picks the longest
        that fits in memory).

        Raises:
            ServeArgsError: any other value below 1, or not an integer.
        """
        value = self.flags.get("--max-model-len")
        if value is None or isinstance(value, bool):
            return None
        try:
            return model_len(value)
        except NumberError as exc:
            raise ServeArgsError(f"--max-model-len {exc}") from None

    @property
    def max_model_len_auto(self) -> bool:
        """``--max-model-len auto`` (or ``-1``) was given."""
        value = self.flags.get("--max-model-len")
        return isinstance(value, str) and value.strip().lower() in AUTO_MODEL_LEN

    def json_flag(self, flag: str) -> dict[str, Any]:
        value = self.flags.get(flag)
        if value is None or isinstance(value, bool):
            return {}
        try:
            data = json.loads(str(value))
        except json.JSONDecodeError as exc:
            raise ServeArgsError(f"{flag}: not valid JSON ({exc.msg}): {value!r}") from None
        if not isinstance(data, dict):
            raise ServeArgsError(f"{flag}: expected a JSON object, found {value!r}")
        return data

    @property
    def moe_backend(self) -> str | None:
        value = self.flags.get("--moe-backend")
        return None if value is None or isinstance(value, bool) else str(value)

    @property
    def expert_parallel(self) -> bool:
        return bool(self.flags.get("--enable-expert-parallel")) and not self.flags.get(
            "--no-enable-expert-parallel"
        )

    @property
    def tensor_parallel_size(self) -> int:
        return self.int_flag("--tensor-parallel-size") or 1

    @property
    def speculative_config(self) -> dict[str, Any]:
        return self.json_flag("--speculative-config")

    @property
    def ple_cpu_offload(self) -> bool:
        """vLLM keeps the PLE table in pinned host RAM unless engram cpu_offload is false or
        (0.34) disk_offload is true; the JSON and dotted ``--engram-config`` forms are read."""
        from flashnext.integrations.vllm.engram import command_line_engram

        try:
            engram = command_line_engram(self.raw)
        except FlashnextError:
            return True  # vLLM's default; the engram-config check reports the bad value
        return (
            engram.get("cpu_offload", True) is not False and engram.get("disk_offload") is not True
        )


def vllm_int(flag: str, value: str) -> int:
    """``value`` read as vLLM reads ``flag``: ``human_readable_int`` for :data:`HUMAN_READABLE`
    (:func:`flashnext.numbers.human_int`), else ``int()``.

    Raises:
        ServeArgsError: vLLM would refuse it.
    """
    try:
        return human_int(value, human=flag in HUMAN_READABLE)
    except NumberError as exc:
        raise ServeArgsError(f"{flag} {exc}") from None


def parse_serve_args(
    argv: Sequence[str], env: Mapping[str, str] | None = None, strict: bool = False
) -> ServeArgs:
    """Read ``vllm serve`` arguments (with or without the leading ``vllm serve MODEL``).

    ``strict``: also refuse, before any check runs, an integer flag vLLM would refuse
    (:data:`MINIMUM`, ``--max-model-len``); a recorded launch is read without it.

    Raises:
        ServeArgsError: a flag that needs a value is last on the line; with ``strict``, a value
            vLLM refuses.
    """
    args = list(argv)
    if args[:2] == ["vllm", "serve"]:
        args = args[2:]
    flags: dict[str, str | bool] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("-"):
            flags.setdefault("model", arg)
            i += 1
            continue
        name, eq, value = arg.partition("=")
        if name.startswith("--"):  # vLLM's parser takes --max_model_len for --max-model-len
            name = name.replace("_", "-")
        name = _ALIASES.get(name, name)
        if eq:
            flags[name] = value
        elif name in _SWITCHES or i + 1 >= len(args) or args[i + 1].startswith("--"):
            if name not in _SWITCHES and i + 1 >= len(args):
                raise ServeArgsError(f"{name}: expects a value, found the end of the arguments")
            flags[name] = True
        else:
            flags[name] = args[i + 1]
            i += 1
        i += 1
    parsed = ServeArgs(tuple(argv), flags, dict(env or {}))
    if strict:
        for flag, minimum in MINIMUM.items():
            parsed.int_flag(flag, minimum)
        _ = parsed.max_model_len
    return parsed

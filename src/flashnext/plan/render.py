"""Plain-text views of a plan and of an explained log (one screen each)."""

from __future__ import annotations

from typing import Any

from flashnext.plan.logs import Event
from flashnext.plan.planner import Plan
from flashnext.plan.sizes import gib


def _table(title: str, items: list[Any], total_label: str) -> list[str]:
    lines = [title]
    for i in items:
        lines.append(f"  {i.name:<46} {gib(i.bytes):>12}  {i.note}")
    lines.append(f"  {total_label:<46} {gib(sum(i.bytes for i in items)):>12}")
    return lines


def plan_text(plan: Plan) -> str:
    """The plan as text: breakdowns, KV layout, limits, problems, options, assumptions."""
    req, fit, lay = plan.request, plan.fit, plan.layout
    s = plan.shape
    out = [
        f"model {plan.model}: {s.architecture}, {s.num_attention} attention + {s.num_linear} "
        f"linear-attention layers, {len(s.ple_layers)} PLE layers, weights from {plan.weights_source}",
        "",
        *_table(
            f"device (per rank, tp {req.tp}): {gib(req.gpu_memory)} x "
            f"{req.gpu_memory_utilization} = {gib(req.gpu_memory * req.gpu_memory_utilization)}",
            plan.device_items,
            "non-KV total",
        ),
        f"  {'KV cache pool':<46} {gib(max(0, fit.available_bytes)):>12}"
        + ("  --kv-cache-memory" if req.kv_cache_memory is not None else "")
        + (f"  ({gib(-fit.available_bytes)} short)" if fit.available_bytes < 0 else ""),
        "",
        *_table("host", plan.host_items, "total"),
        "",
        "KV cache (vLLM's rules)",
        f"  attention: {plan.kv_bytes_per_token:,} B/token over all layers; "
        f"page {lay.attention_page_bytes:,} B per layer at block {lay.block_size}",
    ]
    if lay.state_page_bytes:
        out.append(
            f"  state: {plan.state_bytes_per_sequence:,} B/sequence; largest page "
            f"{lay.state_page_bytes:,} B padded to {lay.padded_state_page_bytes:,} B"
        )
    kinds: dict[str, int] = {}
    for g in lay.groups:
        kinds[g.kind] = kinds.get(g.kind, 0) + 1
    out += [
        f"  groups: {', '.join(f'{n} {k}' for k, n in kinds.items())}; "
        f"{lay.bytes_per_block:,} B per block; {fit.num_blocks:,} blocks",
        f"  KV cache size: {fit.kv_cache_tokens:,} tokens, maximum concurrency for "
        f"{fit.max_model_len:,} tokens per request: {fit.max_concurrency:.2f}x",
        "",
        "answers",
        f"  largest max_model_len (one request, vLLM's check): {plan.max_model_len_one:,}",
        f"  largest max_model_len with {req.max_num_seqs} sequences all at full length: "
        f"{plan.max_model_len_all:,}",
    ]
    if s.num_linear:
        out.append(
            f"  largest max_num_seqs (state blocks, CUDA graphs): {plan.max_num_seqs_graphs:,}"
        )
    out.append(f"  sequences whose state and first block fit: {plan.max_num_seqs_state:,}")
    out.append("")
    out += ["FITS" if plan.fits else "DOES NOT FIT"] + [f"  - {p}" for p in plan.problems]
    if plan.suggestions:
        out.append("options, cheapest first")
        out += [f"  {o['change']:<36} cost: {o['cost']}; {o['result']}" for o in plan.suggestions]
    out += ["", "assumptions"] + [f"  - {a}" for a in plan.assumptions]
    return "\n".join(out)


def events_text(events: list[Event]) -> str:
    """Recognised events, failures first, each with its numbers and options."""
    if not events:
        return "no memory-relevant vLLM events recognised"
    out = []
    for e in sorted(events, key=lambda e: (not e.failure, e.line)):
        tag = "FAIL" if e.failure else "info"
        nums = ", ".join(f"{k}={v}" for k, v in e.values.items())
        out.append(f"[{tag}] line {e.line}: {e.kind}: {e.summary}" + (f" ({nums})" if nums else ""))
        for o in e.options:
            why = o.get("why") or o.get("result") or ""
            out.append(f"    -> {o['change']}  (cost: {o['cost']}{'; ' + why if why else ''})")
    return "\n".join(out)

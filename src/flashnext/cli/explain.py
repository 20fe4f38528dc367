"""``flashnext explain LOG|-``: what a vLLM log says about memory, and what to change.

Thin: reads the log, calls :func:`flashnext.plan.logs.explain`; with ``--model`` re-plans each
KV-capacity or Mamba-block failure with the pool the log reports and prints the plan that
would have fit. Output to stdout (``--json``: a ``flashnext.explain`` record).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import click

from flashnext import records
from flashnext.cli.plan import GIB, build_request, deployment_options, read_lines
from flashnext.plan.advice import options
from flashnext.plan.logs import Event
from flashnext.plan.logs import explain as explain_log
from flashnext.plan.planner import calibrate_headroom, load_model, make_plan
from flashnext.plan.render import events_text, plan_text


def _replan(model_path: str, event: Event, kw: dict[str, Any]) -> tuple[Any, list[dict[str, Any]]]:
    """The plan for the failed deployment, headroom calibrated to the log's KV pool."""
    model = load_model(model_path)
    req = build_request(kw)
    if event.kind == "kv_capacity_error":
        req = dataclasses.replace(req, max_model_len=event.values["max_model_len"])
        available = int(event.values["available_gib"] * GIB)
        if req.kv_cache_memory is None:
            req = dataclasses.replace(req, headroom=calibrate_headroom(model, req, available))
    if event.kind == "mamba_blocks_error":
        req = dataclasses.replace(req, max_num_seqs=event.values["max_num_seqs"])
    plan = make_plan(model, req, [f"calibrated to the log's line {event.line}"])
    plan.suggestions = options(model, plan) if plan.problems else []
    return plan, plan.suggestions


@click.command("explain")
@click.argument("log")
@click.option(
    "--model",
    "model_path",
    type=click.Path(exists=True),
    help="Checkpoint directory or config.json: also print the plan that would fit.",
)
@deployment_options
@click.option("--json", "as_json", is_flag=True, help="Print a flashnext.explain record.")
def explain(log: str, model_path: str | None, as_json: bool, **kw: Any) -> None:
    """Explain the memory events of a vLLM log (a file, or - for stdin)."""
    events = explain_log(read_lines(log))
    plans = []
    if model_path:
        for e in events:
            if e.kind in ("kv_capacity_error", "mamba_blocks_error"):
                plans.append((e, *_replan(model_path, e, kw)))
    if as_json:
        payload = {
            "log": log,
            "events": [dataclasses.asdict(e) for e in events],
            "failures": sum(e.failure for e in events),
            "plans": [{"line": e.line, **p.to_dict()} for e, p, _o in plans],
        }
        click.echo(records.dumps(records.make_record("flashnext.explain", payload)), nl=False)
        return
    click.echo(events_text(events))
    for e, p, opts in plans:
        click.echo(f"\nplan for the failure at line {e.line}:\n")
        click.echo(plan_text(p, opts))

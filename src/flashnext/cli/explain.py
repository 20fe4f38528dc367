"""``flashnext explain LOG|-``: what a vLLM log says about memory, and what to change.

Thin: reads the log, calls :func:`flashnext.plan.logs.explain_log`; with ``--model`` re-plans each
KV-capacity or Mamba-block failure with the pool the log reports and prints the plan that
would have fit. Output to stdout (``--json``: a ``flashnext.explain`` record).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import click

from flashnext import records
from flashnext.cli._common import json_option
from flashnext.cli.plan import build_request, deployment_options, read_lines
from flashnext.plan.advice import other_model, replan_failure
from flashnext.plan.logs import explain_log, logged_kv_memory_bytes
from flashnext.plan.model import PlanError
from flashnext.plan.planner import load_model
from flashnext.plan.render import events_text, plan_text


@click.command("explain")
@click.argument("log")
@click.option(
    "--model",
    "model_path",
    type=click.Path(exists=True),
    help="Checkpoint directory or config.json: also print the plan that would fit.",
)
@deployment_options
@json_option(records.PLAN_EXPLAIN)
def explain(log: str, model_path: str | None, as_json: bool, **kw: Any) -> None:
    """Explain the memory events of a vLLM log (a file, or - for stdin)."""
    events = explain_log(read_lines(log))
    plans = []
    if model_path:
        model = load_model(model_path)
        req = build_request(kw, model)
        for e in events:
            if e.kind in ("kv_capacity_error", "mamba_blocks_error"):
                plan = replan_failure(model, req, e, logged_kv_memory_bytes(events))
                if problem := other_model(plan, e):
                    raise PlanError(f"--model {model_path}: {problem}")
                plans.append((e, plan))
    if as_json:
        payload = {
            "log": log,
            "events": [dataclasses.asdict(e) for e in events],
            "failures": sum(e.failure for e in events),
            "plans": [{"line": e.line, **p.to_dict()} for e, p in plans],
        }
        click.echo(records.dumps(records.make_record(records.PLAN_EXPLAIN, payload)), nl=False)
        return
    click.echo(events_text(events))
    for e, p in plans:
        click.echo(f"\nplan for the failure at line {e.line}:\n")
        click.echo(plan_text(p))

"""``flashnext check``: will this ``vllm serve`` boot? A table of check / status / why / fix."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from flashnext.cli._common import err_console, json_option, out_console
from flashnext.records import DEPLOY_CHECK


def _size(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    from flashnext.plan.sizes import parse_size

    if value is None:
        return None
    try:
        return parse_size(value, "--host-memory")
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


@click.command("check", context_settings={"ignore_unknown_options": True})
@click.option(
    "--model",
    "model_dir",
    required=True,
    type=click.Path(path_type=Path),
    help="The checkpoint directory vLLM will load.",
)
@click.option(
    "--gpu",
    default="auto",
    show_default=True,
    help="auto (NVML) or smXY[,MEMORY][,cudaN.M], e.g. sm120,96GiB,cuda13.0.",
)
@click.option("--host-memory", callback=_size, help="Host RAM for the workers, e.g. 64GiB.")
@click.option("--vllm-version", help="The vLLM release you will boot (default: the installed one).")
@click.option(
    "--env",
    "env_pairs",
    multiple=True,
    metavar="NAME=VALUE",
    help="Serving environment (repeatable); default: this shell's environment.",
)
@json_option(DEPLOY_CHECK)
@click.argument("serve_args", nargs=-1, type=click.UNPROCESSED)
def check(
    model_dir: Path, gpu: str, host_memory: int | None, vllm_version: str | None,
    env_pairs: tuple[str, ...], as_json: bool, serve_args: tuple[str, ...],
) -> None:  # fmt: skip
    """Check planned `vllm serve` arguments (after --) against MODEL, GPU and host.

    Exit 1 when a blocking check fails.
    Example: flashnext check --model /models/fn --gpu sm120,96GiB -- --moe-backend b12x
    """
    from flashnext.deploy.check import as_payload, blocking_failures, load_context, run_checks
    from flashnext.deploy.gpu import parse_gpu
    from flashnext.deploy.serve_args import parse_serve_args
    from flashnext.records import dumps, make_record

    env = dict(os.environ)
    for pair in env_pairs:
        name, eq, value = pair.partition("=")
        if not eq or not name:
            raise click.BadParameter(f"{pair!r} is not NAME=VALUE", param_hint="--env")
        env[name] = value
    try:  # a flag's value, refused before any work: a usage error (exit 2), as click's own
        args, spec = parse_serve_args(serve_args, env, strict=True), parse_gpu(gpu)
    except ValueError as exc:  # ServeArgsError, GpuSpecError
        raise click.UsageError(str(exc)) from None
    ctx = load_context(model_dir, args, spec, host_memory, vllm_version)
    checks = run_checks(ctx)
    failed = blocking_failures(checks)
    if as_json:
        record = make_record(DEPLOY_CHECK, as_payload(ctx, checks))
        sys.stdout.write(dumps(record))
    else:
        _print_table(checks)
        for note in ctx.notes:
            err_console.print(f"note: {note}", markup=False, highlight=False)
        verdict = "blocked" if failed else "no blocking problem found"
        out_console.print(f"{len(failed)} blocking failure(s): {verdict}", markup=False)
    if failed:
        sys.exit(1)


def _print_table(checks) -> None:
    from rich.table import Table
    from rich.text import Text

    from flashnext.records import redact
    from flashnext.status import STYLES, label

    table = Table(show_lines=False)
    for col in ("check", "status", "why", "fix"):
        table.add_column(col, overflow="fold")
    for c in checks:
        status = Text(label(c.status), style=STYLES[c.status].colour)
        table.add_row(c.name, status, Text(redact(c.why)), Text(redact(c.fix)))
    out_console.print(table)

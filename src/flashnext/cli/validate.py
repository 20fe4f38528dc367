"""``flashnext validate``: staged checks of a live OpenAI-compatible server, one report.

Parses flags into a :class:`~flashnext.validate.stages.Config`, runs the stages with progress
on stderr (a rich display on a terminal, plain lines otherwise), writes the report and prints a
one-screen summary (or, with ``--json``, the report record) on stdout. Exits 0 only if no
selected stage failed; on SIGINT/SIGTERM the report of the finished stages is written and the
exit status is 128 + the signal number.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from flashnext.cli._common import (
    FiniteRange,
    OutputDir,
    err_console,
    json_option,
    old_spelling,
    out_console,
    server_url,
    show,
)
from flashnext.cli._destination import check_output
from flashnext.errors import ValidationError
from flashnext.records import VALIDATE_AB, VALIDATE_COMPARE, VALIDATE_REPORT, dumps

if TYPE_CHECKING:
    from flashnext.store.destination import ReportDestination
    from flashnext.validate.ab import AbConfig
    from flashnext.validate.ab_answers import RecordedSide
    from flashnext.validate.deployment import DeploymentProbe
    from flashnext.validate.interrupts import Kept
    from flashnext.validate.output import Written
    from flashnext.validate.stages import Config, ValidationResult


def _parse_stages(text: str) -> tuple[str, ...]:
    from flashnext.validate.stages import STAGES

    names = tuple(s.strip() for s in text.split(","))
    unknown = [n or "(an empty item)" for n in names if n not in STAGES]
    if not any(names) or unknown:
        raise click.UsageError(
            f"--stages {text!r}: unknown stage(s) {unknown or '(none given)'}; "
            f"expected a comma-separated subset of {','.join(STAGES)}"
        )
    return names


@click.group("validate", invoke_without_command=True)
@click.option(
    "--url",
    help="Server root, e.g. http://127.0.0.1:8000 (an OpenAI route such as /v1 or "
    "/v1/chat/completions is dropped).",
)
@old_spelling("--model", "--served-model", "model")
@click.option(
    "--served-model", "model", default=None, help="Served model name (default: the first served)."
)
@click.option(
    "--api-key",
    default=None,
    envvar="FLASHNEXT_API_KEY",
    help="Bearer token (or FLASHNEXT_API_KEY).",
)
@click.option(
    "--stages",
    "stages_text",
    default=None,
    help="Comma-separated stages (default: all): "
    "ready,short,long,multimodal,concurrency,prefix-cache,sustained.",
)
@click.option(
    "--out",
    "out_dir",
    type=OutputDir(),
    default=Path("validate-report"),
    show_default=True,
    help="Directory for report.json, report.md, report.png.",
)
@click.option(
    "--force",
    is_flag=True,
    help="Replace report files in --out that flashnext did not write (other files stay).",
)
@json_option(VALIDATE_REPORT)
@click.option(
    "--ready-timeout",
    type=FiniteRange(min=0, min_open=True),
    default=600.0,
    show_default=True,
    help="Seconds to wait for /health.",
)
@click.option(
    "--recovery-timeout",
    type=FiniteRange(min=0, min_open=True),
    default=180.0,
    show_default=True,
    help="Seconds to wait for a server lost during a stage to come back.",
)
@click.option(
    "--timeout",
    "request_timeout",
    type=FiniteRange(min=0, min_open=True),
    default=180.0,
    show_default=True,
    help="Client timeout per request (s).",
)
@click.option(
    "--rounds",
    type=click.IntRange(min=1),
    default=3,
    show_default=True,
    help="Concurrency stage: rounds.",
)
@click.option(
    "--concurrency",
    type=click.IntRange(min=1),
    default=16,
    show_default=True,
    help="Concurrency stage: requests per round.",
)
@click.option(
    "--max-tokens",
    type=click.IntRange(min=1),
    default=700,
    show_default=True,
    help="Concurrency stage: max_tokens per request.",
)
@click.option(
    "--temperature",
    type=FiniteRange(min=0, max=2),
    default=0.8,
    show_default=True,
    help="Concurrency and sustained.",
)
@click.option(
    "--long-fraction",
    type=FiniteRange(min=0, max=1, min_open=True, max_open=True),
    default=0.9,
    show_default=True,
    help="Long stage: prompt length as a fraction of max_model_len.",
)
@click.option("--long-max-tokens", type=click.IntRange(min=1), default=32, show_default=True)
@click.option(
    "--prefix-requests",
    type=click.IntRange(min=1),
    default=4,
    show_default=True,
    help="Prefix-cache stage: requests sharing the prefix.",
)
@click.option(
    "--sustained-seconds",
    type=FiniteRange(min=0, min_open=True),
    default=60.0,
    show_default=True,
)
@click.option("--sustained-concurrency", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--sustained-max-tokens", type=click.IntRange(min=1), default=128, show_default=True)
@click.option(
    "--sustained-max-requests",
    type=click.IntRange(min=1),
    default=10_000,
    show_default=True,
    help="Sustained stage: stop after this many requests even before the duration.",
)
@click.option(
    "--probe-interval",
    type=FiniteRange(min=0, min_open=True),
    default=0.5,
    show_default=True,
    help="Seconds between /metrics scrapes and NVML samples.",
)
@click.option(
    "--gpu-index",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="NVML GPU index to sample.",
)
@click.option(
    "--nvml/--no-nvml",
    default=True,
    show_default=True,
    help="Sample GPU memory through NVML (meaningful on the server host).",
)
@click.option(
    "--container",
    default=None,
    help="docker/podman container of the server: its RestartCount is watched.",
)
@click.option("--no-png", is_flag=True, help="Skip report.png (no matplotlib needed).")
@click.pass_context
def validate(ctx: click.Context, **opts: object) -> None:
    """Validate a live OpenAI-compatible server stage by stage; exit 0 only if none failed.

    \b
    flashnext validate --url http://127.0.0.1:8000 --out report/
    flashnext validate compare old/report.json new/report.json
    """
    if ctx.invoked_subcommand is not None:
        return
    if not opts["url"]:
        raise ValidationError("--url is required, e.g. --url http://127.0.0.1:8000")
    code = run_cli(opts, sys.argv)
    sys.exit(code)


def _config(opts: dict[str, Any]) -> Config:
    """The run's :class:`Config` from parsed flags, each checked (one-line errors)."""
    from flashnext.validate.stages import STAGES, Config

    # Ranges are click types on the options (exit 2 before any work).
    return Config(
        url=server_url(opts["url"]),
        model=opts["model"],
        api_key=opts["api_key"],
        stages=STAGES if opts["stages_text"] is None else _parse_stages(opts["stages_text"]),
        ready_timeout_s=opts["ready_timeout"],
        recovery_timeout_s=opts["recovery_timeout"],
        request_timeout_s=opts["request_timeout"],
        rounds=opts["rounds"],
        concurrency=opts["concurrency"],
        max_tokens=opts["max_tokens"],
        temperature=opts["temperature"],
        long_fraction=opts["long_fraction"],
        long_max_tokens=opts["long_max_tokens"],
        prefix_requests=opts["prefix_requests"],
        sustained_s=opts["sustained_seconds"],
        sustained_concurrency=opts["sustained_concurrency"],
        sustained_max_tokens=opts["sustained_max_tokens"],
        sustained_max_requests=opts["sustained_max_requests"],
        probe_interval_s=opts["probe_interval"],
        gpu_index=opts["gpu_index"],
        nvml=opts["nvml"],
        container=opts["container"],
    )


def run_cli(opts: dict[str, Any], argv: list[str]) -> int:
    """Build the config from parsed flags, run, write and print; return the exit status."""
    from flashnext.validate.interrupts import deferred, kept_for_later
    from flashnext.validate.report import REPORT_FILES, build_report, check_out_dir, write_report

    cfg = _config(opts)
    out_dir: Path = opts["out_dir"]
    # Before the run, not after it: a report that cannot be written loses every stage's evidence.
    check_output(out_dir, hint="--out")
    check_out_dir(out_dir, png=not opts["no_png"])
    dest = _report_destination(out_dir, REPORT_FILES[: 2 if opts["no_png"] else 3], opts["force"])
    from flashnext.deploy.probe import deployment_probe

    probe = deployment_probe(cfg.api_key, cfg.container)
    # Locked from before the run until the report is written: a second run is refused at once.
    with dest, kept_for_later() as kept:  # a signal after the last stage: still written
        result = asyncio.run(_run_with_progress(cfg, probe))
        report = build_report(result, argv)
        with deferred():  # a signal now would leave the report half written
            written = write_report(report, out_dir, png=not opts["no_png"])
            # stdout either way: a report that could not be written (a full disk) still shows.
            if opts["as_json"]:
                sys.stdout.write(dumps(report, indent=None))
                sys.stdout.flush()
            else:
                _print_summary(report)
            _tell_written(written)
    if result.interrupted is not None:
        stop = result.interrupted
        done = sum(s.status in ("pass", "fail") for s in result.stages)
        click.echo(
            f"interrupted by {stop.signal} during {stop.stage or 'start-up'}: the report holds "
            f"the {done} stage(s) that finished",
            err=True,
        )
        return 128 + signal.Signals[stop.signal].value
    if kept.signal is not None:
        return _late_signal(kept.signal, "every stage had finished")
    if written.failed:
        return 1
    return 0 if report["passed"] else 1


def _report_destination(out_dir: Path, names: Sequence[str], force: bool) -> ReportDestination:
    """The report directory, refused (a usage error, before any work) where its rule says."""
    from flashnext.store.destination import ReportDestination

    dest = ReportDestination(out_dir, names, force=force)
    problem = dest.problem()
    if problem:
        raise click.BadParameter(problem, param_hint="--out")
    return dest


def _late_signal(sig: signal.Signals, what: str) -> int:
    """Say that ``sig`` came after the work (the report is whole) and return its exit status."""
    click.echo(f"interrupted by {sig.name} after {what}: the report is complete", err=True)
    return 128 + sig.value


def _tell_written(written: Written) -> None:
    """The files written and the notes on stderr, then an ``error:`` line per file that was
    not (the summary or record is on stdout already)."""
    if written.paths or written.notes:
        click.echo("wrote " + ", ".join(str(p) for p in written.paths)
                   + "".join(f"; {n}" for n in written.notes), err=True)  # fmt: skip
    for line in written.failed:
        click.echo(f"error: {line}", err=True)


class _LineProgress:
    """Progress as plain lines on stderr when it is not a terminal (a log, CI, a pipe).

    A line per stage start, end and notice; repeated updates of one stage at most every
    :attr:`EVERY_S` seconds, so a long wait is visible but not a flood.
    """

    EVERY_S = 5.0

    def __init__(self) -> None:
        self.stage: str | None = None
        self.last = 0.0

    def __call__(self, stage: str, message: str, fraction: float | None) -> None:
        now = time.monotonic()
        repeat = stage == self.stage and fraction is not None and 0 < fraction < 1
        if repeat and now - self.last < self.EVERY_S:
            return
        self.stage, self.last = stage, now
        print(f"validate: {stage}: {message}" if stage else f"validate: {message}",
              file=sys.stderr, flush=True)  # fmt: skip


async def _run_with_progress(cfg: Config, probe: DeploymentProbe) -> ValidationResult:
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from flashnext.validate.stages import run_validation

    if not err_console.is_terminal:
        return await run_validation(cfg, _LineProgress(), probe)
    with Progress(
        SpinnerColumn(),
        TextColumn("[bold]{task.fields[stage]:<13}"),
        BarColumn(),
        TextColumn("{task.description}", markup=False),
        TimeElapsedColumn(),
        console=err_console,
        transient=False,
    ) as progress:
        task = progress.add_task("starting", total=1.0, stage="")

        def update(stage: str, message: str, fraction: float | None) -> None:
            if fraction is None:
                progress.update(task, description=message, stage=stage)
            else:
                progress.update(task, description=message, stage=stage, completed=fraction)

        return await run_validation(cfg, update, probe)


def _print_summary(report: dict[str, Any]) -> None:
    from rich.table import Table
    from rich.text import Text

    from flashnext.status import STYLES, label
    from flashnext.validate.report import key_text

    console = out_console
    verdict = "PASSED" if report["passed"] else "FAILED"
    if report["interrupted"]:
        verdict = f"INTERRUPTED ({report['interrupted']['signal']})"
    title = Text(f"flashnext validate {report['target']['url']}: ")
    title.append(verdict, style="green" if report["passed"] else "red")
    table = Table(title=title)
    for col in ("stage", "status", "s", "key numbers"):
        table.add_column(col)
    for s in report["stages"]:
        status = label(s["status"]) + (f": {s['reason']}" if s["status"] == "skip" else "")
        table.add_row(
            Text(s["name"]),
            Text(status, style=STYLES[s["status"]].colour),
            f"{s['duration_s']:.1f}",
            Text(key_text(s["key"])),
        )
    show(table)
    for s in report["stages"]:
        for m in s["failures"][:3]:
            console.print(Text.assemble((s["name"], "red"), f": {m}"), highlight=False)
    nvml = report["probes"]["nvml"]
    console.print(Text(f"GPU memory: {nvml['status']}"), highlight=False)


@validate.command("compare")
@click.argument("a", type=click.Path(path_type=Path))
@click.argument("b", type=click.Path(path_type=Path))
@json_option(VALIDATE_COMPARE)
def compare_cmd(a: Path, b: Path, as_json: bool) -> None:
    """Show what changed between two report.json files (A then B). Exits 1 when a stage that
    passed in A fails in B, so CI can gate on it."""
    from flashnext.validate.report import compare, compare_record, load_report, render_compare

    diff = compare(load_report(a), load_report(b))
    if as_json:
        sys.stdout.write(dumps(compare_record(diff, sys.argv), indent=None))
    else:
        click.echo(render_compare(diff))
    if diff["regressions"]:
        raise SystemExit(1)


# ---- flashnext validate ab: A/B equivalence of two deployments (flashnext.validate.ab) ----
def _ab_url(ctx: click.Context, param: click.Parameter, value: str) -> str:
    try:
        return server_url(value, f"--{param.name}")
    except ValidationError:
        raise click.BadParameter(
            f"{value!r}: expected a server root like http://127.0.0.1:8000"
        ) from None


def _ab_baseline(ctx: click.Context, param: click.Parameter, value: str) -> str | Path:
    """A server root, or (a path) the answers a baseline recorded in an earlier run."""
    if "://" in value:
        return _ab_url(ctx, param, value)
    path = Path(value)
    if not path.exists():
        raise click.BadParameter(
            f"{value!r}: expected a server root like http://127.0.0.1:8000, or the answers an "
            "earlier run recorded (its --out directory, or the baseline-answers.jsonl in it)"
        )
    return path


@validate.command("ab")
@click.option(
    "--baseline",
    required=True,
    callback=_ab_baseline,
    help="Baseline server root, or an earlier run's --out directory (its recorded "
    "baseline-answers.jsonl) to compare against a server that is gone.",
)
@click.option(
    "--candidate",
    default=None,
    callback=lambda ctx, param, v: None if v is None else _ab_url(ctx, param, v),
    help="Candidate server root. Without one, only the baseline is asked and its answers "
    "recorded in --out, for a later --baseline DIR.",
)
@click.option(
    "--prompts",
    "prompts_file",
    type=click.Path(path_type=Path),
    default=None,
    help="JSONL prompt set (default: the shipped set; format in docs/ab.md).",
)
@click.option("--max-tokens", default=64, show_default=True, type=click.IntRange(min=1))
@click.option(
    "--top-logprobs",
    default=20,
    show_default=True,
    type=click.IntRange(min=1),
    help="K: log-probabilities per position (vLLM allows up to --max-logprobs, 20).",
)
@old_spelling("--baseline-model", "--baseline-served-model", "baseline_model")
@click.option(
    "--baseline-served-model",
    "baseline_model",
    default=None,
    help="Model name the baseline serves (default: its first).",
)
@old_spelling("--candidate-model", "--candidate-served-model", "candidate_model")
@click.option(
    "--candidate-served-model",
    "candidate_model",
    default=None,
    help="Model name the candidate serves (default: its first).",
)
@click.option("--api-key", default=None, envvar="FLASHNEXT_API_KEY", help="Bearer token.")
@click.option("--seed", default=0, show_default=True)
@click.option(
    "--concurrency",
    default=1,
    show_default=True,
    type=click.IntRange(min=1),
    help="Prompts in flight per server (1 keeps batches, hence numerics, alike).",
)
@click.option(
    "--timeout",
    "timeout_s",
    default=180.0,
    show_default=True,
    type=FiniteRange(min=0, min_open=True),
    help="Client timeout per request (s).",
)
@click.option("--min-top1", default=0.97, show_default=True, type=FiniteRange(0, 1))
@click.option("--max-mean-kl", default=0.01, show_default=True, type=FiniteRange(min=0))
@click.option("--min-token-agreement", default=0.5, show_default=True, type=FiniteRange(0, 1))
@click.option(
    "--out",
    "out_dir",
    type=OutputDir(),
    default=Path("ab-report"),
    show_default=True,
    help="Directory for ab.json, ab.md, ab.png.",
)
@click.option(
    "--force",
    is_flag=True,
    help="Replace ab files in --out that flashnext did not write (other files stay).",
)
@json_option(VALIDATE_AB)
@click.option("--no-png", is_flag=True, help="Skip ab.png.")
@click.pass_context
def ab_cmd(ctx: click.Context, **o: Any) -> None:
    """Do two servers give the same answers? Exit 0 pass, 1 fail or error, 2 bad usage.

    \b
    flashnext validate ab --baseline http://127.0.0.1:8000 --candidate http://127.0.0.1:8001
    flashnext validate ab --baseline http://127.0.0.1:8000 --out before/   # record only
    flashnext validate ab --baseline before/ --candidate http://127.0.0.1:8000
    """
    from flashnext.records import redact
    from flashnext.validate.ab_answers import ANSWERS_FILE
    from flashnext.validate.ab_report import AB_FILES
    from flashnext.validate.interrupts import kept_for_later
    from flashnext.validate.output import check_writable

    recorded = _recorded_baseline(ctx, o)
    if recorded and o["candidate"] is None:
        raise click.UsageError("--candidate: a recorded baseline needs a live candidate")
    answers_in = recorded.source if recorded else None
    check_output(o["out_dir"], [o["prompts_file"], answers_in], hint="--out")
    cfg = _ab_config(o, recorded)
    names = [*AB_FILES[: 2 if o["no_png"] else 3], *([] if recorded else [ANSWERS_FILE])]
    names = names if o["candidate"] else [ANSWERS_FILE]
    # Before the run: a report that cannot be written loses every prompt's evidence.
    check_writable(o["out_dir"], names)
    dest = _report_destination(o["out_dir"], names, o["force"])
    if not recorded and o["candidate"] is not None and o["candidate"] == o["baseline"]:
        err_console.print(
            f"warning: --baseline and --candidate are the same server "
            f"({redact(o['baseline'])}): it "
            "can only agree with itself", markup=False, highlight=False, soft_wrap=True,
        )  # fmt: skip
    with dest, kept_for_later() as kept:  # a signal after the last prompt: still written
        _ab_run_and_write(ctx, o, cfg, kept)


def _ab_run_and_write(ctx: click.Context, o: dict[str, Any], cfg: AbConfig, kept: Kept) -> None:
    """Run the comparison (or record the baseline), write and print; exit with its status."""
    from flashnext.records import make_record
    from flashnext.validate.ab import KIND, SCHEMA_VERSION
    from flashnext.validate.ab_answers import answers_header, render_answers
    from flashnext.validate.ab_report import render_markdown, write_ab
    from flashnext.validate.interrupts import deferred
    from flashnext.validate.output import printable

    payload = _run_ab_with_progress(cfg)
    if o["candidate"] is None:
        _record_only(ctx, payload, o["out_dir"], o["as_json"], kept)
    answers = payload.pop("baseline_answers")
    record = make_record(KIND, payload, schema_version=SCHEMA_VERSION, secrets=[o["api_key"] or ""])
    text = None if answers is None else render_answers(answers_header(record), answers)
    with deferred():  # a signal now would leave the report half written
        written = write_ab(record, o["out_dir"], png=not o["no_png"], answers=text)
        if o["as_json"]:
            sys.stdout.write(dumps(record, indent=None))
            sys.stdout.flush()
        else:
            click.echo(printable(render_markdown(record)))
        _tell_written(written)
    stop = record["interrupted"]
    if stop:
        click.echo(
            f"interrupted by {stop['signal']}: the report holds the {stop['prompts_done']} of "
            f"{stop['prompts_total']} prompt(s) that finished",
            err=True,
        )
        ctx.exit(128 + signal.Signals[stop["signal"]].value)
    if kept.signal is not None:
        ctx.exit(_late_signal(kept.signal, "every prompt had finished"))
    ctx.exit(0 if record["verdict"]["passed"] and not written.failed else 1)


def _ab_config(o: dict[str, Any], recorded: RecordedSide | None) -> AbConfig:
    """The run's settings from the flags (``o``) and the recorded baseline, if any."""
    from flashnext.validate.ab import AbConfig, Thresholds
    from flashnext.validate.ab_prompts import load_prompts

    source = f"recorded: {recorded.source}" if recorded else str(o["prompts_file"] or "default")
    return AbConfig(
        baseline_url=str(recorded.source) if recorded else o["baseline"],
        candidate_url=o["candidate"],
        prompts=recorded.prompts if recorded else load_prompts(o["prompts_file"]),
        prompts_source=source,
        baseline_model=o["baseline_model"],
        candidate_model=o["candidate_model"],
        api_key=o["api_key"],
        max_tokens=o["max_tokens"],
        top_logprobs=o["top_logprobs"],
        seed=o["seed"],
        concurrency=o["concurrency"],
        timeout_s=o["timeout_s"],
        thresholds=Thresholds(o["min_top1"], o["max_mean_kl"], o["min_token_agreement"]),
        recorded_baseline=recorded,
    )


def _record_only(
    ctx: click.Context, payload: dict[str, Any], out_dir: Path, as_json: bool, kept: Kept
) -> None:
    """Write the baseline's answers (:func:`~flashnext.validate.ab.record_baseline`'s
    ``payload``), say what was recorded (``--json``: the answers' header record with the
    counts) and exit: 0 when every prompt was recorded, 1 otherwise, 128 + N on a signal."""
    from flashnext.validate.ab_answers import ANSWERS_FILE, answers_header, render_answers
    from flashnext.validate.interrupts import deferred
    from flashnext.validate.output import write_files

    answers, errors, stop = payload["baseline_answers"], payload["errors"], payload["interrupted"]
    header = answers_header(payload)
    text = render_answers(header, answers)
    with deferred():
        written = write_files(out_dir, {ANSWERS_FILE: lambda: text}) if answers else None
        summary = {**header, "recorded": len(answers), "errors": errors,
                   "setup_error": payload["setup_error"], "interrupted": stop}  # fmt: skip
        if as_json:
            sys.stdout.write(dumps(summary, indent=None))
            sys.stdout.flush()
        elif not payload["setup_error"]:  # a server never reached has nothing to count
            server = payload["baseline"]
            click.echo(f"recorded {len(answers)} of {len(payload['config']['prompt_ids'])} "
                       f"prompts of {server['model']} ({server['url']})")  # fmt: skip
        for e in errors:
            click.echo(f"error: prompt {e['id']}: {e['error']['kind']}: {e['error']['message']}",
                       err=True)  # fmt: skip
        if payload["setup_error"]:
            e = payload["setup_error"]
            click.echo(f"error: baseline: {e['kind']}: {e['message']}", err=True)
        if written is not None:
            _tell_written(written)
    if stop:
        ctx.exit(128 + signal.Signals[stop["signal"]].value)
    if kept.signal is not None:
        ctx.exit(_late_signal(kept.signal, "every prompt had finished"))
    ctx.exit(0 if answers and not errors and written and not written.failed else 1)


def _recorded_baseline(ctx: click.Context, o: dict[str, Any]) -> RecordedSide | None:
    """The recorded answers ``--baseline`` names (None for a server), the replayed settings
    put into ``o``; a flag that would change what the baseline was asked is refused."""
    from flashnext.validate.ab_answers import RecordedSide

    if not isinstance(o["baseline"], Path):
        return None
    try:
        recorded = RecordedSide.load(o["baseline"])
    except ValidationError as exc:
        raise click.BadParameter(str(exc), param_hint="--baseline") from None
    for name, flag in (
        ("prompts_file", "--prompts"),
        ("baseline_model", "--baseline-served-model"),
    ):
        if o[name] is not None:
            raise click.UsageError(
                f"{flag}: the recorded baseline {recorded.source} fixes it (its "
                f"{len(recorded.prompts)} prompts, model {recorded.model!r}); leave {flag} out"
            )
    for name, value in recorded.config.items():
        flag = "--" + name.replace("_", "-")
        given = ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT
        if given and o[name] != value:
            raise click.UsageError(
                f"{flag} {o[name]}: the recorded baseline {recorded.source} was asked with "
                f"{flag} {value}, and a replay asks the candidate the same; leave {flag} out"
            )
        o[name] = value
    return recorded


def _run_ab_with_progress(cfg: AbConfig) -> dict[str, Any]:
    """``run_ab`` with a progress bar on a terminal, plain lines otherwise (a log, CI, a pipe)."""
    from rich.progress import Progress

    from flashnext.deploy.probe import deployment_probe
    from flashnext.validate.ab import run_ab

    probe = deployment_probe(cfg.api_key)
    if not err_console.is_terminal:

        def line(done: int, total: int, pid: str) -> None:
            print(f"validate ab: prompt {done}/{total} done ({pid})", file=sys.stderr, flush=True)

        return asyncio.run(run_ab(cfg, line, probe))
    with Progress(console=err_console) as bar:
        task = bar.add_task("prompts", total=len(cfg.prompts))

        def update(done: int, total: int, pid: str) -> None:
            bar.update(task, completed=done, description=pid)

        return asyncio.run(run_ab(cfg, update, probe))

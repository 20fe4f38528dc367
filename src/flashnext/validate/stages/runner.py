"""The runner: the selected stages in order, the probes running throughout, a typed result.

Every stage is wrapped: a restart or an unreachable server seen by the probes while the stage
ran fails the stage and is named in it. The first SIGINT or SIGTERM stops the running stage
(its status becomes ``interrupted``, what it had gathered is kept), skips the rest and returns
the result so that the report of the finished stages is still written; a second one ends the
process at once.
"""

from __future__ import annotations

import asyncio
import signal
import traceback
from collections.abc import Awaitable, Callable
from typing import Any

from flashnext.errors import ValidationError
from flashnext.validate import stats
from flashnext.validate.deployment import Deployment, DeploymentProbe
from flashnext.validate.interrupts import Interrupts
from flashnext.validate.probes import container_restart_count
from flashnext.validate.stages.cache import stage_prefix_cache
from flashnext.validate.stages.config import STAGES, Config
from flashnext.validate.stages.load import stage_concurrency, stage_sustained
from flashnext.validate.stages.result import (
    Interruption,
    ServerEnvironment,
    StageResult,
    ValidationResult,
)
from flashnext.validate.stages.run import ProgressFn, Run
from flashnext.validate.stages.single import (
    stage_long,
    stage_multimodal,
    stage_ready,
    stage_short,
)

StageFn = Callable[[Run, StageResult], Awaitable[None]]

#: The stage functions by name; :data:`~flashnext.validate.stages.config.STAGES` gives the order.
STAGE_FUNCS: dict[str, StageFn] = {
    "ready": stage_ready,
    "short": stage_short,
    "long": stage_long,
    "multimodal": stage_multimodal,
    "concurrency": stage_concurrency,
    "prefix-cache": stage_prefix_cache,
    "sustained": stage_sustained,
}


class _Interrupts(Interrupts):
    """:class:`~flashnext.validate.interrupts.Interrupts` naming the stage it stopped."""

    def __init__(self, run: Run) -> None:
        super().__init__()
        self.run = run
        self.caught: Interruption | None = None
        self.stage: str | None = None

    def on_interrupt(self, sig: signal.Signals) -> None:
        self.caught = Interruption(signal=sig.name, stage=self.stage, t=self.run.now())
        self.run.progress(
            self.stage or "", f"{sig.name}: stopping; the report of finished stages follows", None
        )


def _skip_reason(run: Run, results: list[StageResult], caught: Interruption | None) -> str:
    if caught is not None:
        return f"not run: interrupted by {caught.signal}"
    if results and results[0].name == "ready" and results[0].status == "fail":
        return "the server never became ready"
    if run.down_since:
        return f"server unreachable since stage {run.down_since}"
    if run.hung_since:
        return (f"server hung since stage {run.hung_since} (its requests timed out, --timeout "
                f"{run.cfg.request_timeout_s:g} s)")  # fmt: skip
    return ""


async def _run_stages(
    run: Run, interrupts: _Interrupts, restarts: list[int | None]
) -> list[StageResult]:
    results: list[StageResult] = []
    for name in (n for n in STAGES if n in run.cfg.stages):
        reason = _skip_reason(run, results, interrupts.caught)
        if reason:
            results.append(StageResult(name, "skip", reason, run.now(), run.now()))
            continue
        res = StageResult(name=name, t_start=run.now())
        interrupts.stage = name
        interrupts.task = asyncio.ensure_future(_run_one(run, res, restarts))
        try:
            await interrupts.task
        except asyncio.CancelledError:
            if interrupts.caught is None:
                raise
            res.status, res.t_end = "interrupted", run.now()
            res.reason = f"interrupted by {interrupts.caught.signal} at t={res.t_end:.1f}s"
            run.event_cursor = len(run.metrics.events)
            _attach_probes(run, res)
        finally:
            interrupts.task = None
        results.append(res)
    interrupts.stage = None
    return results


async def _run_one(run: Run, res: StageResult, restarts: list[int | None]) -> None:
    """Run one stage with counter samples around it, then attribute what the probes saw."""
    name = res.name
    run.progress(name, "running", None)
    # A sample at each boundary, so counter deltas cover the stage. Not around `ready`: a
    # server that accepts connections but never answers would stretch its deadline by the
    # scrape timeout on each side.
    if name != "ready":
        await run.metrics.scrape()
    try:
        await STAGE_FUNCS[name](run, res)
    except Exception as exc:  # a validator bug must not hide the other stages' evidence
        res.fail(f"validator error in stage {name}: {type(exc).__name__}: {exc}")
        res.evidence["traceback"] = traceback.format_exc()
    if name != "ready":
        await run.metrics.scrape()
        # The server went away: wait for it (a supervisor may bring it back) so that the
        # restart is attributed to this stage and the next stage starts against a live server.
        # (Not after `ready`: a server that never came up is not coming back.)
        if not run.metrics.reachable:
            await _wait_recovery(run, res)
    if run.client.hung and name != "ready":  # later stages skipped, not each timing out
        run.hung_since = name
    res.t_end = run.now()
    _attribute_events(run, res)
    if run.cfg.container:
        _check_container(run, res, restarts)
    _attach_probes(run, res)
    if res.status == "pass":
        res.reason = ""
    run.progress(name, res.status, 1.0)


async def _wait_recovery(run: Run, res: StageResult) -> None:
    run.progress(res.name, "server unreachable: waiting for it to come back", None)
    ok, last = await run.wait_healthy(run.cfg.recovery_timeout_s, res.name)
    await run.metrics.scrape()
    if not ok:
        run.down_since = res.name
        res.fail(
            f"{run.cfg.url} still unreachable {run.cfg.recovery_timeout_s:g} s after "
            f"the stage (last: {last})"
        )


def _attribute_events(run: Run, res: StageResult) -> None:
    """Fail the stage for the probe events seen since the previous stage ended.

    Each event belongs to exactly one stage: the one that was running (or closing) when the
    probe saw it. Time stamps alone are ambiguous at a boundary (same millisecond).
    """
    events = run.metrics.events[run.event_cursor :]
    run.event_cursor = len(run.metrics.events)
    for ev in events:
        # Before `ready` passes, an unreachable server is the expected state, not a failure.
        if ev["kind"] == "unreachable" and res.name != "ready":
            res.fail(f"server unreachable at t={ev['t']:.1f}s: {ev['detail']}")
        elif ev["kind"] == "restart":
            res.fail(f"server restarted at t={ev['t']:.1f}s: {ev['detail']}")


def _check_container(run: Run, res: StageResult, restarts: list[int | None]) -> None:
    count, how = container_restart_count(run.cfg.container or "")
    if count is not None and restarts[-1] is not None and count > restarts[-1]:
        res.fail(
            f"container {run.cfg.container} restarted (RestartCount {restarts[-1]} -> "
            f"{count}, {how})"
        )
    restarts.append(count)


def _attach_probes(run: Run, res: StageResult) -> None:
    gauges = stats.window_gauges(run.metrics.samples, res.t_start, res.t_end)
    gpu = run.nvml.summary(res.t_start, res.t_end)
    res.evidence["probes"] = {"server": gauges, "gpu": gpu}
    if gauges["preemptions"]:
        # Preemptions are not a failure (vLLM recomputes), but they are the KV-pressure signal.
        res.key["preemptions"] = gauges["preemptions"]
    if gpu.get("peak_used_bytes") is not None:
        res.key["gpu_peak_gib"] = round(gpu["peak_used_bytes"] / 2**30, 2)


async def _check_reachable_without_ready(run: Run) -> None:
    err = await run.discover()
    if err:
        unanswered = "gave no model list" in err
        hint = " (add the 'ready' stage to wait for the server)" if unanswered else ""
        raise ValidationError(err + hint)


async def run_validation(
    cfg: Config, progress: ProgressFn | None = None, deployment: DeploymentProbe | None = None
) -> ValidationResult:
    """Run the selected stages in order with the probes running; return what they found.

    ``progress(stage, message, fraction)`` is called as stages start, advance and end.
    ``deployment`` captures what ran after the stages (so a pass is tied to exactly this
    launch); the result carries it.
    SIGINT/SIGTERM (when run in the main thread) stop the run early: the result then has
    ``interrupted`` set and holds the stages that finished.

    Raises:
        ValidationError: the server is unreachable at the start and ``ready`` is not selected.
    """
    run = Run(cfg, progress)
    restarts: list[int | None] = []
    container: dict[str, Any] = {}
    if cfg.container:
        count, how = container_restart_count(cfg.container)
        restarts.append(count)
        container = {"name": cfg.container, "restart_count_start": count, "runtime": how}
    if cfg.nvml:
        run.nvml.start()
    interrupts = _Interrupts(run)
    try:
        with interrupts.installed():
            if "ready" not in cfg.stages:
                await _check_reachable_without_ready(run)
            run.metrics.start()
            results = await _run_stages(run, interrupts, restarts)
        # After the stages: a signal now no longer stops anything (the CLI notes it).
        server = await _server_environment(run)
    finally:
        await run.close()
    if cfg.container:
        container["restart_count_end"] = restarts[-1] if restarts else None
    deployed = await _deployment(deployment, cfg.url, interrupts.caught)
    return ValidationResult(
        config=cfg,
        stages=results,
        server=server,
        metrics=run.metrics.to_dict(),
        nvml=run.nvml.to_dict(),
        container=container,
        duration_s=run.now(),
        interrupted=interrupts.caught,
        deployment=deployed,
    )


async def _deployment(
    probe: DeploymentProbe | None, url: str, caught: Interruption | None
) -> Deployment | None:
    """What ran, unless the user stopped the run: then the report comes first (a capture waits
    on the server, which may be why they stopped it)."""
    if probe is None:
        return None
    if caught is not None:
        return probe.skipped(f"the run was interrupted by {caught.signal}")
    return await asyncio.to_thread(probe.take, url)


async def _server_environment(run: Run) -> ServerEnvironment:
    if run.model is not None and run.metrics.reachable:
        await run.read_server_version()
    return ServerEnvironment(
        server_version=run.server_version,
        served_model=run.model,
        max_model_len=run.max_model_len,
        models=run.models_payload,
        cache_config_info=run.cache_config(),
        gpu=run.nvml.device or {"status": run.nvml.status},
    )

"""Stages under load: ``concurrency`` (rounds of concurrent requests) and ``sustained``."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from flashnext.validate import stats
from flashnext.validate.client import RequestResult
from flashnext.validate.stages.prompts import essay_prompt
from flashnext.validate.stages.result import StageResult
from flashnext.validate.stages.run import Run


async def _batch(run: Run, n: int, max_tokens: int, temperature: float) -> list[RequestResult]:
    return list(
        await asyncio.gather(
            *(run.chat(essay_prompt(i), max_tokens, temperature) for i in range(n))
        )
    )


async def stage_concurrency(run: Run, res: StageResult) -> None:
    """R rounds of C concurrent streamed completions, each round finished before the next."""
    cfg = run.cfg
    rounds: list[dict[str, Any]] = []
    res.evidence["rounds"] = rounds  # filled as rounds finish: an interrupted run keeps them
    for k in range(cfg.rounds):
        run.progress(
            res.name, f"round {k + 1}/{cfg.rounds}: {cfg.concurrency} requests", k / cfg.rounds
        )
        t = time.monotonic()
        results = await _batch(run, cfg.concurrency, cfg.max_tokens, cfg.temperature)
        round_stats = stats.load_stats(results, time.monotonic() - t)
        round_stats["round"] = k + 1
        rounds.append(round_stats)
        if round_stats["errors"].get("timeout", 0) == round_stats["requests"]:
            res.fail(
                f"round {k + 1}: every request timed out (--timeout {cfg.request_timeout_s:g} "
                "s): the server is hung; remaining rounds not run"
            )
            break
        if round_stats["completed"] < round_stats["requests"]:
            res.fail(
                f"round {k + 1}: {round_stats['completed']}/{round_stats['requests']} "
                f"completed; {stats.error_summary(round_stats)}"
            )
        gone = "unreachable" in round_stats["errors"] or not run.metrics.reachable
        if not gone and "disconnected" in round_stats["errors"]:
            # connections reset: a server shedding load is still there, a killed one is not
            gone = await run.client.gone()
        if gone:
            res.fail(f"server unreachable in round {k + 1}; remaining rounds not run")
            break
    total = sum(r["requests"] for r in rounds)
    done = sum(r["completed"] for r in rounds)
    res.key.update(
        completed=f"{done}/{cfg.rounds * cfg.concurrency}",
        stopped=sum(r["stopped"] for r in rounds),
        length_limited=sum(r["length_limited"] for r in rounds),
        # Worst round; None (not 0) when no request completed, so `compare` shows no "gain".
        ttft_p90_s=stats.worst([(r["ttft_s"] or {}).get("p90") for r in rounds], max),
        e2e_p90_s=stats.worst([(r["e2e_s"] or {}).get("p90") for r in rounds], max),
        output_tok_s=stats.worst(
            [r["output_tokens_per_s"] if r["completed"] else None for r in rounds], min
        ),
    )
    if total < cfg.rounds * cfg.concurrency and res.status != "fail":
        res.fail(f"only {total} of {cfg.rounds * cfg.concurrency} requests were sent")


async def _sustain(run: Run, res: StageResult, results: list[RequestResult]) -> None:
    """Keep ``sustained_concurrency`` requests in flight until the time or count runs out."""
    cfg = run.cfg
    start = time.monotonic()
    end = start + cfg.sustained_s
    budget = [cfg.sustained_max_requests]

    async def worker(w: int) -> None:
        i = 0
        while time.monotonic() < end and budget[0] > 0:
            budget[0] -= 1
            r = await run.chat(essay_prompt(w + i), cfg.sustained_max_tokens, cfg.temperature)
            results.append(r)
            i += 1
            if r.error_kind in ("unreachable", "disconnected") and not run.metrics.reachable:
                return

    async def ticker() -> None:
        while time.monotonic() < end:
            fraction = min(1.0, (time.monotonic() - start) / cfg.sustained_s)
            run.progress(res.name, f"{len(results)} requests done", fraction)
            await asyncio.sleep(1.0)

    tick = asyncio.create_task(ticker())
    try:
        await asyncio.gather(*(worker(w) for w in range(cfg.sustained_concurrency)))
    finally:
        tick.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await tick


async def stage_sustained(run: Run, res: StageResult) -> None:
    """Constant concurrency for ``sustained_s`` seconds; measures per time window and drift."""
    start = time.monotonic()
    results: list[RequestResult] = []
    await _sustain(run, res, results)
    wall = time.monotonic() - start
    overall = stats.load_stats(results, wall)
    windows = stats.time_windows(results, start, wall)
    drift = stats.drift(windows[0], windows[-1])
    res.evidence.update(overall=overall, windows=windows, drift=drift)
    res.key.update(
        requests=overall["requests"],
        completed=overall["completed"],
        output_tok_s=overall["output_tokens_per_s"],
        e2e_p50_drift=drift["e2e_s_p50_last_over_first"],
    )
    if overall["completed"] < overall["requests"]:
        res.fail(
            f"{overall['requests'] - overall['completed']}/{overall['requests']} requests "
            f"failed: {stats.error_summary(overall)}"
        )
    if not results:
        res.fail("no request was sent")

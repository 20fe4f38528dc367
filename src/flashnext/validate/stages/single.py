"""Stages of one request at a time: ``ready``, ``short``, ``long``, ``multimodal``.

Each takes the :class:`~flashnext.validate.stages.run.Run` and a fresh
:class:`~flashnext.validate.stages.result.StageResult` (named, ``t_start`` set) and fills it in.
"""

from __future__ import annotations

import time
import uuid

from flashnext.validate.images import make_png
from flashnext.validate.stages import prompts
from flashnext.validate.stages.result import StageResult
from flashnext.validate.stages.run import Run

# Server answers that explicitly refuse images: the multimodal stage is then skipped, not failed.
NOT_MULTIMODAL = (
    "not a multimodal model",
    "does not support multimodal",
    "does not support image",
    "image input is not supported",
    "multimodal input is not supported",
)


async def stage_ready(run: Run, res: StageResult) -> None:
    """Wait for ``/health`` and ``/v1/models`` within ``ready_timeout_s``; record time to ready."""
    t = time.monotonic()
    ok, last = await run.wait_healthy(run.cfg.ready_timeout_s, res.name)
    if not ok:
        res.fail(
            f"{run.cfg.url}/health did not answer HTTP 200 (waited {time.monotonic() - t:.0f} "
            f"of --ready-timeout {run.cfg.ready_timeout_s:g} s; last: {last})"
        )
        return
    err = await run.discover()
    if err:
        res.fail(err)
        return
    res.key["time_to_ready_s"] = round(time.monotonic() - t, 3)
    res.key["model"] = run.model
    res.key["max_model_len"] = run.max_model_len


async def stage_short(run: Run, res: StageResult) -> None:
    """A short chat completion: non-empty content, a finish_reason, usage counts."""
    r = await run.chat(prompts.short_prompt(), run.cfg.short_max_tokens)
    res.evidence["request"] = r.summary()
    res.evidence["content"] = r.content[:200]
    if not r.ok:
        res.fail(f"request failed ({r.error_kind}): {r.error}")
        return
    if not r.content:
        res.fail("the completion has empty content")
    elif not r.content.strip():
        # Degenerate but non-empty (a tiny random model greedily repeats one token): evidence.
        res.evidence["note"] = "the content is whitespace only"
    if not r.prompt_tokens or r.completion_tokens is None:
        res.fail("the response carries no usage counts (prompt_tokens, completion_tokens)")
    res.key.update(
        ttft_s=round(r.ttft_s or 0, 4),
        e2e_s=round(r.e2e_s or 0, 4),
        completion_tokens=r.completion_tokens,
        finish_reason=r.finish_reason,
    )


async def _fit_filler(run: Run, fact: str, target: int) -> tuple[int, str, int | None]:
    """Filler repeats whose prompt fits ``target`` tokens: (repeats, method, counted tokens).

    A proportional search counting with the server's own ``/tokenize`` (method ``tokenize``;
    the largest filler that fits is kept); without it, ~4 characters per token and 20% under
    the target (method ``estimate``).
    """
    model = run.model or ""
    repeats = 1
    best: tuple[int, int] | None = None  # (repeats, prompt tokens) with tokens <= target
    for _ in range(8):
        n = await run.client.count_tokens(model, prompts.long_prompt(fact, repeats))
        if n is None:
            return max(1, int(target * 0.8 / (len(prompts.FILLER) / 4))), "estimate", None
        if n <= target and (best is None or repeats > best[0]):
            best = (repeats, n)
        if n <= target and (target - n) < 40:
            break
        per_repeat = max(1.0, (n - 30) / repeats)  # ~30 tokens of template, fact and question
        new = max(1, int(repeats + (target - n) / per_repeat))
        if new == repeats:
            break
        repeats = new
    return (best[0], "tokenize", best[1]) if best else (1, "tokenize", None)


async def stage_long(run: Run, res: StageResult) -> None:
    """A prompt filled to ``long_fraction`` of max_model_len, a fact placed at its start.

    Whether the answer contains the fact is recorded as evidence; the gate is a clean
    completion (a tiny random model cannot retrieve anything).
    """
    if not run.max_model_len:
        res.skip("/v1/models does not report max_model_len")
        return
    max_tokens = run.cfg.long_max_tokens
    target = min(int(run.max_model_len * run.cfg.long_fraction), run.max_model_len - max_tokens)
    fact = f"{uuid.uuid4().int % 10**6:06d}"
    repeats, method, counted = await _fit_filler(run, fact, target)
    r = await run.chat(prompts.long_prompt(fact, repeats), max_tokens)
    res.evidence["request"] = r.summary()
    res.evidence["answer"] = r.content[:200]
    res.key.update(
        target_tokens=target,
        prompt_tokens=r.prompt_tokens,
        fill=round((r.prompt_tokens or 0) / run.max_model_len, 3),
        counted_with=method,
        fact_retrieved=fact in r.content,
        e2e_s=round(r.e2e_s or 0, 3),
    )
    if not r.ok:
        tokens = r.prompt_tokens or counted or "unknown"
        res.fail(f"long request ({tokens} prompt tokens) failed ({r.error_kind}): {r.error}")
    elif counted and r.prompt_tokens and abs(r.prompt_tokens - counted) > 16 + counted // 10:
        # fill and every throughput figure come from usage: a count the server's own
        # tokenizer contradicts makes them fiction
        res.fail(
            f"usage.prompt_tokens is {r.prompt_tokens}, but the server's /tokenize counted "
            f"{counted} for the same prompt: its usage counts are wrong"
        )


async def stage_multimodal(run: Run, res: StageResult) -> None:
    """A chat request with a generated PNG as a data URL.

    Pass on a completion; skipped on the server's explicit refusal of images; fail otherwise.
    """
    png = make_png(64, 64)
    r = await run.chat(prompts.image_prompt(png), run.cfg.short_max_tokens)
    res.evidence["request"] = r.summary()
    res.evidence["image_bytes"] = len(png)
    if r.ok:
        res.key.update(e2e_s=round(r.e2e_s or 0, 3), answer=r.content[:60])
        return
    msg = (r.error or "").lower()
    refused = bool(r.error_kind and r.error_kind.startswith("http_4"))
    if refused and any(p in msg for p in NOT_MULTIMODAL):
        res.skip(f"not a multimodal model (server: HTTP {r.status}: {r.error})")
        return
    res.fail(f"image request failed ({r.error_kind}): {r.error}")

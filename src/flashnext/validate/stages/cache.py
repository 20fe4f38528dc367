"""The ``prefix-cache`` stage: requests sharing a long prefix, hits read from ``/metrics``."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable

from flashnext.validate import stats
from flashnext.validate.stages import prompts
from flashnext.validate.stages.result import StageResult
from flashnext.validate.stages.run import Run

#: Tokens of a prefix-cache request beyond its prefix (chat template, "Question i: ...").
QUESTION_TOKENS = 24


async def fit_prefix_chars(
    count: Callable[[int], Awaitable[int | None]], target: int
) -> tuple[int, int | None]:
    """Filler characters whose prompt fits ``target`` tokens: (chars, counted tokens or None).

    ``count(chars)`` is the server's ``/tokenize`` count of the longest request's prompt. A
    tokenizer's characters per token vary from ~1 (a small-vocabulary BPE) to 4+, so a fixed
    ratio overflows a short context; secant steps keep the largest size that fits.
    Without ``/tokenize`` (None): one character per token, which fits any tokenizer.
    """
    base = await count(0)  # the template, nonce and question alone
    if base is None:
        return max(1, target - QUESTION_TOKENS), None
    best = (0, base)
    if base >= target:
        return best
    prev, n_prev = 0, base
    chars = target * 3
    for _ in range(8):  # secant steps: tokens grow about linearly with filler characters
        n = await count(chars)
        if n is None:
            break
        if n <= target and chars > best[0]:
            best = (chars, n)
        if n <= target and target - n < max(4, target // 50):
            break
        slope = (n - n_prev) / (chars - prev) if chars != prev and n > n_prev else 0.25
        new = max(0, chars + int((target - n) / slope))
        if new == chars:
            break
        prev, n_prev, chars = chars, n, new
    return best


def _prefix_target(run: Run) -> tuple[int, str | None]:
    """Tokens the shared prefix may take, or why the stage cannot run on this server."""
    mml = run.max_model_len
    if not mml:
        return 0, "/v1/models does not report max_model_len"
    cache = run.cache_config()
    if cache.get("enable_prefix_caching") in ("False", "false"):
        return 0, "prefix caching is disabled on the server"
    cfg = run.cfg
    # Room for the question and the answer: a prompt over max_model_len is an HTTP 400.
    target = min(int(mml * cfg.prefix_fraction), mml - cfg.prefix_max_tokens - QUESTION_TOKENS)
    block = cache.get("block_size", "")
    if block.isdigit() and int(block) > target - QUESTION_TOKENS:
        # vLLM caches whole blocks only; a hybrid's block is sized to its state page (1152
        # tokens for the e2e model), so no prefix that fits this context can ever hit.
        return target, (
            f"the server's KV block is {block} tokens: no shared prefix that fits max_model_len "
            f"{mml} (at most {target - QUESTION_TOKENS} tokens here) fills one, so none can hit"
        )
    return target, None


async def stage_prefix_cache(run: Run, res: StageResult) -> None:
    """Requests sharing a prefix of ``prefix_fraction`` of max_model_len (counted with the
    server's ``/tokenize``): hit tokens from /metrics, TTFT of cold vs warm."""
    cfg = run.cfg
    target, why_not = _prefix_target(run)
    if why_not:
        res.skip(why_not)
        return
    nonce = uuid.uuid4().hex
    model = run.model or ""

    async def count(chars: int) -> int | None:
        last = prompts.prefix_prompt(prompts.shared_prefix(nonce, chars), cfg.prefix_requests)
        return await run.client.count_tokens(model, last)

    chars, counted = await fit_prefix_chars(count, target)
    res.key["prefix_chars"] = chars
    res.key["prefix_sized_with"] = "tokenize" if counted is not None else "estimate"
    prefix = prompts.shared_prefix(nonce, chars)
    before = await run.metrics.scrape()
    results = []
    for i in range(cfg.prefix_requests):
        results.append(await run.chat(prompts.prefix_prompt(prefix, i), cfg.prefix_max_tokens))
    after = await run.metrics.scrape()
    res.evidence["requests"] = [r.summary() for r in results]
    bad = [r for r in results if not r.ok]
    if bad:
        res.fail(f"{len(bad)}/{len(results)} requests failed ({bad[0].error_kind}): {bad[0].error}")
        return
    cold = results[0].ttft_s
    warm = [r.ttft_s for r in results[1:] if r.ttft_s is not None]
    hits = stats.counter_delta(before, after, "prefix_hits")
    queries = stats.counter_delta(before, after, "prefix_queries")
    res.key.update(
        prompt_tokens=results[0].prompt_tokens,
        ttft_cold_s=round(cold, 4) if cold is not None else None,
        ttft_warm_p50_s=(stats.percentiles(warm) or {}).get("p50"),
        hit_tokens=hits,
        query_tokens=queries,
    )
    if hits is None:
        res.evidence["note"] = "the server exposes no prefix-cache counters in /metrics"
    elif hits <= 0 and cfg.prefix_requests > 1:
        res.fail(
            f"no prefix-cache hits in /metrics after {cfg.prefix_requests} requests sharing "
            f"a {results[0].prompt_tokens}-token prompt prefix (queries +{queries})"
        )

"""The ``prefix-cache`` stage: requests sharing a long prefix, hits read from ``/metrics``."""

from __future__ import annotations

import uuid

from flashnext.validate import stats
from flashnext.validate.stages import prompts
from flashnext.validate.stages.result import StageResult
from flashnext.validate.stages.run import Run


async def stage_prefix_cache(run: Run, res: StageResult) -> None:
    """Requests sharing a long prefix: hit tokens from /metrics, TTFT of cold vs warm."""
    cfg = run.cfg
    if not run.max_model_len:
        res.skip("/v1/models does not report max_model_len")
        return
    if run.cache_config().get("enable_prefix_caching") in ("False", "false"):
        res.skip("prefix caching is disabled on the server")
        return
    chars = int(run.max_model_len * cfg.prefix_fraction) * 3  # >= 3 chars per token
    prefix = prompts.shared_prefix(uuid.uuid4().hex, chars)
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

"""The validation stages and the runner that executes them with the probes running throughout.

Each stage returns a :class:`StageResult`: ``pass``, ``fail`` or ``skipped`` with a reason, the
headline numbers (``key``) and the evidence. The runner wraps every stage: a restart or an
unreachable server seen by the probes while the stage ran fails the stage and is named in it.

Stages, in run order (see :data:`STAGES`): ``ready``, ``short``, ``long``, ``multimodal``,
``concurrency``, ``prefix-cache``, ``sustained``.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import traceback
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from flashnext.validate.client import Client, RequestResult
from flashnext.validate.images import make_png, png_data_url
from flashnext.validate.probes import MetricsProbe, NvmlSampler, container_restart_count

STAGES = ("ready", "short", "long", "multimodal", "concurrency", "prefix-cache", "sustained")

# Server answers that explicitly refuse images: the multimodal stage is then skipped, not failed.
_NOT_MULTIMODAL = (
    "not a multimodal model",
    "does not support multimodal",
    "does not support image",
    "image input is not supported",
    "multimodal input is not supported",
)

_TOPICS = (
    "the history of the printing press",
    "why rivers meander",
    "how bridges carry load",
    "the role of bees in agriculture",
    "the invention of the telescope",
    "what makes a good public library",
    "how tides work",
    "the economics of railways",
    "why cities grow along coasts",
    "the life cycle of stars",
    "how vaccines train the immune system",
    "the craft of bookbinding",
    "the physics of sailing",
    "how maps shaped exploration",
    "the chemistry of bread",
    "why languages change over time",
)

_FILLER = (
    "The archive keeps ledgers of grain, rainfall and river levels for every season. "
    "Clerks copied each page twice, and the copies were stored in separate buildings. "
)


@dataclass
class Config:
    """Everything a validation run needs; the CLI builds it from flags.

    Concurrency defaults follow the deployment notes: 3 rounds of 16 concurrent requests,
    a ~300-word essay prompt, max_tokens 700, temperature 0.8, a 180 s client timeout.
    """

    url: str
    model: str | None = None
    api_key: str | None = None
    stages: tuple[str, ...] = STAGES
    ready_timeout_s: float = 600.0
    request_timeout_s: float = 180.0
    recovery_timeout_s: float = 180.0
    short_max_tokens: int = 32
    long_fraction: float = 0.9
    long_max_tokens: int = 32
    rounds: int = 3
    concurrency: int = 16
    max_tokens: int = 700
    temperature: float = 0.8
    prefix_fraction: float = 0.5
    prefix_requests: int = 4
    prefix_max_tokens: int = 16
    sustained_s: float = 60.0
    sustained_concurrency: int = 8
    sustained_max_tokens: int = 128
    sustained_max_requests: int = 10_000
    probe_interval_s: float = 0.5
    gpu_index: int = 0
    nvml: bool = True
    container: str | None = None


@dataclass
class StageResult:
    """One stage's verdict. ``key`` holds the headline numbers shown in the Markdown table."""

    name: str
    status: str = "pass"  # pass | fail | skipped
    reason: str = ""
    t_start: float = 0.0
    t_end: float = 0.0
    key: dict[str, Any] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    evidence: dict[str, Any] = field(default_factory=dict)

    def fail(self, message: str) -> None:
        """Mark the stage failed and record why (several failures may accumulate)."""
        self.status = "fail"
        self.failures.append(message)
        if not self.reason:
            self.reason = message

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready record."""
        d = asdict(self)
        d["duration_s"] = round(self.t_end - self.t_start, 3)
        return d


def percentiles(values: list[float]) -> dict[str, float] | None:
    """p50/p90/p99/mean/max of ``values`` (linear interpolation); None for an empty list."""
    if not values:
        return None
    xs = sorted(values)

    def q(p: float) -> float:
        pos = (len(xs) - 1) * p
        lo, hi = math.floor(pos), math.ceil(pos)
        return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)

    # Microsecond resolution: chunks that arrive in one TCP read are microseconds apart.
    return {
        "p50": round(q(0.5), 6),
        "p90": round(q(0.9), 6),
        "p99": round(q(0.99), 6),
        "mean": round(sum(xs) / len(xs), 6),
        "max": round(xs[-1], 6),
    }


def _worst(values: list[float | None], pick: Callable[[list[float]], float]) -> float | None:
    known = [v for v in values if v is not None]
    return pick(known) if known else None


def load_stats(results: list[RequestResult], wall_s: float) -> dict[str, Any]:
    """Per-round (or per-window) measures over a batch of requests."""
    done = [r for r in results if r.finish_reason is not None and r.error_kind is None]
    errors = Counter(r.error_kind for r in results if r.error_kind is not None)
    examples: dict[str, str] = {}
    for r in results:
        if r.error_kind and r.error_kind not in examples:
            examples[r.error_kind] = r.error or ""
    out_tokens = sum(r.completion_tokens or 0 for r in done)
    return {
        "requests": len(results),
        "completed": len(done),
        "stopped": sum(r.finish_reason == "stop" for r in done),
        "length_limited": sum(r.finish_reason == "length" for r in done),
        "errors": dict(errors),
        "error_examples": examples,
        "wall_s": round(wall_s, 3),
        "output_tokens": out_tokens,
        "output_tokens_per_s": round(out_tokens / wall_s, 2) if wall_s > 0 else None,
        "ttft_s": percentiles([r.ttft_s for r in done if r.ttft_s is not None]),
        "itl_s": percentiles([x for r in done for x in r.itl_s]),
        "e2e_s": percentiles([r.e2e_s for r in done if r.e2e_s is not None]),
    }


def essay_prompt(i: int) -> list[dict[str, Any]]:
    """The notes' concurrency prompt: a ~300-word essay, the topic varied per request."""
    topic = _TOPICS[i % len(_TOPICS)]
    return [{"role": "user", "content": f"Write an essay of about 300 words on {topic}."}]


ProgressFn = Callable[[str, str, float | None], None]


class Run:
    """State shared by the stages of one run: client, probes, served model facts, progress."""

    def __init__(self, cfg: Config, progress: ProgressFn | None = None) -> None:
        self.cfg = cfg
        self.t0 = time.monotonic()
        self.client = Client(cfg.url, cfg.api_key, cfg.request_timeout_s)
        # The probe has its own connection pool so that scrapes never wait behind the load.
        self.probe_client = Client(cfg.url, cfg.api_key, timeout_s=10.0, max_connections=4)
        self.metrics = MetricsProbe(self.probe_client, self.t0, cfg.probe_interval_s)
        self.nvml = NvmlSampler(self.t0, cfg.gpu_index, cfg.probe_interval_s)
        if not cfg.nvml:
            self.nvml.status = "not available: disabled with --no-nvml"
        self.model: str | None = cfg.model
        self.max_model_len: int | None = None
        self.models_payload: Any = None
        self.down_since: str | None = None  # stage during which the server was lost for good
        self.server_version: str | None = None  # read while the server is up, not at the end
        self.event_cursor = 0  # probe events up to here belong to stages already reported
        self._progress = progress

    def now(self) -> float:
        """Seconds since the run started (the time axis of every timeline)."""
        return round(time.monotonic() - self.t0, 3)

    def progress(self, stage: str, message: str, fraction: float | None = None) -> None:
        """Report progress to the CLI (no-op when run as a library without a callback)."""
        if self._progress is not None:
            self._progress(stage, message, fraction)

    async def discover(self) -> str | None:
        """Read ``/v1/models``: the served model and ``max_model_len``. Returns an error or None."""
        status, text, _ = await self.client.get("/v1/models", timeout_s=10.0)
        if status in (401, 403):
            key = "a wrong --api-key" if self.cfg.api_key else "no --api-key"
            return f"GET {self.cfg.url}/v1/models: HTTP {status} (unauthorized: {key} was sent)"
        try:
            data = json.loads(text) if status == 200 else None
        except ValueError:
            data = None
        if not isinstance(data, dict) or not data.get("data"):
            seen = f"HTTP {status}" if status is not None else text
            return f"GET {self.cfg.url}/v1/models gave no model list ({seen})"
        if self.server_version is None:
            version = await self.client.get_json("/version")
            if isinstance(version, dict) and version.get("version"):
                self.server_version = str(version["version"])
        self.models_payload = data
        cards = data["data"]
        ids = [c.get("id") for c in cards]
        if self.model is None:
            self.model = ids[0]
        card = next((c for c in cards if c.get("id") == self.model), None)
        if card is None:
            return f"--model {self.model!r} is not served at {self.cfg.url}; served: {ids}"
        mml = card.get("max_model_len") or card.get("context_length")
        self.max_model_len = int(mml) if mml else None
        return None

    async def chat(
        self, messages: list[dict[str, Any]], max_tokens: int, temperature: float = 0.0
    ) -> RequestResult:
        """One streamed chat completion against the served model."""
        if self.model is None:  # discover() runs before any stage; this is a programming error
            raise RuntimeError("no served model known: /v1/models was not read")
        return await self.client.chat(self.model, messages, max_tokens, temperature)

    async def wait_healthy(self, deadline_s: float) -> tuple[bool, str]:
        """Poll ``/health`` until HTTP 200 or the deadline: (healthy, last observation)."""
        end = time.monotonic() + deadline_s
        last = "no answer yet"
        while True:
            status, text, _ = await self.client.get("/health", timeout_s=5.0)
            if status == 200:
                return True, "HTTP 200"
            if status == 404:
                # Not every OpenAI-compatible server has /health: a model list means ready.
                m_status, _, _ = await self.client.get("/v1/models", timeout_s=5.0)
                if m_status == 200:
                    return True, "no /health (HTTP 404); /v1/models answered HTTP 200"
            last = f"HTTP {status}" if status is not None else text
            if time.monotonic() >= end:
                return False, last
            await asyncio.sleep(min(0.5, max(0.0, end - time.monotonic())))


# ---------------------------------------------------------------------------------------------
# Stages. Each takes the Run and a fresh StageResult (named, t_start set) and fills it in.


async def stage_ready(run: Run, res: StageResult) -> None:
    """Wait for ``/health`` and ``/v1/models`` within ``ready_timeout_s``; record time to ready."""
    t = time.monotonic()
    ok, last = await run.wait_healthy(run.cfg.ready_timeout_s)
    if not ok:
        res.fail(
            f"{run.cfg.url}/health did not answer HTTP 200 within --ready-timeout "
            f"{run.cfg.ready_timeout_s:g} s (last: {last})"
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
    r = await run.chat(
        [{"role": "user", "content": "Say hello in one short sentence."}], run.cfg.short_max_tokens
    )
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


def _long_messages(fact: str, filler_repeats: int) -> list[dict[str, Any]]:
    body = f"Remember this fact: the vault code is {fact}.\n" + _FILLER * filler_repeats
    return [
        {"role": "user", "content": body + "\nQuestion: what is the vault code? Answer briefly."}
    ]


async def stage_long(run: Run, res: StageResult) -> None:
    """A prompt filled to ``long_fraction`` of max_model_len, a fact placed at its start.

    Whether the answer contains the fact is recorded as evidence; the gate is a clean
    completion (a tiny random model cannot retrieve anything).
    """
    cfg = run.cfg
    if not run.max_model_len:
        res.status, res.reason = "skipped", "/v1/models does not report max_model_len"
        return
    max_tokens = cfg.long_max_tokens
    target = int(run.max_model_len * cfg.long_fraction)
    target = min(target, run.max_model_len - max_tokens)
    fact = f"{uuid.uuid4().int % 10**6:06d}"
    model = run.model or ""
    # Proportional search for the filler size, counting with the server's own tokenizer;
    # the largest filler whose count fits the target is used.
    repeats, method = 1, "tokenize"
    best: tuple[int, int] | None = None  # (repeats, prompt tokens) with tokens <= target
    for _ in range(8):
        n = await run.client.count_tokens(model, _long_messages(fact, repeats))
        if n is None:
            method = "estimate"
            # No /tokenize: assume ~4 characters per token and stay 20% under the target.
            repeats = max(1, int(target * 0.8 / (len(_FILLER) / 4)))
            break
        if n <= target and (best is None or repeats > best[0]):
            best = (repeats, n)
        if n <= target and (target - n) < 40:
            break
        per_repeat = max(1.0, (n - 30) / repeats)  # ~30 tokens of template, fact and question
        new = max(1, int(repeats + (target - n) / per_repeat))
        if new == repeats:
            break
        repeats = new
    if method == "tokenize":
        repeats = best[0] if best else 1
    messages = _long_messages(fact, repeats)
    r = await run.chat(messages, max_tokens)
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
        tokens = r.prompt_tokens or (best[1] if best else "unknown")
        res.fail(f"long request ({tokens} prompt tokens) failed ({r.error_kind}): {r.error}")


async def stage_multimodal(run: Run, res: StageResult) -> None:
    """A chat request with a generated PNG as a data URL.

    Pass on a completion; skipped on the server's explicit refusal of images; fail otherwise.
    """
    png = make_png(64, 64)
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What colour is the square in the middle?"},
                {"type": "image_url", "image_url": {"url": png_data_url(png)}},
            ],
        }
    ]
    r = await run.chat(messages, run.cfg.short_max_tokens)
    res.evidence["request"] = r.summary()
    res.evidence["image_bytes"] = len(png)
    if r.ok:
        res.key.update(e2e_s=round(r.e2e_s or 0, 3), answer=r.content[:60])
        return
    msg = (r.error or "").lower()
    if (
        r.error_kind
        and r.error_kind.startswith("http_4")
        and any(p in msg for p in _NOT_MULTIMODAL)
    ):
        res.status = "skipped"
        res.reason = f"not a multimodal model (server: HTTP {r.status}: {r.error})"
        return
    res.fail(f"image request failed ({r.error_kind}): {r.error}")


async def _batch(run: Run, n: int, max_tokens: int, temperature: float) -> list[RequestResult]:
    return list(
        await asyncio.gather(
            *(run.chat(essay_prompt(i), max_tokens, temperature) for i in range(n))
        )
    )


async def stage_concurrency(run: Run, res: StageResult) -> None:
    """R rounds of C concurrent streamed completions, each round finished before the next."""
    cfg = run.cfg
    rounds = []
    for k in range(cfg.rounds):
        run.progress(
            res.name, f"round {k + 1}/{cfg.rounds}: {cfg.concurrency} requests", k / cfg.rounds
        )
        t = time.monotonic()
        results = await _batch(run, cfg.concurrency, cfg.max_tokens, cfg.temperature)
        stats = load_stats(results, time.monotonic() - t)
        stats["round"] = k + 1
        rounds.append(stats)
        if stats["completed"] < stats["requests"]:
            res.fail(
                f"round {k + 1}: {stats['completed']}/{stats['requests']} completed; "
                f"errors {stats['errors']}: "
                + "; ".join(f"{kind}: {msg}" for kind, msg in stats["error_examples"].items())
            )
        if "unreachable" in stats["errors"] or not run.metrics.reachable:
            res.fail(f"server unreachable in round {k + 1}; remaining rounds not run")
            break
    res.evidence["rounds"] = rounds
    total = sum(r["requests"] for r in rounds)
    done = sum(r["completed"] for r in rounds)
    res.key.update(
        completed=f"{done}/{cfg.rounds * cfg.concurrency}",
        stopped=sum(r["stopped"] for r in rounds),
        length_limited=sum(r["length_limited"] for r in rounds),
        # Worst round; None (not 0) when no request completed, so `compare` shows no "gain".
        ttft_p90_s=_worst([(r["ttft_s"] or {}).get("p90") for r in rounds], max),
        e2e_p90_s=_worst([(r["e2e_s"] or {}).get("p90") for r in rounds], max),
        output_tok_s=_worst(
            [r["output_tokens_per_s"] if r["completed"] else None for r in rounds], min
        ),
    )
    if total < cfg.rounds * cfg.concurrency and res.status != "fail":
        res.fail(f"only {total} of {cfg.rounds * cfg.concurrency} requests were sent")


async def stage_prefix_cache(run: Run, res: StageResult) -> None:
    """Requests sharing a long prefix: hit tokens from /metrics, TTFT of cold vs warm."""
    cfg = run.cfg
    if not run.max_model_len:
        res.status, res.reason = "skipped", "/v1/models does not report max_model_len"
        return
    info = _cache_config(run)
    if info.get("enable_prefix_caching") in ("False", "false"):
        res.status, res.reason = "skipped", "prefix caching is disabled on the server"
        return
    # A fresh nonce first, so that the first request is cold even on a long-running server.
    nonce = uuid.uuid4().hex
    target_chars = int(run.max_model_len * cfg.prefix_fraction) * 3  # >= 3 chars per token
    prefix = f"Session {nonce}. " + (_FILLER * (target_chars // len(_FILLER) + 1))[:target_chars]
    before = await run.metrics.scrape()
    results = []
    for i in range(cfg.prefix_requests):
        msg = [{"role": "user", "content": prefix + f"\nQuestion {i}: summarise in one line."}]
        results.append(await run.chat(msg, cfg.prefix_max_tokens))
    after = await run.metrics.scrape()
    res.evidence["requests"] = [r.summary() for r in results]
    bad = [r for r in results if not r.ok]
    if bad:
        res.fail(f"{len(bad)}/{len(results)} requests failed ({bad[0].error_kind}): {bad[0].error}")
        return
    cold = results[0].ttft_s
    warm = [r.ttft_s for r in results[1:] if r.ttft_s is not None]
    res.key.update(
        prompt_tokens=results[0].prompt_tokens,
        ttft_cold_s=round(cold, 4) if cold is not None else None,
        ttft_warm_p50_s=(percentiles(warm) or {}).get("p50"),
    )
    hits = _delta(before, after, "prefix_hits")
    queries = _delta(before, after, "prefix_queries")
    res.key.update(hit_tokens=hits, query_tokens=queries)
    if hits is None:
        res.evidence["note"] = "the server exposes no prefix-cache counters in /metrics"
    elif hits <= 0 and cfg.prefix_requests > 1:
        res.fail(
            f"no prefix-cache hits in /metrics after {cfg.prefix_requests} requests sharing "
            f"a {results[0].prompt_tokens}-token prompt prefix (queries +{queries})"
        )


def _delta(before: dict[str, Any], after: dict[str, Any], key: str) -> float | None:
    a, b = before.get(key), after.get(key)
    if a is None or b is None:
        return None
    return b - a


def _cache_config(run: Run) -> dict[str, str]:
    series = (run.metrics.last.get("metrics") or {}).get("vllm:cache_config_info")
    return dict(series[0][0]) if series else {}


async def stage_sustained(run: Run, res: StageResult) -> None:
    """Constant concurrency for ``sustained_s`` seconds; measures per time window and drift."""
    cfg = run.cfg
    start = time.monotonic()
    end = start + cfg.sustained_s
    results: list[RequestResult] = []
    budget = [cfg.sustained_max_requests]

    async def worker(w: int) -> None:
        i = 0
        # Bounded by time and by count, whichever comes first.
        while time.monotonic() < end and budget[0] > 0:
            budget[0] -= 1
            r = await run.chat(essay_prompt(w + i), cfg.sustained_max_tokens, cfg.temperature)
            results.append(r)
            i += 1
            if r.error_kind == "unreachable":
                return

    async def ticker() -> None:
        while time.monotonic() < end:
            run.progress(
                res.name,
                f"{len(results)} requests done",
                min(1.0, (time.monotonic() - start) / cfg.sustained_s),
            )
            await asyncio.sleep(1.0)

    tick = asyncio.create_task(ticker())
    await asyncio.gather(*(worker(w) for w in range(cfg.sustained_concurrency)))
    tick.cancel()
    wall = time.monotonic() - start
    overall = load_stats(results, wall)
    # Drift: the same measures in (up to) four equal windows by request start time.
    nwin = 4 if len(results) >= 8 else 1
    width = max(wall, 1e-9) / nwin
    windows = []
    for k in range(nwin):
        lo, hi = start + k * width, start + (k + 1) * width
        batch = [r for r in results if lo <= r.started < hi]
        stats = load_stats(batch, width)
        stats["window_s"] = [round(k * width, 2), round((k + 1) * width, 2)]
        windows.append(stats)
    res.evidence["overall"] = overall
    res.evidence["windows"] = windows

    def med(w: dict[str, Any], k: str) -> float | None:
        return (w[k] or {}).get("p50")

    first, last = windows[0], windows[-1]
    drift = {}
    for measure in ("ttft_s", "e2e_s"):
        a, b = med(first, measure), med(last, measure)
        drift[f"{measure}_p50_last_over_first"] = round(b / a, 3) if a and b else None
    a, b = first["output_tokens_per_s"], last["output_tokens_per_s"]
    drift["tok_s_last_over_first"] = round(b / a, 3) if a and b else None
    res.evidence["drift"] = drift
    res.key.update(
        requests=overall["requests"],
        completed=overall["completed"],
        output_tok_s=overall["output_tokens_per_s"],
        e2e_p50_drift=drift["e2e_s_p50_last_over_first"],
    )
    if overall["completed"] < overall["requests"]:
        res.fail(
            f"{overall['requests'] - overall['completed']}/{overall['requests']} requests failed: "
            f"{overall['errors']}: "
            + "; ".join(f"{kind}: {msg}" for kind, msg in overall["error_examples"].items())
        )
    if not results:
        res.fail("no request was sent")


STAGE_FUNCS: dict[str, Callable[[Run, StageResult], Awaitable[None]]] = {
    "ready": stage_ready,
    "short": stage_short,
    "long": stage_long,
    "multimodal": stage_multimodal,
    "concurrency": stage_concurrency,
    "prefix-cache": stage_prefix_cache,
    "sustained": stage_sustained,
}


# ---------------------------------------------------------------------------------------------
# The runner.


def _window_gauges(samples: list[dict[str, Any]], t0: float, t1: float) -> dict[str, Any]:
    rows = [s for s in samples if s.get("ok") and t0 <= s["t"] <= t1]
    out: dict[str, Any] = {"samples": len(rows)}
    for k in ("running", "waiting", "kv_usage"):
        vals = [s[k] for s in rows if s.get(k) is not None]
        out[f"peak_{k}"] = max(vals) if vals else None
    pre = [s["preemptions"] for s in rows if s.get("preemptions") is not None]
    out["preemptions"] = (pre[-1] - pre[0]) if len(pre) >= 2 else (0 if pre else None)
    return out


async def _run_one(run: Run, name: str, restarts: list[int | None]) -> StageResult:
    res = StageResult(name=name, t_start=run.now())
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
    # The server went away: wait for it (a supervisor may bring it back) so that the restart
    # is attributed to this stage and the next stage starts against a live server.
    # (Not after `ready`: a server that never came up is not coming back.)
    if name != "ready" and not run.metrics.reachable:
        run.progress(name, "server unreachable: waiting for it to come back", None)
        ok, last = await run.wait_healthy(run.cfg.recovery_timeout_s)
        await run.metrics.scrape()
        if not ok:
            run.down_since = name
            res.fail(
                f"{run.cfg.url} still unreachable {run.cfg.recovery_timeout_s:g} s after "
                f"the stage (last: {last})"
            )
    res.t_end = run.now()
    # Each probe event belongs to exactly one stage: the one that was running (or closing) when
    # the probe saw it. Time stamps alone are ambiguous at a boundary (same millisecond).
    events = run.metrics.events[run.event_cursor :]
    run.event_cursor = len(run.metrics.events)
    for ev in events:
        # Before `ready` passes, an unreachable server is the expected state, not a failure.
        if ev["kind"] == "unreachable" and name != "ready":
            res.fail(f"server unreachable at t={ev['t']:.1f}s: {ev['detail']}")
        elif ev["kind"] == "restart":
            res.fail(f"server restarted at t={ev['t']:.1f}s: {ev['detail']}")
    if run.cfg.container:
        count, how = container_restart_count(run.cfg.container)
        if count is not None and restarts[-1] is not None and count > restarts[-1]:
            res.fail(
                f"container {run.cfg.container} restarted (RestartCount "
                f"{restarts[-1]} -> {count}, {how})"
            )
        restarts.append(count)
    gauges = _window_gauges(run.metrics.samples, res.t_start, res.t_end)
    res.evidence["probes"] = {"server": gauges, "gpu": run.nvml.summary(res.t_start, res.t_end)}
    if gauges["preemptions"]:
        # Preemptions are not a failure (vLLM recomputes), but they are the KV-pressure signal.
        res.key["preemptions"] = gauges["preemptions"]
    gpu_peak = res.evidence["probes"]["gpu"].get("peak_used_bytes")
    if gpu_peak is not None:
        res.key["gpu_peak_gib"] = round(gpu_peak / 2**30, 2)
    if res.status == "pass":
        res.reason = ""
    run.progress(name, res.status, 1.0)
    return res


async def run_validation(cfg: Config, progress: ProgressFn | None = None) -> dict[str, Any]:
    """Run the selected stages in order with the probes running; return the raw results.

    The result feeds :func:`flashnext.validate.report.build_report`. Raises
    :class:`~flashnext.errors.ValidationError` only when the server is unreachable at the
    start and ``ready`` is not selected.
    """
    from flashnext.errors import ValidationError

    run = Run(cfg, progress)
    results: list[StageResult] = []
    restarts: list[int | None] = []
    container_info: dict[str, Any] = {}
    if cfg.container:
        count, how = container_restart_count(cfg.container)
        restarts.append(count)
        container_info = {"name": cfg.container, "restart_count_start": count, "runtime": how}
    if cfg.nvml:
        run.nvml.start()
    try:
        if "ready" not in cfg.stages:
            err = await run.discover()
            if err:
                unanswered = "gave no model list" in err
                hint = " (add the 'ready' stage to wait for the server)" if unanswered else ""
                raise ValidationError(err + hint)
        run.metrics.start()
        for name in STAGES:
            if name not in cfg.stages:
                continue
            if results and results[0].name == "ready" and results[0].status == "fail":
                results.append(
                    StageResult(
                        name, "skipped", "the server never became ready", run.now(), run.now()
                    )
                )
                continue
            if run.down_since:
                results.append(
                    StageResult(
                        name,
                        "skipped",
                        f"server unreachable since stage {run.down_since}",
                        run.now(),
                        run.now(),
                    )
                )
                continue
            results.append(await _run_one(run, name, restarts))
        env = await _server_environment(run)
    finally:
        await run.metrics.stop()
        run.nvml.stop()
        await run.client.aclose()
        await run.probe_client.aclose()
    if cfg.container:
        container_info["restart_count_end"] = restarts[-1] if restarts else None
    return {
        "run": run,
        "stages": results,
        "environment": env,
        "container": container_info,
        "duration_s": run.now(),
    }


async def _server_environment(run: Run) -> dict[str, Any]:
    if run.server_version is None and run.model is not None and run.metrics.reachable:
        version = await run.client.get_json("/version")
        if isinstance(version, dict) and version.get("version"):
            run.server_version = str(version["version"])
    return {
        "server_version": run.server_version,
        "served_model": run.model,
        "max_model_len": run.max_model_len,
        "models": run.models_payload,
        "cache_config_info": _cache_config(run),
        "gpu": run.nvml.device or {"status": run.nvml.status},
    }

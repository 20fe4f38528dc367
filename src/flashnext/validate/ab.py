"""A/B equivalence of two deployments: did the change keep the answers?

:func:`run_ab` sends every prompt of a set to a *baseline* and a *candidate* server with the
same token ids (tokenized by each server, checked equal), lets both continue greedily
(temperature 0, fixed seed, top-K logprobs) and then scores the baseline's continuation on both
servers (teacher forcing), so that the distributions are compared position by position in the
same context even after the free-running outputs went apart. Metrics are in
:mod:`flashnext.validate.ab_metrics`; :func:`verdict` holds them against :class:`Thresholds`.

The payload of the ``flashnext.validate.ab`` record (schema version 1):

- ``baseline`` / ``candidate``: url, model, version (``/version``), max_model_len, models
  (``/v1/models``), requests sent, teacher_forcing mode (prompt_logprobs | echo | unsupported)
  and note, down (why the server was given up, or null); a recorded baseline
  (:mod:`flashnext.validate.ab_answers`) adds ``recorded``, the answers file it came from;
- ``config``: max_tokens, top_logprobs, seed, concurrency, prompts source, thresholds;
- ``prompts``: per prompt id, category, prompt_tokens, both continuations (text, token ids,
  finish reason), first_difference, token_agreement, ``tf`` (teacher-forced: positions,
  top1_agreement, kl/tv/logprob_delta_abs {mean, max}, per-position kl and tv), error;
- ``summary``: pooled numbers; ``verdict``: status (identical | pass | fail | error |
  interrupted), checks, reasons; ``cost``: requests per server and wall time (the comparison
  only);
- ``interrupted``: null, or {``signal``, ``prompts_done``, ``prompts_total``} when SIGINT or
  SIGTERM stopped the run: ``prompts`` and ``summary`` then hold the prompts that finished;
- ``deployments``: ``baseline`` and ``candidate``, each server's deployment record
  (``flashnext.deploy.record``, captured after the prompts by the caller's
  :class:`~flashnext.validate.deployment.DeploymentProbe`, as ``flashnext validate`` does) or
  ``{"error": why}``; ``summaries``: a line naming each; ``differences``: what the probe's
  ``diff`` finds between the two (group, name, before, after, variable), null unless both were
  captured. Null when no probe was given.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable, Coroutine
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

from flashnext.records import VALIDATE_AB
from flashnext.validate import ab_metrics as M
from flashnext.validate.ab_answers import RecordedSide, answer_line
from flashnext.validate.ab_prompts import Prompt, fill_repeats
from flashnext.validate.ab_server import RequestFailed, Side
from flashnext.validate.client import Client
from flashnext.validate.deployment import DeploymentProbe
from flashnext.validate.interrupts import Interrupts

KIND = VALIDATE_AB
T = TypeVar("T")
SCHEMA_VERSION = 1
#: Room left for the chat template's own tokens when filling long prompts.
_TEMPLATE_SLACK = 16


@dataclass(frozen=True)
class Thresholds:
    """Pass limits. Defaults: a same-weights rerun passes, a perturbed model fails.

    Teacher-forced checks apply when both servers score continuations; the token check always.
    """

    min_top1_agreement: float = 0.97
    max_mean_kl: float = 0.01
    min_token_agreement: float = 0.5


@dataclass
class AbConfig:
    """What a run compares and how; the CLI builds it from flags."""

    baseline_url: str
    candidate_url: str | None  # None: record the baseline only
    prompts: list[Prompt]
    prompts_source: str = "default"
    baseline_model: str | None = None
    candidate_model: str | None = None
    api_key: str | None = None
    max_tokens: int = 64
    top_logprobs: int = 20
    seed: int = 0
    concurrency: int = 1
    timeout_s: float = 180.0
    thresholds: Thresholds = field(default_factory=Thresholds)
    #: Answers recorded by an earlier run, in place of a live baseline (``baseline_url`` and
    #: ``prompts`` then name and are its own).
    recorded_baseline: RecordedSide | None = None


Progress = Callable[[int, int, str], None]


async def run_ab(
    cfg: AbConfig, progress: Progress | None = None, deployment: DeploymentProbe | None = None
) -> dict[str, Any]:
    """Run the comparison; return the record payload (see the module docstring). Never raises
    for a server failure: that is recorded (``verdict.status == "error"``).

    The first SIGINT/SIGTERM (when run in the main thread) stops the prompts in flight: the
    payload then holds the finished ones and ``interrupted``; a second ends the process.
    ``deployment`` captures both servers' deployments after the prompts.

    ``baseline_answers`` of the payload: a live baseline's answers to the prompts that
    finished (lines of :mod:`flashnext.validate.ab_answers`; None for a recorded baseline). The
    caller writes them and takes the key out of the record. Without a candidate
    (``candidate_url`` None) the baseline is only recorded: see :func:`record_baseline`.
    """
    if cfg.candidate_url is None:
        return await record_baseline(cfg, progress)
    t0 = time.monotonic()
    base = cfg.recorded_baseline or Side(
        "baseline", Client(cfg.baseline_url, cfg.api_key, cfg.timeout_s)
    )
    cand = Side("candidate", Client(cfg.candidate_url, cfg.api_key, cfg.timeout_s))
    finished: dict[int, dict[str, Any]] = {}
    interrupts = Interrupts()
    try:
        work = _setup_and_prompts(cfg, base, cand, progress, finished)
        setup_error = await _interruptible(interrupts, work)
    finally:
        await asyncio.gather(base.aclose(), cand.aclose())
    wall_s = round(time.monotonic() - t0, 3)
    results = [finished[i] for i in sorted(finished)]
    answers = [r.pop("_answer") for r in results if "_answer" in r]
    summary = summarize_ab(results)
    stop = _interruption(interrupts, len(results), len(cfg.prompts))
    return {
        "baseline": base.info(),
        "candidate": cand.info(),
        "config": _config_dict(cfg),
        "setup_error": setup_error,
        "interrupted": stop,
        "prompts": results,
        "summary": summary,
        "verdict": verdict(summary, cfg.thresholds, setup_error, stop),
        "cost": {
            "requests": {"baseline": base.requests, "candidate": cand.requests},
            "wall_s": wall_s,
        },
        "deployments": await deployments(cfg, deployment, stop) if deployment else None,
        "baseline_answers": None if cfg.recorded_baseline else answers,
    }


async def record_baseline(cfg: AbConfig, progress: Progress | None = None) -> dict[str, Any]:
    """Ask the baseline alone and record its answers (one GPU: the candidate comes later, with
    ``--baseline DIR``): ``baseline``, ``config``, ``setup_error``, ``interrupted``, ``errors``
    (per failed prompt: id and error) and ``baseline_answers`` (as :func:`run_ab`). Never
    raises for a server failure; a signal stops it as it stops :func:`run_ab`."""
    base = Side("baseline", Client(cfg.baseline_url, cfg.api_key, cfg.timeout_s))
    finished: dict[int, dict[str, Any]] = {}
    interrupts = Interrupts()

    async def prompts() -> dict[str, str] | None:
        try:
            await base.load_info(cfg.baseline_model)
        except RequestFailed as exc:
            return _error(exc)
        for i, p in enumerate(cfg.prompts):  # one at a time: the batches of a lone request
            try:
                finished[i] = await _answer(cfg, p, base)
            except RequestFailed as exc:
                finished[i] = {"id": p.id, "error": _error(exc)}
            if progress:
                progress(len(finished), len(cfg.prompts), p.id)
        return None

    try:
        setup_error = await _interruptible(interrupts, prompts())
    finally:
        await base.aclose()
    rows = [finished[i] for i in sorted(finished)]
    return {
        "baseline": base.info(),
        "config": _config_dict(cfg),
        "setup_error": setup_error,
        "interrupted": _interruption(interrupts, len(rows), len(cfg.prompts)),
        "errors": [r for r in rows if "error" in r],
        "baseline_answers": [r for r in rows if "error" not in r],
    }


async def _answer(cfg: AbConfig, p: Prompt, base: Side) -> dict[str, Any]:
    """The baseline's answers to one prompt, as :func:`compare_prompt` records them."""
    if p.fill_fraction is not None:
        p = await _fill(cfg, p, base, base)
    ids = await base.tokenize(p.messages, p.text)
    gen = await base.generate(ids, cfg.max_tokens, cfg.top_logprobs, cfg.seed)
    tf = await base.score(ids + gen.token_ids, cfg.top_logprobs) if gen.token_ids else []
    return answer_line(p, ids, gen, None if tf is None else tf[len(ids) :])


async def _interruptible(interrupts: Interrupts, work: Coroutine[Any, Any, T]) -> T | None:
    """``work``'s result, run as the task the first SIGINT/SIGTERM cancels (None then)."""
    with interrupts.installed():
        interrupts.task = asyncio.ensure_future(work)
        try:
            return await interrupts.task
        except asyncio.CancelledError:
            if interrupts.signal is None:
                raise
            return None


async def _setup_and_prompts(
    cfg: AbConfig, base: Side, cand: Side, progress: Progress | None,
    finished: dict[int, dict[str, Any]],
) -> dict[str, str] | None:  # fmt: skip
    """Read both servers' facts, then run the prompts into ``finished`` (by prompt index, as
    each completes, so an interrupt keeps them); the setup error, if any."""
    try:
        await asyncio.gather(
            base.load_info(cfg.baseline_model), cand.load_info(cfg.candidate_model)
        )
    except RequestFailed as exc:
        return _error(exc)
    await _run_prompts(cfg, base, cand, progress, finished)
    return None


def _interruption(interrupts: Interrupts, done: int, total: int) -> dict[str, Any] | None:
    if interrupts.signal is None:
        return None
    return {"signal": interrupts.signal.name, "prompts_done": done, "prompts_total": total}


async def deployments(
    cfg: AbConfig, probe: DeploymentProbe, stop: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Both servers' deployment records, a line naming each and their differences (see the
    module docstring). Never raises: a capture that fails is recorded with its reason; after an
    interrupt nothing is captured (the report comes first)."""
    cand_url = cfg.candidate_url or ""  # a comparison always has one (record_baseline: none)
    if stop is not None:
        why = f"the run was interrupted by {stop['signal']}"
        base = cand = probe.skipped(why)
    elif cfg.recorded_baseline is not None:
        base = probe.skipped(f"recorded answers ({cfg.recorded_baseline.source}): no live server")
        cand = await asyncio.to_thread(probe.take, cand_url)
    else:
        base, cand = await asyncio.gather(
            asyncio.to_thread(probe.take, cfg.baseline_url),
            asyncio.to_thread(probe.take, cand_url),
        )
    return {
        "baseline": base.record,
        "candidate": cand.record,
        "summaries": {"baseline": base.summary, "candidate": cand.summary},
        "differences": probe.compare(base, cand),
    }


def _config_dict(cfg: AbConfig) -> dict[str, Any]:
    keep = ("max_tokens", "top_logprobs", "seed", "concurrency", "timeout_s", "prompts_source")
    out = {k: getattr(cfg, k) for k in keep}
    out["thresholds"] = asdict(cfg.thresholds)
    out["prompt_ids"] = [p.id for p in cfg.prompts]
    return out


def _error(exc: RequestFailed) -> dict[str, str]:
    return {"side": exc.side, "kind": exc.kind, "message": exc.message}


async def _run_prompts(
    cfg: AbConfig, base: Side, cand: Side, progress: Progress | None,
    finished: dict[int, dict[str, Any]],
) -> None:  # fmt: skip
    sem = asyncio.Semaphore(cfg.concurrency)

    async def one(i: int, p: Prompt) -> None:
        async with sem:
            try:
                out = await compare_prompt(cfg, p, base, cand)
            except RequestFailed as exc:
                out = {"id": p.id, "category": p.category, "error": _error(exc)}
        finished[i] = out
        if progress:
            progress(len(finished), len(cfg.prompts), p.id)

    await asyncio.gather(*(one(i, p) for i, p in enumerate(cfg.prompts)))


async def prompt_tokens(
    cfg: AbConfig, p: Prompt, base: Side, cand: Side
) -> tuple[Prompt, list[int]]:
    """The prompt as sent (long prompts filled) and its token ids; both servers must agree.

    Raises:
        RequestFailed: a request failed, the tokenizers disagree, or a long prompt cannot be
            filled (max_model_len unknown, or too small).
    """
    if p.fill_fraction is not None:
        p = await _fill(cfg, p, base, cand)
    ids_b, ids_c = await asyncio.gather(
        base.tokenize(p.messages, p.text), cand.tokenize(p.messages, p.text)
    )
    if ids_b != ids_c:
        at = M.first_difference(ids_b, ids_c)
        raise RequestFailed(
            "both",
            "tokenizer_mismatch",
            f"the servers tokenize the prompt differently (first at token {at}); "
            "A/B needs the same tokenizer and chat template",
        )
    return p, ids_b


async def _fill(cfg: AbConfig, p: Prompt, base: Side, cand: Side) -> Prompt:
    lens = [n for n in (base.max_model_len, cand.max_model_len) if n]
    if not lens:
        raise RequestFailed("both", "no_max_model_len", "long prompt: /v1/models gave no length")
    budget = min(lens) - cfg.max_tokens - _TEMPLATE_SLACK
    target = min(int(min(lens) * (p.fill_fraction or 0)), budget)
    empty = len(await base.tokenize(p.filled(0).messages, p.filled(0).text))
    if target <= empty:
        raise RequestFailed(
            "both", "too_long", f"max_model_len {min(lens)} leaves no room for filling"
        )
    # Fillers merge with each other at their seams, so a filler costs fewer tokens inside the
    # prompt than alone: measure the cost per filler from a rough fill, then fill to the target.
    rough = max(1, fill_repeats(0, len(p.filler) // 3 or 1, target - empty))
    probe = p.filled(rough)
    per = (len(await base.tokenize(probe.messages, probe.text)) - empty) / rough
    repeats = max(0, int((target - empty) / max(per, 1e-9)))
    filled = p.filled(repeats)
    n = len(await base.tokenize(filled.messages, filled.text))
    if n > budget:  # trim once by the overshoot
        filled = p.filled(max(0, repeats - int((n - budget) / max(per, 1e-9)) - 1))
    return filled


async def compare_prompt(cfg: AbConfig, p: Prompt, base: Side, cand: Side) -> dict[str, Any]:
    """Tokenize, generate on both, score the baseline continuation on both; the prompt's row
    (with ``_answer``, the baseline's answers as :func:`~flashnext.validate.ab_answers.answer_line`
    records them, for the caller to take out).

    Raises:
        RequestFailed: any request of this prompt failed.
    """
    sent, ids = await prompt_tokens(cfg, p, base, cand)
    gen_b, gen_c = await asyncio.gather(
        base.generate(ids, cfg.max_tokens, cfg.top_logprobs, cfg.seed),
        cand.generate(ids, cfg.max_tokens, cfg.top_logprobs, cfg.seed),
    )
    row: dict[str, Any] = {
        "id": p.id,
        "category": p.category,
        "prompt_tokens": len(ids),
        "baseline": asdict(gen_b),
        "candidate": asdict(gen_c),
        "first_difference": M.first_difference(gen_b.token_ids, gen_c.token_ids),
        "token_agreement": M.token_agreement(gen_b.token_ids, gen_c.token_ids),
        "tf": None,
        "error": None,
    }
    tf_b = None
    if gen_b.token_ids:
        forced = ids + gen_b.token_ids
        tf_b, tf_c = await asyncio.gather(
            base.score(forced, cfg.top_logprobs), cand.score(forced, cfg.top_logprobs)
        )
        n = len(ids)
        if tf_b is not None and tf_c is not None:
            row["tf"] = teacher_forced(tf_b[n:], tf_c[n:], gen_b.token_ids)
        tf_b = None if tf_b is None else tf_b[n:]
    row["_answer"] = answer_line(sent, ids, gen_b, tf_b if gen_b.token_ids else [])
    return row


def teacher_forced(base: list[M.TopK], cand: list[M.TopK], tokens: list[int]) -> dict[str, Any]:
    """Per-prompt teacher-forced numbers from both servers' distributions over ``tokens``."""
    pos = M.position_divergence(base, cand, tokens)
    same = pos["top1_same"]
    deltas = [abs(float(d)) for d in pos["logprob_delta"]]
    return {
        "positions": len(tokens),
        "top1_agreement": sum(bool(s) for s in same) / len(same),
        "kl": M.distribution([float(v) for v in pos["kl"]]),
        "tv": M.distribution([float(v) for v in pos["tv"]]),
        "logprob_delta_abs": M.distribution(deltas),
        "per_position": {"kl": pos["kl"], "tv": pos["tv"], "top1_same": same},
    }


def summarize_ab(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Pooled numbers over the prompts that completed (teacher-forced ones pooled by position)."""
    ok = [r for r in rows if not r.get("error")]
    tf = [r["tf"] for r in ok if r.get("tf")]
    kl = [v for t in tf for v in t["per_position"]["kl"]]
    tv = [v for t in tf for v in t["per_position"]["tv"]]
    same = [s for t in tf for s in t["per_position"]["top1_same"]]
    firsts = [r["first_difference"] for r in ok if r["first_difference"] is not None]
    alike = [_finish(r, "baseline") == _finish(r, "candidate") for r in ok]
    finish = [r for r, same_end in zip(ok, alike, strict=True) if not same_end]
    return {
        "prompts": len(rows),
        "compared": len(ok),
        "errors": len(rows) - len(ok),
        "identical": sum(
            1 for r, same_end in zip(ok, alike, strict=True)
            if same_end and r["first_difference"] is None
        ),
        "differing": len(firsts),
        # the same tokens can still end differently (a stop the other side did not see)
        "finish_reason_differs": [
            {"id": r["id"], "baseline": _finish(r, "baseline"), "candidate": _finish(r, "candidate")}
            for r in finish
        ],
        "first_difference": {
            "min": min(firsts) if firsts else None,
            "median": statistics.median(firsts) if firsts else None,
        },
        "token_agreement": statistics.fmean(r["token_agreement"] for r in ok) if ok else None,
        "tf_prompts": len(tf),
        "tf_positions": len(same),
        "top1_agreement": sum(same) / len(same) if same else None,
        "kl": M.distribution(kl),
        "tv": M.distribution(tv),
    }


def _finish(row: dict[str, Any], side: str) -> Any:
    return (row.get(side) or {}).get("finish_reason")


def verdict(
    summary: dict[str, Any],
    th: Thresholds,
    setup_error: dict[str, str] | None = None,
    stop: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``status``: ``interrupted`` (a signal stopped the run: never a pass), ``error`` (a server
    failed), ``identical`` (same tokens, zero divergence), ``pass`` (within every threshold) or
    ``fail``; ``checks`` lists each limit and value over the prompts that finished."""
    checks = []

    def check(name: str, value: float | None, limit: float, ok: bool) -> None:
        checks.append({"name": name, "value": value, "limit": limit, "ok": ok})

    if summary["token_agreement"] is not None:
        ta = summary["token_agreement"]
        check("token_agreement >=", ta, th.min_token_agreement, ta >= th.min_token_agreement)
    if summary["top1_agreement"] is not None:
        t1 = summary["top1_agreement"]
        check("top1_agreement >=", t1, th.min_top1_agreement, t1 >= th.min_top1_agreement)
        mk = summary["kl"]["mean"]
        check("mean_kl <=", mk, th.max_mean_kl, mk <= th.max_mean_kl)
    reasons = [
        f"{c['name']} {c['limit']}: measured {c['value']:.4g}" for c in checks if not c["ok"]
    ]
    if setup_error or summary["errors"]:
        status = "error"
        reasons.insert(0, _error_reason(summary, setup_error))
    elif not summary["compared"]:
        status, reasons = "error", ["no prompt was compared"]
    elif reasons:
        status = "fail"
    elif (summary["differing"] == 0 and not summary.get("finish_reason_differs")
          and (summary["kl"]["max"] or 0.0) == 0.0):  # fmt: skip
        status = "identical"
    else:
        status = "pass"
    ends = summary.get("finish_reason_differs") or []
    if ends:
        first = ends[0]
        reasons.append(
            f"{len(ends)} prompt{'s end' if len(ends) > 1 else ' ends'} with another "
            "finish_reason (first: "
            f"{first['id']}, {first['baseline']} -> {first['candidate']})"
        )
    if summary["compared"] and summary["tf_prompts"] == 0:
        reasons.append("no teacher-forced scores: verdict from token agreement only")
    if stop is not None:
        status = "interrupted"
        reasons.insert(
            0,
            f"interrupted by {stop['signal']} after {stop['prompts_done']} of "
            f"{stop['prompts_total']} prompts: the numbers cover those only",
        )
    return {
        "status": status,
        "passed": status in ("identical", "pass"),
        "checks": checks,
        "reasons": reasons,
    }


def _error_reason(summary: dict[str, Any], setup_error: dict[str, str] | None) -> str:
    if setup_error:
        return f"{setup_error['side']} failed at start: {setup_error['kind']}: {setup_error['message']}"
    return f"{summary['errors']} of {summary['prompts']} prompts failed (see prompts[].error)"

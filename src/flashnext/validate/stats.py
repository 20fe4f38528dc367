"""Pure statistics over request outcomes and probe samples: no I/O, no clock, no server.

Every function takes plain values (lists of :class:`~flashnext.validate.client.RequestResult`,
probe sample dicts, floats) and returns JSON-ready dicts, so each is unit-tested on its own.
Times are seconds throughout.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from flashnext.validate.client import RequestResult


def percentiles(values: Sequence[float]) -> dict[str, float] | None:
    """p50/p90/p99/mean/max of ``values`` (linear interpolation); None for an empty list.

    Rounded to microseconds: chunks that arrive in one TCP read are microseconds apart.
    """
    if not values:
        return None
    xs = sorted(values)

    def q(p: float) -> float:
        pos = (len(xs) - 1) * p
        lo, hi = math.floor(pos), math.ceil(pos)
        return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)

    return {
        "p50": round(q(0.5), 6),
        "p90": round(q(0.9), 6),
        "p99": round(q(0.99), 6),
        "mean": round(sum(xs) / len(xs), 6),
        "max": round(xs[-1], 6),
    }


def worst(values: Sequence[float | None], pick: Callable[[list[float]], float]) -> float | None:
    """``pick`` (max or min) over the known values; None (never 0) when none is known."""
    known = [v for v in values if v is not None]
    return pick(known) if known else None


def load_stats(results: Sequence[RequestResult], wall_s: float) -> dict[str, Any]:
    """Measures over one batch of requests (a round or a time window).

    Returns completed / stopped / length-limited counts, errors by kind with one example
    message each, output tokens and tokens/s over ``wall_s``, and percentiles of TTFT,
    inter-token gaps and end-to-end latency of the completed requests (None when none completed).
    """
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


def error_summary(stats: dict[str, Any]) -> str:
    """``errors {...}: kind: example; ...`` of a :func:`load_stats` result, for a failure line."""
    examples = "; ".join(f"{kind}: {msg}" for kind, msg in stats["error_examples"].items())
    return f"errors {stats['errors']}: {examples}"


def time_windows(
    results: Sequence[RequestResult], start: float, wall_s: float, max_windows: int = 4
) -> list[dict[str, Any]]:
    """:func:`load_stats` in equal windows by request start time (``started``, monotonic s).

    ``max_windows`` windows when there are at least twice as many requests, else one; each
    window dict also has ``window_s`` [from, to] relative to ``start``.
    """
    nwin = max_windows if len(results) >= 2 * max_windows else 1
    width = max(wall_s, 1e-9) / nwin
    windows = []
    for k in range(nwin):
        lo, hi = start + k * width, start + (k + 1) * width
        last = k == nwin - 1  # the last window is closed: a request started at the end counts
        batch = [r for r in results if lo <= r.started < hi or (last and r.started == hi)]
        stats = load_stats(batch, width)
        stats["window_s"] = [round(k * width, 2), round((k + 1) * width, 2)]
        windows.append(stats)
    return windows


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(b / a, 3) if a and b else None


def drift(first: dict[str, Any], last: dict[str, Any]) -> dict[str, float | None]:
    """Last window over first: p50 TTFT, p50 end-to-end latency and tokens/s (None if unknown)."""
    out: dict[str, float | None] = {}
    for measure in ("ttft_s", "e2e_s"):
        a, b = (first[measure] or {}).get("p50"), (last[measure] or {}).get("p50")
        out[f"{measure}_p50_last_over_first"] = _ratio(a, b)
    out["tok_s_last_over_first"] = _ratio(first["output_tokens_per_s"], last["output_tokens_per_s"])
    return out


def window_gauges(samples: Sequence[dict[str, Any]], t0: float, t1: float) -> dict[str, Any]:
    """Peaks of the scheduler gauges and the preemption count in [t0, t1] (probe samples).

    ``preemptions`` is the counter's growth over the window: None without a reading, 0 with one.
    """
    rows = [s for s in samples if s.get("ok") and t0 <= s["t"] <= t1]
    out: dict[str, Any] = {"samples": len(rows)}
    for k in ("running", "waiting", "kv_usage"):
        vals = [s[k] for s in rows if s.get(k) is not None]
        out[f"peak_{k}"] = max(vals) if vals else None
    pre = [s["preemptions"] for s in rows if s.get("preemptions") is not None]
    out["preemptions"] = (pre[-1] - pre[0]) if len(pre) >= 2 else (0 if pre else None)
    return out


def counter_delta(before: dict[str, Any], after: dict[str, Any], key: str) -> float | None:
    """Growth of a counter between two probe samples; None when either lacks it."""
    a, b = before.get(key), after.get(key)
    if a is None or b is None:
        return None
    return b - a

"""flashnext.validate.stats on its own: request outcomes and probe samples built in memory."""

from __future__ import annotations

import numpy as np
import pytest

from flashnext.validate.client import RequestResult
from flashnext.validate.stats import (
    counter_delta,
    drift,
    error_summary,
    load_stats,
    percentiles,
    time_windows,
    window_gauges,
    worst,
)


def done(
    started: float, e2e: float, ttft: float, itl: list[float], tokens: int, finish: str = "stop"
) -> RequestResult:
    return RequestResult(
        ok=True,
        started=started,
        e2e_s=e2e,
        ttft_s=ttft,
        itl_s=itl,
        finish_reason=finish,
        completion_tokens=tokens,
    )


def failed(started: float, kind: str, msg: str) -> RequestResult:
    return RequestResult(ok=False, started=started, e2e_s=0.1, error_kind=kind, error=msg)


def test_percentiles_exact_small_case() -> None:
    assert percentiles([]) is None
    assert percentiles([4.0, 1.0, 3.0, 2.0, 5.0]) == {
        "p50": 3.0,
        "p90": 4.6,
        "p99": 4.96,
        "mean": 3.0,
        "max": 5.0,
    }
    assert percentiles([7.0]) == {"p50": 7.0, "p90": 7.0, "p99": 7.0, "mean": 7.0, "max": 7.0}


def test_percentiles_match_numpy_linear_on_random_values(rng: np.random.Generator) -> None:
    values = rng.exponential(0.2, size=int(rng.integers(2, 500))).tolist()
    p = percentiles(values)
    assert p is not None
    for name, q in (("p50", 50), ("p90", 90), ("p99", 99)):
        assert p[name] == pytest.approx(np.percentile(values, q), abs=1e-6)
    assert p["mean"] == pytest.approx(np.mean(values), abs=1e-6)
    assert p["max"] == pytest.approx(max(values), abs=1e-6)


def test_worst_ignores_unknowns_and_never_invents_zero() -> None:
    assert worst([None, 2.0, 5.0], max) == 5.0
    assert worst([None, 2.0, 5.0], min) == 2.0
    assert worst([None, None], max) is None
    assert worst([], min) is None


def test_load_stats_counts_errors_and_rates() -> None:
    results = [
        done(0.0, 1.0, 0.2, [0.1, 0.3], 10),
        done(0.0, 2.0, 0.4, [0.2], 20, finish="length"),
        failed(0.0, "timeout", "no answer in 180 s"),
        failed(0.0, "timeout", "second message is not the example"),
        failed(0.0, "http_500", "boom"),
    ]
    s = load_stats(results, wall_s=4.0)
    assert (s["requests"], s["completed"], s["stopped"], s["length_limited"]) == (5, 2, 1, 1)
    assert s["errors"] == {"timeout": 2, "http_500": 1}
    assert s["error_examples"] == {"timeout": "no answer in 180 s", "http_500": "boom"}
    assert s["output_tokens"] == 30 and s["output_tokens_per_s"] == 7.5
    assert s["ttft_s"]["max"] == 0.4 and s["e2e_s"]["p50"] == 1.5
    assert s["itl_s"] == percentiles([0.1, 0.3, 0.2])
    assert error_summary(s) == (
        "errors {'timeout': 2, 'http_500': 1}: timeout: no answer in 180 s; http_500: boom"
    )


def test_load_stats_with_nothing_completed_reports_unknowns() -> None:
    s = load_stats([failed(0.0, "unreachable", "refused")], wall_s=0.0)
    assert s["completed"] == 0 and s["output_tokens"] == 0
    assert s["output_tokens_per_s"] is None  # no wall time: no rate, not a division by zero
    assert s["ttft_s"] is None and s["itl_s"] is None and s["e2e_s"] is None


def test_time_windows_split_by_start_time_and_drift(rng: np.random.Generator) -> None:
    start, wall = 100.0, 8.0
    # Requests spread over the run; the later ones slower, so drift is > 1.
    starts = np.sort(rng.uniform(start, start + wall, size=40))
    results = [
        done(float(t), e2e=1.0 + (t - start) / 4, ttft=0.1, itl=[], tokens=8) for t in starts
    ]
    windows = time_windows(results, start, wall)
    assert [w["window_s"] for w in windows] == [[0, 2], [2, 4], [4, 6], [6, 8]]
    assert sum(w["requests"] for w in windows) == 40
    for k, w in enumerate(windows):
        lo, hi = start + 2 * k, start + 2 * (k + 1)
        assert w["requests"] == int(np.sum((starts >= lo) & (starts < hi)))
    d = drift(windows[0], windows[-1])
    first, last = windows[0]["e2e_s"]["p50"], windows[-1]["e2e_s"]["p50"]
    assert d["e2e_s_p50_last_over_first"] == round(last / first, 3) > 1
    assert d["ttft_s_p50_last_over_first"] == 1.0
    # Fewer than two requests per window: one window, and drift of a window with itself is 1.
    few = time_windows(results[:7], start, wall)
    assert len(few) == 1 and few[0]["requests"] == 7


def test_drift_is_unknown_when_a_window_is_empty() -> None:
    empty = load_stats([], wall_s=2.0)
    full = load_stats([done(0.0, 1.0, 0.1, [], 5)], wall_s=2.0)
    assert drift(empty, full) == {
        "ttft_s_p50_last_over_first": None,
        "e2e_s_p50_last_over_first": None,
        "tok_s_last_over_first": None,
    }


def test_window_gauges_peaks_and_preemption_growth() -> None:
    samples = [
        {"t": 0.5, "ok": True, "running": 9, "waiting": 0, "kv_usage": 0.9, "preemptions": 1},
        {"t": 1.0, "ok": True, "running": 2, "waiting": 3, "kv_usage": 0.5, "preemptions": 4},
        {"t": 1.5, "ok": False},
        {"t": 2.0, "ok": True, "running": 4, "waiting": 1, "kv_usage": None, "preemptions": 6},
        {"t": 3.0, "ok": True, "running": 99, "waiting": 99, "kv_usage": 1.0, "preemptions": 50},
    ]
    g = window_gauges(samples, 1.0, 2.0)
    assert g == {
        "samples": 2,
        "peak_running": 4,
        "peak_waiting": 3,
        "peak_kv_usage": 0.5,
        "preemptions": 2,
    }
    assert window_gauges(samples, 2.0, 2.0)["preemptions"] == 0  # one reading: no growth
    assert window_gauges(samples, 10, 20) == {
        "samples": 0,
        "peak_running": None,
        "peak_waiting": None,
        "peak_kv_usage": None,
        "preemptions": None,
    }


def test_counter_delta() -> None:
    assert counter_delta({"prefix_hits": 10.0}, {"prefix_hits": 74.0}, "prefix_hits") == 64.0
    assert counter_delta({}, {"prefix_hits": 74.0}, "prefix_hits") is None
    assert counter_delta({"prefix_hits": 1.0}, {"ok": False}, "prefix_hits") is None

"""Pure math of the A/B comparison: token sequences and top-K next-token distributions.

A server returns, per position, the log-probabilities of a few tokens (its top K, plus the
scored token when it is not among them): a mapping ``token id -> logprob``. Two such partial
distributions are compared on a common partition of the vocabulary:

- one bucket per token listed by *both* sides (the intersection S of the two supports), and
- one ``rest`` bucket holding everything else: ``1 - sum(exp(logprob) for t in S)`` on each side
  (clipped at 0 against rounding; a zero ``rest`` on the candidate side is floored at
  :data:`FLOOR` so that KL stays finite).

Both sides are then proper distributions over the same buckets, and merging tokens into buckets
can only lose information (data processing inequality): the KL divergence and the total
variation reported here are **lower bounds** of the divergences between the full distributions,
exact when the top-K lists carry all the mass. Top-1 agreement and the exact log-probability of
the scored token (always listed by vLLM) catch what the lower bound can hide when the two top-K
sets barely overlap.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

#: Smallest candidate-side bucket mass used inside the KL logarithm.
FLOOR = 1e-12

TopK = dict[int, float]


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first position where two token sequences differ, or None when they are equal.

    A sequence that is a strict prefix of the other differs at the shorter one's length.
    """
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return None if len(a) == len(b) else n


def token_agreement(a: Sequence[int], b: Sequence[int]) -> float:
    """Fraction of positions ``< max(len(a), len(b))`` holding the same token (1.0 if both empty).

    Positions present in only one sequence count as disagreements.
    """
    n = max(len(a), len(b))
    if n == 0:
        return 1.0
    same = sum(1 for x, y in zip(a, b) if x == y)
    return same / n


def top1(dist: TopK) -> int:
    """The most likely listed token (ties broken by the smaller token id).

    Raises:
        ValueError: ``dist`` is empty.
    """
    if not dist:
        raise ValueError("top1 of an empty distribution")
    return min(dist, key=lambda t: (-dist[t], t))


def bucket_masses(p: TopK, q: TopK) -> tuple[np.ndarray, np.ndarray]:
    """Both sides' probabilities on the common partition: float64 ``[|S| + 1]``, ``rest`` last.

    ``S`` = tokens listed by both ``p`` and ``q`` (sorted by id); see the module docstring.
    """
    common = sorted(set(p) & set(q))
    ps = np.exp(np.array([p[t] for t in common], dtype=np.float64))
    qs = np.exp(np.array([q[t] for t in common], dtype=np.float64))
    p_rest = max(1.0 - float(ps.sum()), 0.0)
    q_rest = max(1.0 - float(qs.sum()), 0.0)
    return np.append(ps, p_rest), np.append(qs, q_rest)


def kl_tv(p: TopK, q: TopK) -> tuple[float, float]:
    """KL(p || q) in nats and total variation on the common partition (both lower bounds).

    ``p`` and ``q`` map token id -> natural-log probability. Terms with zero ``p`` mass vanish;
    ``q`` masses are floored at :data:`FLOOR` inside the logarithm.
    """
    pm, qm = bucket_masses(p, q)
    live = pm > 0
    kl = float(np.sum(pm[live] * (np.log(pm[live]) - np.log(np.maximum(qm[live], FLOOR)))))
    tv = 0.5 * float(np.abs(pm - qm).sum())
    return max(kl, 0.0), tv


def position_divergence(
    base: Sequence[TopK], cand: Sequence[TopK], tokens: Sequence[int]
) -> dict[str, list[float] | list[bool]]:
    """Per-position comparison of two teacher-forced runs over the same ``tokens``.

    ``base[i]`` and ``cand[i]`` are the two servers' distributions of the token at position i
    given the same context; ``tokens[i]`` is the token actually scored there. Returns lists of
    length ``len(tokens)``: ``kl``, ``tv``, ``top1_same`` (bool) and ``logprob_delta`` (the
    scored token's candidate minus baseline logprob; NaN when a side does not list it).

    Raises:
        ValueError: the three sequences differ in length.
    """
    if not len(base) == len(cand) == len(tokens):
        raise ValueError(
            f"position_divergence: lengths differ (base {len(base)}, cand {len(cand)}, "
            f"tokens {len(tokens)})"
        )
    kl: list[float] = []
    tv: list[float] = []
    same: list[bool] = []
    delta: list[float] = []
    for p, q, tok in zip(base, cand, tokens):
        k, t = kl_tv(p, q)
        kl.append(k)
        tv.append(t)
        same.append(top1(p) == top1(q))
        delta.append(q[tok] - p[tok] if tok in p and tok in q else math.nan)
    return {"kl": kl, "tv": tv, "top1_same": same, "logprob_delta": delta}


def distribution(values: Sequence[float]) -> dict[str, float | None]:
    """Mean and max of the finite values (None when there are none)."""
    arr = np.array([v for v in values if math.isfinite(v)], dtype=np.float64)
    if arr.size == 0:
        return {"mean": None, "max": None}
    return {"mean": float(arr.mean()), "max": float(arr.max())}

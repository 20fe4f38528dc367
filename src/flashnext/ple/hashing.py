"""Token ids -> PLE row ids: the exact n-gram hash of FACTS.md, vectorized.

For token ``t`` and head ``h`` of order ``n = h // heads_per_ngram + 2``::

    window[i] = token[t - i]                      i = 0 .. n-1
    mixed     = XOR_{i<n} (window[i] * mult[i])   int64, cannot overflow
    id        = offsets[h] + mixed % sizes[h]

EOS rule: walking back from ``t`` (i = 1, 2, ...), the first EOS met stays in the window and
every older position becomes EOS; the current token (i = 0) never cuts its own window.
Positions before a request's first token come from its *context*: the ``ngram_size - 1``
tokens before it, oldest first (EOS-filled for a fresh request, the last committed tokens
when a prompt is chunked). :func:`next_context` gives the context for the following chunk.

This module is the one place that turns tokens into row ids; everything else calls it.
"""

from __future__ import annotations

import numpy as np

from flashnext.errors import GeometryError
from flashnext.ple.geometry import PLEGeometry


def _as_tokens(
    tokens: object, what: str, geometry: PLEGeometry, ndim: int | None = None
) -> np.ndarray:
    arr = np.asarray(tokens)
    if ndim is not None and arr.ndim != ndim:
        raise GeometryError(
            f"{what} has shape {list(arr.shape)}, expected {ndim}-D"
            + (
                " [T] (one request's tokens; pack a batch with ngram_ids_packed)"
                if ndim == 1
                else ""
            )
        )
    if arr.dtype.kind not in "iu" and arr.size:
        raise GeometryError(f"{what} must hold integer token ids, found dtype {arr.dtype}")
    arr = arr.astype(np.int64, copy=False)
    if arr.size:
        bad = np.flatnonzero((arr.reshape(-1) < 0) | (arr.reshape(-1) >= geometry.vocab_size))
        if bad.size:
            i = int(bad[0])
            raise GeometryError(
                f"{what}[{i}] = {int(arr.reshape(-1)[i])} is not a token id in "
                f"[0, {geometry.vocab_size})"
            )
    return arr


def _contexts(geometry: PLEGeometry, contexts: object, batch: int) -> np.ndarray:
    n1 = geometry.ngram_size - 1
    if contexts is None:
        return np.full((batch, n1), geometry.eos_token_id, dtype=np.int64)
    ctx = _as_tokens(contexts, "contexts", geometry)
    if ctx.shape != (batch, n1):
        raise GeometryError(
            f"contexts has shape {list(ctx.shape)}, expected [{batch}, {n1}] "
            "(one row of ngram_size-1 tokens per request, oldest first)"
        )
    return ctx


def _hash_windows(geometry: PLEGeometry, windows: np.ndarray) -> np.ndarray:
    """windows int64 [T, ngram_size] (column i = token t-i, EOS rule not yet applied) -> ids."""
    eos = geometry.eos_token_id
    is_eos = windows[:, 1:] == eos
    # Position i >= 1 is cut to EOS when any of positions 1..i is EOS.
    cut = np.logical_or.accumulate(is_eos, axis=1)
    win = windows.copy()
    win[:, 1:][cut] = eos
    mult = np.asarray(geometry.multipliers, dtype=np.int64)
    mixed = np.bitwise_xor.accumulate(win * mult, axis=1)  # column n-1: order-n hash
    orders = np.asarray(geometry.head_orders, dtype=np.int64)
    sizes = np.asarray(geometry.sizes, dtype=np.int64)
    offsets = np.asarray(geometry.offsets, dtype=np.int64)
    return offsets + mixed[:, orders - 1] % sizes


def ngram_ids(geometry: PLEGeometry, tokens: object, context: object = None) -> np.ndarray:
    """Row ids of one request chunk.

    Args:
        geometry: the PLE layer's geometry.
        tokens: int [T] token ids of the chunk.
        context: int [ngram_size - 1], the tokens before the chunk, oldest first; ``None``
            for a fresh request (EOS-filled).

    Returns:
        int64 [T, num_heads] global row ids into the layer's table.

    Raises:
        GeometryError: a token is outside ``[0, vocab_size)`` or the context has the wrong length.
    """
    toks = _as_tokens(tokens, "tokens", geometry, ndim=1)
    ctx = None if context is None else np.asarray(context).reshape(1, -1)
    qsl = np.array([0, toks.size], dtype=np.int64)
    return ngram_ids_packed(geometry, toks, qsl, ctx)


def ngram_ids_packed(
    geometry: PLEGeometry,
    tokens: object,
    query_start_loc: object,
    contexts: object = None,
) -> np.ndarray:
    """Row ids of a packed batch of request chunks, laid out as vLLM packs them.

    Args:
        geometry: the PLE layer's geometry.
        tokens: int [N] token ids of all requests, concatenated.
        query_start_loc: int [B + 1], non-decreasing, ``query_start_loc[0] == 0`` and
            ``query_start_loc[B] == N``; request ``b`` owns ``tokens[qsl[b]:qsl[b+1]]``.
        contexts: int [B, ngram_size - 1], each request's preceding tokens, oldest first;
            ``None`` for all-fresh requests.

    Returns:
        int64 [N, num_heads] global row ids.
    """
    toks = _as_tokens(tokens, "tokens", geometry, ndim=1)
    qsl = np.asarray(query_start_loc, dtype=np.int64).reshape(-1)
    if qsl.size < 1 or qsl[0] != 0 or qsl[-1] != toks.size or np.any(np.diff(qsl) < 0):
        raise GeometryError(
            f"query_start_loc {qsl.tolist()[:8]}... must start at 0, be non-decreasing and end "
            f"at the token count {toks.size}"
        )
    batch = qsl.size - 1
    ctx = _contexts(geometry, contexts, batch)
    n = geometry.ngram_size
    if toks.size == 0:
        return np.empty((0, geometry.num_heads), dtype=np.int64)

    req = np.repeat(np.arange(batch), np.diff(qsl))  # request of each token
    pos = np.arange(toks.size) - qsl[req]  # position within its request
    lag = np.arange(n)
    src = pos[:, None] - lag[None, :]  # [N, n] position of token t-i within the request
    inside = src >= 0
    from_tokens = toks[np.where(inside, np.arange(toks.size)[:, None] - lag[None, :], 0)]
    # Before the request start: context column n-1 + src (src is -1 .. -(n-1)).
    from_ctx = ctx[req[:, None], np.where(inside, 0, (n - 1) + src)]
    windows = np.where(inside, from_tokens, from_ctx)
    return _hash_windows(geometry, windows)


def next_context(geometry: PLEGeometry, tokens: object, context: object = None) -> np.ndarray:
    """The context for the chunk after ``tokens``: the last ``ngram_size - 1`` tokens seen.

    Returns int64 [ngram_size - 1], oldest first.
    """
    n1 = geometry.ngram_size - 1
    toks = _as_tokens(tokens, "tokens", geometry).reshape(-1)
    ctx = _contexts(geometry, None if context is None else np.asarray(context).reshape(1, -1), 1)
    return np.concatenate([ctx[0], toks])[-n1:]

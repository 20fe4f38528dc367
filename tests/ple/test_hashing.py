"""Hashing against an independent pure-Python reference written from FACTS.md."""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashnext.errors import GeometryError
from flashnext.ple import PLEGeometry, next_context, ngram_ids, ngram_ids_packed

CFG = {
    "vocab_size": 248320,
    "ngram_size": 3,
    "heads_per_ngram": 8,
    "ngram_vocab_size_base": 20_000_000,
    "ple_embed_dim": 2560,
    "ple_layer_ids": [4, 8],
    "eos_token_id": 248044,
}


def reference_ids(g, tokens, context):
    """Per token, per head, in plain Python ints: the recipe exactly as written in FACTS.md."""
    n = g.ngram_size
    seq = list(context) + list(tokens)
    out = []
    for t in range(len(context), len(seq)):
        window = []
        cut = False
        for i in range(n):
            tok = seq[t - i]
            if i >= 1:
                if cut:
                    tok = g.eos_token_id
                elif tok == g.eos_token_id:
                    cut = True
            window.append(tok)
        row = []
        for h in range(g.num_heads):
            order = h // g.heads_per_ngram + 2
            mixed = 0
            for i in range(order):
                prod = window[i] * g.multipliers[i]
                assert prod < 2**63  # the recipe promises no int64 overflow
                mixed ^= prod
            row.append(g.offsets[h] + mixed % g.sizes[h])
        out.append(row)
    return out


def random_tokens(rng, g, size, eos_rate=0.1):
    toks = rng.integers(0, g.vocab_size, size=size)
    toks[rng.random(size) < eos_rate] = g.eos_token_id
    return toks


@pytest.mark.parametrize("ordinal", [0, 1])
def test_matches_reference_fresh_random(ordinal, rng):
    g = PLEGeometry.from_config(CFG, ordinal)
    for _ in range(5):
        toks = random_tokens(rng, g, int(rng.integers(1, 200)))
        ctx = random_tokens(rng, g, 2, eos_rate=0.3)
        got = ngram_ids(g, toks, ctx)
        assert got.dtype == np.int64 and got.shape == (toks.size, 16)
        assert got.tolist() == reference_ids(g, toks.tolist(), ctx.tolist())
        fresh = ngram_ids(g, toks)
        assert fresh.tolist() == reference_ids(g, toks.tolist(), [g.eos_token_id] * 2)
        assert np.all((got >= 0) & (got < g.num_rows))


def test_eos_rule_by_hand():
    g = PLEGeometry.from_config(CFG)
    e = g.eos_token_id
    # token "9" after EOS: window (9, EOS, EOS) even though the context holds real tokens
    a = ngram_ids(g, [5, e, 9], [7, 8])
    b = ngram_ids(g, [9], [e, e])
    assert a[2].tolist() == b[0].tolist()
    # an EOS as the current token does not cut its own window
    c = ngram_ids(g, [e], [7, 8])
    d = ngram_ids(g, [e], [e, e])
    assert c[0].tolist() != d[0].tolist()


def test_packed_equals_per_request(rng):
    g = PLEGeometry.from_config(CFG, 1)
    lens = rng.integers(0, 40, size=9)
    lens[3] = 0  # an empty request in the middle
    reqs = [random_tokens(rng, g, int(n)) for n in lens]
    ctxs = np.stack([random_tokens(rng, g, 2, 0.3) for _ in reqs])
    qsl = np.concatenate([[0], np.cumsum(lens)])
    packed = ngram_ids_packed(g, np.concatenate(reqs), qsl, ctxs)
    expect = np.concatenate([ngram_ids(g, r, c) for r, c in zip(reqs, ctxs)])
    np.testing.assert_array_equal(packed, expect)


@settings(max_examples=60, deadline=None)
@given(
    data=st.lists(st.sampled_from([0, 1, 2, 7, 248044, 248319, 123456]), min_size=0, max_size=50),
    cuts=st.lists(st.integers(0, 50), max_size=5),
    ctx=st.lists(st.sampled_from([0, 3, 248044, 248319]), min_size=2, max_size=2),
)
def test_chunked_equals_whole(data, cuts, ctx):
    g = PLEGeometry.from_config(CFG)
    toks = np.array(data, dtype=np.int64)
    whole = ngram_ids(g, toks, ctx)
    bounds = sorted({0, len(data), *[min(c, len(data)) for c in cuts]})
    context = np.array(ctx)
    parts = []
    for lo, hi in itertools.pairwise(bounds):
        parts.append(ngram_ids(g, toks[lo:hi], context))
        context = next_context(g, toks[lo:hi], context)
    got = np.concatenate(parts) if parts else np.empty((0, 16), dtype=np.int64)
    np.testing.assert_array_equal(got, whole)


def test_bad_inputs_are_named():
    g = PLEGeometry.from_config(CFG)
    with pytest.raises(GeometryError, match=r"tokens\[2\] = 248320 is not a token id"):
        ngram_ids(g, [1, 2, 248320])
    with pytest.raises(GeometryError, match=r"tokens\[0\] = -1"):
        ngram_ids(g, [-1])
    with pytest.raises(GeometryError, match=r"contexts has shape \[1, 3\], expected \[1, 2\]"):
        ngram_ids(g, [1], [1, 2, 3])
    with pytest.raises(GeometryError, match="query_start_loc"):
        ngram_ids_packed(g, [1, 2, 3], [0, 2])
    with pytest.raises(GeometryError, match="must hold integer token ids"):
        ngram_ids(g, [1.5])
    with pytest.raises(GeometryError, match=r"tokens has shape \[2, 2\], expected 1-D \[T\]"):
        ngram_ids(g, [[1, 2], [3, 4]])

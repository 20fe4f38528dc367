"""Pure parts of ``validate ab``: metrics against float64 references, prompt files, verdicts."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from flashnext.errors import ValidationError
from flashnext.validate import ab_metrics as M
from flashnext.validate.ab import Thresholds, summarize_ab, teacher_forced, verdict
from flashnext.validate.ab_prompts import fill_repeats, load_prompts


def _logsoftmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max()
    return x - np.log(np.exp(x).sum())


def _topk(lp: np.ndarray, k: int) -> dict[int, float]:
    """What a server sends: the top k token ids with float32-rounded logprobs."""
    idx = np.argsort(-lp, kind="stable")[:k]
    return {int(i): float(np.float32(lp[i])) for i in idx}


def _reference(lp_p: np.ndarray, lp_q: np.ndarray, k: int) -> tuple[float, float, float]:
    """float64 KL and TV on {each token in both top-k sets} + {rest}, and the full KL."""
    p, q = np.exp(lp_p), np.exp(lp_q)
    common = sorted(
        set(np.argsort(-lp_p, kind="stable")[:k]) & set(np.argsort(-lp_q, kind="stable")[:k])
    )
    pb = np.append(p[common], 1 - p[common].sum())
    qb = np.append(q[common], 1 - q[common].sum())
    kl = float(np.sum(pb * np.log(pb / qb)))
    tv = 0.5 * float(np.abs(pb - qb).sum())
    return kl, tv, float(np.sum(p * (lp_p - lp_q)))


@pytest.mark.parametrize("k", [1, 5, 20])
def test_kl_tv_match_float64_reference_and_bound_the_full_kl(rng, k):
    vocab = 64
    for _ in range(50):
        base = rng.standard_normal(vocab) * rng.uniform(0.5, 4)
        lp_p = _logsoftmax(base)
        lp_q = _logsoftmax(base + rng.standard_normal(vocab) * rng.uniform(0.01, 1))
        kl, tv = M.kl_tv(_topk(lp_p, k), _topk(lp_q, k))
        ref_kl, ref_tv, full_kl = _reference(lp_p, lp_q, k)
        assert kl == pytest.approx(ref_kl, rel=1e-4, abs=1e-6)
        assert tv == pytest.approx(ref_tv, rel=1e-4, abs=1e-6)
        assert kl <= full_kl + 1e-6  # a coarsening never overstates the divergence


def test_full_support_gives_the_exact_kl(rng):
    lp_p = _logsoftmax(rng.standard_normal(32) * 3)
    lp_q = _logsoftmax(rng.standard_normal(32) * 3)
    p = {i: float(v) for i, v in enumerate(lp_p)}
    q = {i: float(v) for i, v in enumerate(lp_q)}
    kl, tv = M.kl_tv(p, q)
    assert kl == pytest.approx(float(np.sum(np.exp(lp_p) * (lp_p - lp_q))), rel=1e-9)
    assert tv == pytest.approx(0.5 * float(np.abs(np.exp(lp_p) - np.exp(lp_q)).sum()), rel=1e-9)
    assert M.kl_tv(p, p) == (0.0, 0.0)


def test_disjoint_supports_compare_only_the_rest_bucket():
    p = {1: math.log(0.6), 2: math.log(0.3)}
    q = {3: math.log(0.9)}
    kl, tv = M.kl_tv(p, q)  # both rest buckets hold all the mass: the bound is 0
    assert (kl, tv) == (0.0, 0.0)
    assert M.top1(p) != M.top1(q)  # which is why top-1 agreement is reported beside it


def test_first_difference_and_agreement_on_random_sequences(rng):
    for _ in range(100):
        a = rng.integers(0, 50, size=int(rng.integers(0, 30))).tolist()
        b = list(a)
        if a and rng.random() < 0.7:
            at = int(rng.integers(0, len(a)))
            b[at] = a[at] + 1
            ref = at
        else:
            ref = None
        assert M.first_difference(a, b) == ref
        same = sum(x == y for x, y in zip(a, b))
        assert M.token_agreement(a, b) == (same / len(a) if a else 1.0)
    assert M.first_difference([1, 2], [1, 2, 3]) == 2
    assert M.token_agreement([1, 2], [1, 2, 3, 4]) == 0.5


def test_top1_breaks_ties_by_token_id():
    assert M.top1({9: -1.0, 4: -1.0, 7: -2.0}) == 4
    with pytest.raises(ValueError):
        M.top1({})


def test_teacher_forced_pools_positions(rng):
    lps = [_logsoftmax(rng.standard_normal(40) * 2) for _ in range(6)]
    base = [_topk(lp, 5) for lp in lps]
    tokens = [M.top1(d) for d in base]
    tf = teacher_forced(base, [dict(d) for d in base], tokens)
    assert tf["top1_agreement"] == 1.0 and tf["kl"] == {"mean": 0.0, "max": 0.0}
    other = [_topk(_logsoftmax(rng.standard_normal(40) * 2), 5) for _ in range(6)]
    tf = teacher_forced(base, other, tokens)
    assert tf["kl"]["max"] == max(M.kl_tv(p, q)[0] for p, q in zip(base, other))
    with pytest.raises(ValueError, match="lengths differ"):
        M.position_divergence(base, other[:5], tokens)


def _row(first, agreement, kls, same):
    return {
        "id": "x",
        "first_difference": first,
        "token_agreement": agreement,
        "tf": {"per_position": {"kl": kls, "tv": kls, "top1_same": same}},
        "error": None,
    }


def test_verdict_statuses():
    th = Thresholds()
    ident = summarize_ab([_row(None, 1.0, [0.0, 0.0], [True, True])])
    assert verdict(ident, th)["status"] == "identical"
    # the same tokens and scores, but one side stopped where the other ran out of tokens
    ends = _row(None, 1.0, [0.0, 0.0], [True, True])
    ends.update(baseline={"finish_reason": "length"}, candidate={"finish_reason": "stop"})
    v = verdict(summarize_ab([ends, _row(None, 1.0, [0.0], [True])]), th)
    assert v["status"] == "pass" and v["passed"]
    assert v["reasons"] == ["1 prompt ends with another finish_reason (first: x, length -> stop)"]
    assert summarize_ab([ends])["identical"] == 0
    close = summarize_ab([_row(5, 0.9, [1e-4] * 40, [True] * 40)])
    assert verdict(close, th)["status"] == "pass"
    far = summarize_ab([_row(0, 0.1, [0.5] * 10, [False, True] * 5)])
    v = verdict(far, th)
    assert v["status"] == "fail" and not v["passed"]
    assert any("top1_agreement" in r for r in v["reasons"])
    broken = summarize_ab(
        [_row(None, 1.0, [0.0], [True]), {"id": "y", "error": {"side": "candidate"}}]
    )
    assert verdict(broken, th)["status"] == "error"
    # an interrupted run is never a pass, whatever its finished prompts say
    for summary, n in ((ident, 1), (summarize_ab([]), 0)):
        stop = {"signal": "SIGINT", "prompts_done": n, "prompts_total": 3}
        v = verdict(summary, th, None, stop)
        assert v["status"] == "interrupted" and v["passed"] is False
        assert v["reasons"][0] == (
            f"interrupted by SIGINT after {n} of 3 prompts: the numbers cover those only"
        )


def test_default_prompt_set_is_varied():
    prompts = load_prompts()
    cats = {p.category for p in prompts}
    assert {"code", "math", "multilingual", "long"} <= cats
    longs = [p for p in prompts if p.fill_fraction]
    assert longs and all("{fill}" not in json.dumps(p.filled(3).messages) for p in longs)
    assert fill_repeats(100, 30, 400) == 10 and fill_repeats(500, 30, 400) == 0


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", "line 2: not JSON"),
        ('{"prompt": "x"}', 'string "id"'),
        ('{"id": "b", "prompt": "x", "messages": []}', "exactly one of"),
        ('{"id": "b", "prompt": "x", "fill_fraction": 0.5}', "has no {fill}"),
        ('{"id": "b", "prompt": "{fill}", "fill_fraction": 1.5}', "in (0, 1)"),
        ('{"id": "a", "prompt": "x"}', "duplicate id"),
    ],
)
def test_bad_prompt_files_name_the_line(tmp_path: Path, line: str, message: str):
    path = tmp_path / "p.jsonl"
    path.write_text('{"id": "a", "prompt": "hello"}\n' + line + "\n")
    with pytest.raises(ValidationError, match=message.replace("(", r"\(").replace(")", r"\)")) as e:
        load_prompts(path)
    assert str(path) in str(e.value)


# ---- recorded baseline answers (flashnext.validate.ab_answers) ----
def _answers_file(tmp_path: Path, rng: np.random.Generator) -> tuple[Path, list[dict]]:
    """An answers file as a live run writes it: random prompts, ids, continuations and top-K."""
    from flashnext.records import make_record
    from flashnext.validate.ab_answers import answer_line, answers_header, render_answers
    from flashnext.validate.ab_prompts import Prompt
    from flashnext.validate.ab_server import Generation

    lines = []
    for i in range(3):
        ids = [int(t) for t in rng.integers(0, 1000, int(rng.integers(3, 9)))]
        gen = Generation([int(t) for t in rng.integers(0, 1000, 5)], f"text {i}", "length")
        tf = [{int(t): float(-rng.random()) for t in rng.integers(0, 1000, 4)} for _ in range(5)]
        msg = [{"role": "user", "content": f"question {i} {rng.random()}"}]
        p = Prompt(f"p{i}", "general", messages=msg) if i else Prompt("p0", "code", text="x = ")
        lines.append({"prompt": p, "ids": ids, "gen": gen, "tf": tf})
    ab = make_record("flashnext.validate.ab", {
        "baseline": {"url": "http://127.0.0.1:8000", "model": "m", "version": "0.32.0",
                     "max_model_len": 512, "teacher_forcing": "prompt_logprobs"},
        "config": {"max_tokens": 5, "top_logprobs": 4, "seed": 3, "prompts_source": "default"},
    })  # fmt: skip
    text = render_answers(
        answers_header(ab), [answer_line(x["prompt"], x["ids"], x["gen"], x["tf"]) for x in lines]
    )
    path = tmp_path / "rec" / "baseline-answers.jsonl"
    path.parent.mkdir()
    path.write_text(text)
    return path, lines


def test_recorded_side_answers_what_was_recorded(tmp_path: Path, rng):
    import asyncio

    from flashnext.validate.ab_answers import RecordedSide

    path, lines = _answers_file(tmp_path, rng)
    side = RecordedSide.load(path.parent)  # the run's --out directory
    assert side.config == {"max_tokens": 5, "top_logprobs": 4, "seed": 3}
    assert [p.id for p in side.prompts] == ["p0", "p1", "p2"]
    assert side.info()["recorded"] == str(path) and side.info()["requests"] == 0

    async def replay() -> None:
        for p, x in zip(side.prompts, lines):
            ids = await side.tokenize(p.messages, p.text)
            assert ids == x["ids"]
            gen = await side.generate(ids, 5, 4, 3)
            assert gen == x["gen"]
            dists = await side.score(ids + gen.token_ids, 4)
            assert dists[: len(ids)] == [{}] * len(ids) and dists[len(ids) :] == x["tf"]

    asyncio.run(replay())


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda ls: ["{not json", *ls[1:]], "not JSON lines"),
        (lambda ls: [ls[0].replace("ab_answers", "ab"), *ls[1:]], "not a baseline answers file"),
        (
            lambda ls: [ls[0].replace('"schema_version": 1', '"schema_version": 9'), *ls[1:]],
            "schema_version 9, expected 1",
        ),
        (lambda ls: [*ls[:2], '{"id": "x"}', *ls[3:]], "line 3 is not a recorded prompt"),
        (lambda ls: ls[:1], "records no prompt"),
    ],
)
def test_bad_answers_files_are_named(tmp_path: Path, rng, mutate, message):
    from flashnext.validate.ab_answers import RecordedSide

    path, _ = _answers_file(tmp_path, rng)
    path.write_text("\n".join(mutate(path.read_text().splitlines())) + "\n")
    with pytest.raises(ValidationError, match=message) as err:
        RecordedSide.load(path)
    assert str(path) in str(err.value)


def test_recorded_baseline_flags_are_checked_before_any_request(tmp_path: Path, rng):
    """The recorded settings are replayed; a flag that would ask the candidate something else
    is refused (exit 2, naming it), and --out may not hold the recording."""
    from ..cli.runner import run_here as run

    path, _ = _answers_file(tmp_path, rng)
    cand = ["--candidate", "http://127.0.0.1:9"]  # nothing listens there: never reached
    for flags, named in (
        (["--max-tokens", "6"], "--max-tokens 6: the recorded baseline"),
        (["--seed", "0"], "--seed 0: the recorded baseline"),
        (["--prompts", str(path)], "--prompts: the recorded baseline"),
        (["--baseline-served-model", "m"], "--baseline-served-model: the recorded baseline"),
        (["--out", str(path.parent)], "--out"),
    ):
        done = run("validate", "ab", "--baseline", path.parent, *cand, *flags)
        assert done.returncode == 2 and named in done.stderr, (flags, done.stderr)
    done = run("validate", "ab", "--baseline", tmp_path / "none", *cand)
    assert done.returncode == 2 and "or the answers an earlier run recorded" in done.stderr
    path.write_text("{}\n")
    done = run("validate", "ab", "--baseline", path, *cand)
    assert done.returncode == 2 and "not a baseline answers file" in done.stderr


def test_recording_an_unreachable_server_is_one_error_line(tmp_path: Path):
    """Record-only (no --candidate) against a port nothing listens on: exit 1, one error line
    naming the baseline, nothing on stdout, no answers file."""
    from ..cli.inputs import closed_port
    from ..cli.runner import run_here as run

    url = f"http://127.0.0.1:{closed_port()}"
    done = run("validate", "ab", "--baseline", url, "--out", tmp_path / "rec")
    assert done.returncode == 1, done.stderr
    assert done.stdout == ""
    lines = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and lines[0].startswith("error: baseline: unreachable"), done.stderr
    assert not (tmp_path / "rec" / "baseline-answers.jsonl").exists()

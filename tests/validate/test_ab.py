"""``flashnext validate ab`` against real vLLM servers on 127.0.0.1.

The tiny test model ties its output layer to its input embeddings, which makes it repeat its
input token whatever its weights (a perturbation changes nothing visible). The A/B model used
here is the same tiny model with an untied random output layer (``lm_head``, logit spread ~2.4),
written as a real checkpoint; perturbed copies add Gaussian noise of a chosen size relative to
each tensor's RMS. Servers: the A/B model twice (identical pair, then killed mid-run), once with
KV blocks of 32 tokens, and two perturbed copies, all started side by side by one fixture (a start
is mostly vLLM's single-threaded imports: together they keep a 2-core machine's cores busy).
"""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from devtools.vllm_cpu import VllmServer, start_all
from flashnext.records import check_record, make_record
from flashnext.validate.ab import KIND, AbConfig, run_ab
from flashnext.validate.ab_prompts import load_prompts
from flashnext.validate.ab_report import write_ab

from ..cli.runner import run

NOISE = (0.02, 0.3)  # relative to each tensor's RMS
MAX_TOKENS = "24"
PROMPTS = [
    {"id": "code", "category": "code", "messages": [{"role": "user", "content": "def add(a, b):"}]},
    {"id": "fr", "category": "multilingual", "prompt": "Explique pourquoi le ciel est bleu."},
    {
        "id": "long",
        "category": "long",
        "fill_fraction": 0.5,
        "filler": "Grain, rain and river levels. ",
        "messages": [{"role": "user", "content": "Notes:\n{fill}\nWhat did the clerks copy?"}],
    },
]


def _write_model(src: Path, dst: Path, tensors: dict[str, np.ndarray], untie: bool) -> Path:
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.copytree(src, tmp)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    if untie:
        config = json.loads((tmp / "config.json").read_text())
        config["tie_word_embeddings"] = False
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tmp.rename(dst)
    return dst


def perturbed(tensors: dict[str, np.ndarray], rel: float, seed: int) -> dict[str, np.ndarray]:
    """Each tensor plus Gaussian noise of ``rel`` times its RMS (so ||noise|| ~ rel ||w||)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, w in tensors.items():
        rms = float(np.sqrt(np.mean(w.astype(np.float64) ** 2)))
        out[name] = (w + rel * rms * rng.standard_normal(w.shape)).astype(w.dtype)
    return out


@pytest.fixture(scope="module")
def ab_models(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The A/B model (untied random lm_head) and its perturbed copies, keyed base / noise."""
    root = tmp_path_factory.mktemp("ab-models")
    tensors = load_file(str(tiny_model / "model.safetensors"))
    emb = tensors["model.embed_tokens.weight"]
    tensors["lm_head.weight"] = (np.random.default_rng(7).standard_normal(emb.shape) * 0.3).astype(
        emb.dtype
    )
    models = {"base": _write_model(tiny_model, root / "base", tensors, untie=True)}
    for i, rel in enumerate(NOISE):
        models[str(rel)] = _write_model(
            models["base"], root / f"noise-{rel}", perturbed(tensors, rel, seed=100 + i), False
        )
    return models


class AbServer(VllmServer):
    """A test server given more time to come up: this file starts several on a shared machine."""

    def wait_healthy(self, timeout_s: float = 600.0) -> None:
        super().wait_healthy(timeout_s)


# The servers each test uses: (model key, extra server arguments) by server name.
SERVERS = {
    "base": ("base", []),
    "same": ("base", []),
    "block32": ("base", ["--block-size", "32"]),
    **{f"noise-{rel}": (str(rel), []) for rel in NOISE},
}
USES = {
    "test_same_model_twice_is_identical": ("base", "same"),
    "test_attention_block_size_pair_is_reported_as_measured": ("base", "block32"),
    "test_perturbed_weights_diverge_and_kl_grows_with_noise": (
        "base",
        *(f"noise-{r}" for r in NOISE),
    ),
    "test_candidate_killed_mid_run_is_a_recorded_failure": ("base", "same"),
    "test_baseline_recorded_alone_then_a_candidate_against_it": ("base", "same"),
}


@pytest.fixture(scope="module")
def ab_servers(
    request: pytest.FixtureRequest,
    vllm_python: Path,
    ab_models: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, VllmServer]]:
    """Every server the selected tests of this module use, started together, by name."""
    wanted = {
        name
        for item in request.session.items
        if getattr(item, "module", None) is request.module
        for name in USES.get(getattr(item, "originalname", ""), ())
    }
    logs = tmp_path_factory.mktemp("ab-logs")
    servers = {
        name: AbServer(vllm_python, ab_models[SERVERS[name][0]], logs, SERVERS[name][1], fork=True)
        for name in SERVERS
        if name in wanted
    }
    try:
        start_all(list(servers.values()))
        yield servers
    finally:
        for s in servers.values():
            s.stop()


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ab-prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return path


def run_cli(base: str, cand: str, prompts: Path, out: Path) -> tuple[int, dict]:
    p = run(
        "validate", "ab", "--baseline", base, "--candidate", cand, "--prompts", str(prompts),
        "--max-tokens", MAX_TOKENS, "--out", str(out), "--json",
    )  # fmt: skip
    assert p.returncode in (0, 1), p.stderr[-3000:]
    record = json.loads(p.stdout)
    assert record == json.loads((out / "ab.json").read_text())
    return p.returncode, record


def test_same_model_twice_is_identical(ab_servers, prompts_file, tmp_path):
    base, same = ab_servers["base"], ab_servers["same"]
    rc, record = run_cli(base.url, same.url + "/v1", prompts_file, tmp_path)
    assert rc == 0, record["verdict"]
    check_record(record, kind=KIND, schema_version=1)
    assert record["verdict"]["status"] == "identical"
    for side in ("baseline", "candidate"):
        info = record[side]
        assert info["version"] == "0.32.0"
        assert info["max_model_len"] == 512
        assert info["models"]["data"][0]["id"] == str(base.model)
        assert info["teacher_forcing"] == "prompt_logprobs"
    rows = {r["id"]: r for r in record["prompts"]}
    assert set(rows) == {"code", "fr", "long"}
    assert 230 <= rows["long"]["prompt_tokens"] <= 256  # filled to ~0.5 of max_model_len
    for r in rows.values():
        assert r["error"] is None and r["first_difference"] is None
        assert r["baseline"]["token_ids"] == r["candidate"]["token_ids"]
        assert len(r["baseline"]["token_ids"]) == int(MAX_TOKENS)
        assert r["tf"]["positions"] == int(MAX_TOKENS) and r["tf"]["kl"]["max"] == 0.0
    # 3 prompts x (tokenize + generate + score) per server, + the long prompt's filling
    # (3 on the baseline) + /version and /v1/models on each.
    assert record["cost"]["requests"] == {"baseline": 14, "candidate": 11}
    assert (tmp_path / "ab.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (tmp_path / "ab.md").read_text()
    assert "IDENTICAL" in md
    # Both deployment records, captured by port; the launches differ only in --port.
    deps = record["deployments"]
    for side, server in (("baseline", base), ("candidate", same)):
        rec = check_record(deps[side], kind="flashnext.deploy.record")
        assert rec["launch"]["source"] == "port" and rec["captured"]["pid"] == server.proc.pid
        assert rec["server"]["version"] == "0.32.0"
        assert f"--port {server.port}" in " ".join(rec["launch"]["argv"])
        assert f"- {side}: server 0.32.0, launch from port: `" in md
    assert [(c["name"], c["before"], c["after"]) for c in deps["differences"] if c["variable"]] == [
        ("--port", str(base.port), str(same.port))
    ]
    assert "## Deployments" in md and f"--port: '{base.port}' -> '{same.port}'" in md


def test_attention_block_size_pair_is_reported_as_measured(ab_servers, prompts_file, tmp_path):
    """The KV-cache-dtype pair is not possible here: vllm-cpu 0.32 refuses --kv-cache-dtype fp8,
    fp8_e4m3 and fp8_e5m2 on this CPU ("FP8 KV cache on CPU requires x86 with AVX-512 or AMX").
    The attention setting it does offer: the KV block size, 32 tokens instead of the default 128
    (16 is refused: "No common block size for 16 (CPU_ATTN: [MultipleOf(32)])"), so attention
    reads the same keys and values through four times as many blocks. Whether the answers stay
    the same is measured and reported, not assumed; the figures must agree with each other."""
    base, cand = ab_servers["base"], ab_servers["block32"]
    try:
        rc, record = run_cli(base.url, cand.url, prompts_file, tmp_path)
    finally:
        cand.stop()  # no later test uses it
    s, v = record["summary"], record["verdict"]
    print(f"block size 128 vs 32: {v['status']} KL mean {s['kl']['mean']} max {s['kl']['max']} "
          f"top-1 {s['top1_agreement']} tokens {s['token_agreement']} "
          f"first diff {s['first_difference']}")  # fmt: skip
    assert v["status"] in ("identical", "pass", "fail") and rc == (0 if v["passed"] else 1)
    assert s["compared"] == s["prompts"] == 3 and s["identical"] + s["differing"] == 3
    assert s["tf_positions"] == 3 * int(MAX_TOKENS)
    for r in record["prompts"]:
        same_tokens = r["baseline"]["token_ids"] == r["candidate"]["token_ids"]
        assert (r["first_difference"] is None) == same_tokens
        assert 0.0 <= r["tf"]["kl"]["mean"] <= r["tf"]["kl"]["max"]
    assert (v["status"] == "identical") == (s["differing"] == 0 and s["kl"]["max"] == 0.0)
    diff = record["deployments"]["differences"]
    assert {c["name"] for c in diff if c["variable"]} == {"--port", "--block-size"}
    assert ("--block-size", None, "32") in [(c["name"], c["before"], c["after"]) for c in diff]
    cache = {c["name"]: c for c in diff if c["name"].startswith("cache_config ")}
    assert cache["cache_config block_size"]["before"] == "128"
    assert cache["cache_config block_size"]["after"] == "32"
    assert not cache["cache_config block_size"]["variable"]


def test_perturbed_weights_diverge_and_kl_grows_with_noise(ab_servers, prompts_file, tmp_path):
    """Against the live baseline, then against the answers it recorded in that run: the
    recorded baseline gives the live comparison's numbers exactly and asks the baseline
    nothing."""
    base = ab_servers["base"]
    noisy = [ab_servers[f"noise-{rel}"] for rel in NOISE]
    recorded = tmp_path / str(NOISE[0])
    try:
        small_live = run_cli(base.url, noisy[0].url, prompts_file, recorded)[1]
        _, small = run_replay(recorded, noisy[0].url, tmp_path / "replay-small")
        rc_large, large = run_replay(recorded, noisy[1].url, tmp_path / str(NOISE[1]))
    finally:
        for s in noisy:
            s.stop()  # no later test uses them
    assert small["baseline"]["recorded"] == str(recorded / "baseline-answers.jsonl")
    assert small["cost"]["requests"]["baseline"] == 0 and small["config"]["max_tokens"] == 24
    assert small["summary"] == small_live["summary"] and small["verdict"] == small_live["verdict"]
    for live, replay in zip(small_live["prompts"], small["prompts"]):
        for key in ("prompt_tokens", "baseline", "candidate", "first_difference", "tf"):
            assert replay[key] == live[key], (live["id"], key)
    assert small["deployments"]["baseline"]["error"].startswith("recorded answers")
    kl_small, kl_large = small["summary"]["kl"]["mean"], large["summary"]["kl"]["mean"]
    for rel, rec in ((NOISE[0], small), (NOISE[1], large)):
        s = rec["summary"]
        print(f"noise {rel}: {rec['verdict']['status']} KL mean {s['kl']['mean']:.3g} "
              f"top-1 {s['top1_agreement']:.3f} tokens {s['token_agreement']:.3f}")  # fmt: skip
    assert 0 < kl_small < kl_large / 4, (kl_small, kl_large)  # KL ~ noise^2: 225x expected
    assert rc_large == 1 and large["verdict"]["status"] == "fail"
    assert large["summary"]["top1_agreement"] < small["summary"]["top1_agreement"]
    firsts = [r["first_difference"] for r in large["prompts"]]
    assert all(isinstance(f, int) and 0 <= f < int(MAX_TOKENS) for f in firsts), firsts
    for r in large["prompts"]:
        f = r["first_difference"]
        assert r["baseline"]["token_ids"][:f] == r["candidate"]["token_ids"][:f]
        assert r["baseline"]["token_ids"][f] != r["candidate"]["token_ids"][f]
    md = (tmp_path / str(NOISE[1]) / "ab.md").read_text()
    assert "FAIL" in md and "## Worst prompts" in md


def test_baseline_recorded_alone_then_a_candidate_against_it(ab_servers, prompts_file, tmp_path):
    """One GPU: record the baseline with no candidate (only it is asked), then compare another
    server of the same model with the recording: identical, as live."""
    base, same = ab_servers["base"], ab_servers["same"]
    rec = tmp_path / "before"
    p = run("validate", "ab", "--baseline", base.url, "--prompts", prompts_file,
            "--max-tokens", MAX_TOKENS, "--out", rec)  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.startswith(f"recorded 3 of 3 prompts of {base.model} ({base.url})"), p.stdout
    assert sorted(x.name for x in rec.iterdir()) == [".flashnext-files.json",
                                                     "baseline-answers.jsonl"]  # fmt: skip
    lines = [json.loads(x) for x in (rec / "baseline-answers.jsonl").read_text().splitlines()]
    check_record(lines[0], kind="flashnext.validate.ab_answers", schema_version=1)
    assert [x["id"] for x in lines[1:]] == ["code", "fr", "long"]
    assert all(len(x["teacher_forced"]) == int(MAX_TOKENS) for x in lines[1:])
    rc, record = run_replay(rec, same.url, tmp_path / "after")
    assert rc == 0 and record["verdict"]["status"] == "identical", record["verdict"]
    assert record["cost"]["requests"]["baseline"] == 0
    assert 230 <= {r["id"]: r for r in record["prompts"]}["long"]["prompt_tokens"] <= 256
    # a recording cannot be replayed without a candidate
    p = run("validate", "ab", "--baseline", rec, "--out", tmp_path / "x")
    assert p.returncode == 2 and "--candidate" in p.stderr


def run_replay(recorded: Path, cand: str, out: Path) -> tuple[int, dict]:
    """``validate ab`` of ``cand`` against the answers recorded in ``recorded`` (an earlier
    run's --out), with the settings the recording holds."""
    p = run("validate", "ab", "--baseline", recorded, "--candidate", cand, "--out", out, "--json")
    assert p.returncode in (0, 1), p.stderr[-3000:]
    assert not (out / "baseline-answers.jsonl").exists()  # nothing new was recorded
    return p.returncode, json.loads(p.stdout)


def test_candidate_killed_mid_run_is_a_recorded_failure(ab_servers, prompts_file, tmp_path):
    base, victim = ab_servers["base"], ab_servers["same"]
    cfg = AbConfig(base.url, victim.url, load_prompts(prompts_file), max_tokens=int(MAX_TOKENS))

    def kill_after_first(done: int, total: int, prompt_id: str) -> None:
        if done == 1:
            victim.kill_engine()  # SIGKILL: the candidate vanishes between two prompts

    payload = asyncio.run(run_ab(cfg, kill_after_first))
    assert payload["verdict"]["status"] == "error" and not payload["verdict"]["passed"]
    errors = [r["error"] for r in payload["prompts"] if r.get("error")]
    assert len(errors) == 2 and {e["side"] for e in errors} == {"candidate"}
    assert errors[0]["kind"] == "unreachable" and payload["candidate"]["down"]
    assert sum(1 for r in payload["prompts"] if not r.get("error")) == 1
    written = write_ab(make_record(KIND, payload), tmp_path / "mid")
    assert written.failed == [] and "## Failures" in written.paths[1].read_text()

    # The CLI on a dead candidate: a report with the failure, exit status 1.
    rc, record = run_cli(base.url, victim.url, prompts_file, tmp_path / "cli")
    assert rc == 1 and record["verdict"]["status"] == "error"
    assert record["setup_error"]["side"] == "candidate"
    md = (tmp_path / "cli" / "ab.md").read_text()
    assert "unreachable" in md
    deps = record["deployments"]
    assert deps["baseline"]["launch"]["source"] == "port" and deps["differences"] is None
    assert "unreachable" in deps["candidate"]["error"]
    assert "- candidate: not captured (" in md and "Differences: unknown" in md


def test_bad_flags_exit_2(tmp_path):
    p = run("validate", "ab", "--baseline", "localhost:8000", "--candidate", "http://x")
    assert p.returncode == 2 and "--baseline" in p.stderr and "server root" in p.stderr
    p = run("validate", "ab", "--baseline", "http://a", "--candidate", "http://b",
                  "--max-tokens", "0")  # fmt: skip
    assert p.returncode == 2 and "--max-tokens" in p.stderr

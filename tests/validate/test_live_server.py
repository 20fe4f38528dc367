"""End-to-end runs of ``flashnext validate`` against real vLLM servers on 127.0.0.1.

The concurrency stage keeps the notes' shape (3 rounds of 16, temperature 0.8) with max_tokens
scaled to the tiny model's max_model_len of 512 (128: a quarter, so the rounds stay short).
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from devtools.vllm_cpu import VllmServer, free_port
from flashnext.records import check_record
from flashnext.validate.probes import metric_value, parse_prometheus
from flashnext.validate.stages import Config, run_validation

from ..cli.runner import popen, run

SCALED = [
    "--max-tokens",
    "128",
    "--sustained-seconds",
    "6",
    "--sustained-max-tokens",
    "64",
    "--ready-timeout",
    "30",
    "--recovery-timeout",
    "30",
]


def by_name(report: dict) -> dict[str, dict]:
    return {s["name"]: s for s in report["stages"]}


def test_all_stages_pass_or_skip_against_vllm(vllm_server: VllmServer, tmp_path: Path) -> None:
    out = tmp_path / "a"
    p = run(
        "validate", "--url", vllm_server.url + "/v1", "--out", str(out), "--json", *SCALED
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    report = json.loads(p.stdout)
    assert report == json.loads((out / "report.json").read_text())
    assert sorted(x.name for x in out.iterdir()) == [
        ".flashnext-files.json", "report.json", "report.md", "report.png"
    ]  # fmt: skip
    assert (out / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    check_record(report, kind="flashnext.validate.report", schema_version=2)
    assert report["environment"]["command"][1:3] == ["validate", "--url"]  # argv[0] is "-c"
    assert report["passed"] is True and report["failed_stages"] == []
    assert report["interrupted"] is None
    env = report["server"]
    assert env["server_version"] == "0.32.0"
    assert env["max_model_len"] == 512
    assert env["cache_config_info"]["enable_prefix_caching"] == "True"
    assert report["probes"]["nvml"]["status"] == "ok" or report["probes"]["nvml"][
        "status"
    ].startswith("not available: ")
    assert report["probes"]["metrics"]["available"] is True
    # The deployment record of exactly what passed (the local process found by its port).
    deployment = check_record(report["deployment"], kind="flashnext.deploy.record")
    assert deployment["launch"]["source"] == "port"
    assert "--max-model-len" in deployment["launch"]["argv"]
    assert "Deployment: server 0.32.0, launch from port" in (out / "report.md").read_text()
    # "slow" (a scrape past 10 s on a starved machine) is evidence; outages are not allowed
    assert [e for e in report["probes"]["metrics"]["events"] if e["kind"] != "slow"] == []
    assert len(report["probes"]["metrics"]["samples"]) >= 10

    s = by_name(report)
    assert [x["name"] for x in report["stages"]] == [
        "ready",
        "short",
        "long",
        "multimodal",
        "concurrency",
        "prefix-cache",
        "sustained",
    ]
    for name in ("ready", "short", "long", "concurrency", "prefix-cache", "sustained"):
        assert s[name]["status"] == "pass", s[name]
    assert s["ready"]["key"]["max_model_len"] == 512
    assert s["short"]["key"]["completion_tokens"] > 0
    assert s["short"]["evidence"]["request"]["prompt_tokens"] > 0
    assert s["multimodal"]["status"] == "skip"
    assert s["multimodal"]["reason"].startswith("not a multimodal model (server: HTTP 400:")
    # long: filled to ~90% of 512 as counted by the server's /tokenize
    assert s["long"]["key"]["counted_with"] == "tokenize"
    assert 0.75 <= s["long"]["key"]["fill"] <= 0.94
    assert isinstance(s["long"]["key"]["fact_retrieved"], bool)
    # concurrency: the notes' 3 x 16, all with a finish_reason
    c = s["concurrency"]
    assert c["key"]["completed"] == "48/48"
    assert [r["completed"] for r in c["evidence"]["rounds"]] == [16, 16, 16]
    for r in c["evidence"]["rounds"]:
        assert r["stopped"] + r["length_limited"] == 16
        assert r["ttft_s"]["p50"] > 0 and r["e2e_s"]["p90"] >= r["ttft_s"]["p90"]
        # Chunks bunched into one read have near-zero gaps, so the median may round to 0;
        # the mean gap is (last - first chunk) / (chunks - 1) and must be positive.
        assert r["itl_s"]["p50"] >= 0 and r["itl_s"]["mean"] > 0
        assert r["output_tokens_per_s"] > 0
        assert r["errors"] == {}
    # Each stage carries the /metrics readings taken while it ran. The server answers /metrics
    # on the event loop that streams the answers, so on two busy vCPUs a short stage's readings
    # may all land between its rounds (seen twice: six readings over the 5.5 s concurrency
    # stage, all after a round had ended): the running gauge is checked over the whole run.
    window = (c["t_start"], c["t_end"])
    samples = report["probes"]["metrics"]["samples"]
    assert c["evidence"]["probes"]["server"]["samples"] >= 1, (window, samples)
    peaks = {x["name"]: x["evidence"]["probes"]["server"]["peak_running"] for x in report["stages"]}
    # a stage shorter than the scrape interval has no reading (None; seen: `ready` in 74 ms)
    assert max(p for p in peaks.values() if p is not None) >= 1, (peaks, samples)
    # prefix cache: the warm requests hit the shared prefix
    assert s["prefix-cache"]["key"]["hit_tokens"] > 0
    assert s["prefix-cache"]["key"]["ttft_cold_s"] > 0
    sus = s["sustained"]
    assert sus["key"]["requests"] == sus["key"]["completed"] >= 8
    assert len(sus["evidence"]["windows"]) == 4

    md = (out / "report.md").read_text()
    assert md.startswith("# flashnext validate: PASSED")
    assert "| concurrency | pass |" in md and "completed 48/48" in md
    assert len(md.splitlines()) < 40  # one screen

    # A second, smaller run, and `compare` shows what changed between the two.
    out_b = tmp_path / "b"
    p2 = run(
        "validate",
        "--url",
        vllm_server.url,
        "--out",
        str(out_b),
        "--stages",
        "ready,short,concurrency",
        "--rounds",
        "1",
        "--concurrency",
        "4",
        "--max-tokens",
        "32",
    )
    assert p2.returncode == 0, p2.stderr[-3000:]
    assert "PASSED" in p2.stdout
    p3 = run(
        "validate", "compare", str(out / "report.json"), str(out_b / "report.json"), "--json"
    )
    assert p3.returncode == 0, p3.stderr
    record = check_record(json.loads(p3.stdout), kind="flashnext.validate.compare")
    diff = {row["name"]: row for row in record["stages"]}
    assert diff["concurrency"]["changed"]["completed"] == {"a": "48/48", "b": "4/4"}
    assert diff["sustained"]["status"] == ["pass", None]
    p4 = run("validate", "compare", str(out / "report.json"), str(out_b / "report.json"))
    assert "completed: 48/48 -> 4/4" in p4.stdout


def test_prometheus_parser_on_real_metrics(vllm_server: VllmServer) -> None:
    with urllib.request.urlopen(vllm_server.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    metrics = parse_prometheus(text)
    assert metric_value(metrics, "start_time") > 1e9
    assert metric_value(metrics, "running") is not None
    assert metric_value(metrics, "kv_usage") is not None
    assert metric_value(metrics, "prefix_queries") is not None
    labels, value = metrics["vllm:cache_config_info"][0]
    assert labels["block_size"].isdigit() and value == 1.0


def test_never_healthy_server_hits_the_deadline(tmp_path: Path) -> None:
    port = free_port()  # nothing listens there: every /health attempt is refused
    t = time.monotonic()
    p = run(
        "validate",
        "--url",
        f"http://127.0.0.1:{port}",
        "--ready-timeout",
        "2",
        "--out",
        str(tmp_path),
        "--no-png",
    )
    # The deadline is honoured (generous bound: this checks behaviour, not speed).
    assert time.monotonic() - t < 60
    assert p.returncode == 1
    report = json.loads((tmp_path / "report.json").read_text())
    ready = by_name(report)["ready"]
    assert ready["status"] == "fail"
    assert re.match(
        rf"http://127\.0\.0\.1:{port}/health did not answer HTTP 200 \(waited \d+ of "
        r"--ready-timeout 2 s; last: ConnectError", ready["reason"]
    ), ready["reason"]
    for s in report["stages"][1:]:
        assert (s["status"], s["reason"]) == ("skip", "the server never became ready")
    assert "unreachable" in report["deployment"]["error"]
    assert "did not answer HTTP 200" in p.stdout
    # stderr is not a terminal here: the wait is said as plain lines, not a silent spinner
    assert f"validate: ready: waiting up to 2 s for http://127.0.0.1:{port}/health" in p.stderr


def test_unreachable_at_start_without_ready_stage(tmp_path: Path) -> None:
    port = free_port()
    p = run(
        "validate", "--url", f"http://127.0.0.1:{port}", "--stages", "short", "--out", str(tmp_path)
    )
    assert p.returncode == 1
    assert p.stderr.strip().splitlines()[-1] == (
        f"error: GET http://127.0.0.1:{port}/v1/models gave no model list "
        "(ConnectError: All connection attempts failed) (add the 'ready' stage to wait for the server)"
    )


@pytest.mark.early_boot("supervised", supervise=True, fork=True)
def test_sigkill_mid_round_fails_stage_and_names_restart(early_boots, tmp_path: Path) -> None:
    server: VllmServer = early_boots["supervised"]  # launched early under the supervisor
    server.wait_healthy()
    cfg = Config(
        url=server.url,
        stages=("ready", "concurrency", "short"),
        rounds=3,
        concurrency=16,
        max_tokens=400,
        recovery_timeout_s=180,
        probe_interval_s=0.25,
    )
    round_started = threading.Event()
    killed = threading.Event()

    def progress(stage: str, message: str, fraction: float | None) -> None:
        if stage == "concurrency" and message.startswith("round 1/"):
            round_started.set()

    def killer() -> None:
        # SIGKILL mid-round: the trigger is the validator's own "round 1" event, not a gauge
        # sample (a short round on a loaded machine can finish between two /metrics reads).
        # Then kill at the first reading of a running request, or 0.5 s into the round.
        if not round_started.wait(timeout=120):
            return
        end = time.monotonic() + 0.5
        while time.monotonic() < end:
            try:
                with urllib.request.urlopen(server.url + "/metrics", timeout=0.5) as r:
                    running = metric_value(parse_prometheus(r.read().decode()), "running")
            except OSError:
                running = None
            if running:
                break
            time.sleep(0.02)
        server.kill_engine()
        killed.set()

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    result = asyncio.run(run_validation(cfg, progress=progress))
    thread.join(timeout=5)
    assert killed.is_set()
    assert server.starts == 2  # the supervisor brought it back

    from flashnext.validate.report import build_report, render_markdown, write_report

    assert result.failed_stages == ["concurrency"] and result.interrupted is None
    report = build_report(result, ["test"])
    write_report(report, tmp_path, png=True)
    s = by_name(report)
    assert report["passed"] is False and report["failed_stages"] == ["concurrency"]
    conc = s["concurrency"]
    assert conc["status"] == "fail"
    text = "\n".join(conc["failures"])
    # the kill lands in round 1 as a rule, in a later one when round 1 finished before the
    # killer saw the engine busy (a loaded machine), or between two rounds (the probe sees it
    # before the next starts): either way that round is the last one run
    rounds = conc["evidence"]["rounds"]
    lost = ("unreachable", "disconnected")  # refused, or reset while in flight
    hit = [r["round"] for r in rounds if any(r["errors"].get(k, 0) for k in lost)]
    assert hit in ([], [len(rounds)]), rounds
    assert f"server unreachable in round {len(rounds)}; remaining rounds not run" in text
    assert "server unreachable at t=" in text and f"GET {server.url}/metrics" in text
    assert "server restarted at t=" in text and "process_start_time_seconds changed" in text
    kinds = [e["kind"] for e in report["probes"]["metrics"]["events"] if e["kind"] != "slow"]
    assert kinds == ["unreachable", "reachable", "restart"]
    # the stage after the restart runs against the new process and passes
    assert s["short"]["status"] == "pass"
    md = render_markdown(report)
    assert "## Failures" in md and "restart: process_start_time_seconds changed" in md


def test_kv_pressure_reports_preemptions(make_server, tmp_path: Path) -> None:
    # 8 KV blocks of 128 tokens for 16 requests of up to 200 tokens (2 blocks each): requests
    # admitted on their prompt's block must be preempted to grow into a second one.
    # The validator starts first and waits in `ready` while the server boots.
    # The server also requires an API key: the key must work and never reach the report.
    key = "kv-test-secret-7d1f"
    server: VllmServer = make_server(
        extra=["--num-gpu-blocks-override", "8", "--api-key", key], start=False
    )
    out = tmp_path / "kv"
    p = popen(
        "validate", "--url", server.url, "--stages", "ready,concurrency", "--rounds", "1",
        "--max-tokens", "200", "--ready-timeout", "240", "--out", out, "--api-key", key, "--json",
    )  # fmt: skip
    try:
        time.sleep(1.0)
        server.start()
        stdout, stderr = p.communicate(timeout=300)
    finally:
        if p.poll() is None:
            p.kill()
    report = json.loads(stdout)
    ready, conc = by_name(report)["ready"], by_name(report)["concurrency"]
    assert ready["status"] == "pass", ready
    assert ready["key"]["time_to_ready_s"] > 1.0
    assert [e["kind"] for e in report["probes"]["metrics"]["events"] if e["kind"] != "slow"] == [
        "unreachable", "reachable"]  # fmt: skip
    assert report["server"]["cache_config_info"]["num_gpu_blocks_override"] == "8"
    assert conc["evidence"]["probes"]["server"]["preemptions"] > 0
    assert conc["key"]["preemptions"] > 0
    # (No assertion on the sampled KV peak: a 0.5 s sampler can miss it on a starved machine;
    # the preemption count comes from counters read at the stage boundaries.)
    # preempted requests are recomputed: the stage still completes every request
    assert conc["key"]["completed"] == "16/16" and p.returncode == 0, stderr[-2000:]
    assert "preemptions" in (out / "report.md").read_text()
    for text in (stdout, (out / "report.json").read_text(), (out / "report.md").read_text()):
        assert key not in text
    command = report["environment"]["command"]
    assert command[command.index("--api-key") + 1] == "<redacted>"

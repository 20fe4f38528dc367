"""The report offline: results built in memory, rendered, written, read back and compared."""

from __future__ import annotations

import copy
import hashlib
import json
import re
from pathlib import Path

import pytest

from flashnext.errors import ValidationError
from flashnext.records import check_record
from flashnext.status import STATUSES
from flashnext.validate.report import (
    REPORT_FILES,
    build_report,
    compare,
    load_report,
    render_compare,
    render_markdown,
    write_report,
)
from flashnext.validate.stages import (
    Config,
    Interruption,
    ServerEnvironment,
    StageResult,
    ValidationResult,
)

from ..cli.runner import run_in_process

KEY = "sk-report-secret-91"
URL = "http://alice:pa55word@10.1.2.3:8000"


def make_result(
    *, tok_s: float = 120.0, failed: bool = False, interrupted: Interruption | None = None
) -> ValidationResult:
    """A run as the runner would return it: ready and short pass, multimodal skipped,
    concurrency pass (or fail with a restart), a preemption count, one server event."""
    cfg = Config(url=URL, api_key=KEY, stages=("ready", "short", "multimodal", "concurrency"))
    conc = StageResult("concurrency", t_start=3.0, t_end=9.5)
    conc.key.update(completed="48/48", ttft_p90_s=0.25, output_tok_s=tok_s, preemptions=3)
    conc.evidence["probes"] = {"server": {"preemptions": 3}, "gpu": {"status": "n/a"}}
    if failed:
        conc.key["completed"] = "16/48"
        conc.fail(f"server unreachable at t=5.0s: GET {URL}/metrics: ConnectError")
        conc.fail("server restarted at t=7.0s: process_start_time_seconds changed 1 -> 2")
    stages = [
        StageResult("ready", t_start=0.0, t_end=1.25, key={"time_to_ready_s": 1.2, "model": "m"}),
        StageResult(
            "short", t_start=1.25, t_end=2.0, key={"ttft_s": 0.05, "finish_reason": "stop"}
        ),
        StageResult(
            "multimodal",
            "skip",
            "not a multimodal model (server: HTTP 400: no | pipes)",
            2.0,
            2.1,
        ),
        conc,
    ]
    if interrupted is not None:
        conc.status, conc.reason = "interrupted", f"interrupted by {interrupted.signal} at t=4.0s"
    events = (
        [{"t": 5.0, "kind": "unreachable", "detail": f"GET {URL}/metrics: refused"}]
        if failed
        else []
    )
    return ValidationResult(
        config=cfg,
        stages=stages,
        server=ServerEnvironment(
            server_version="0.32.0",
            served_model="m",
            max_model_len=512,
            models={"data": [{"id": "m"}]},
            cache_config_info={"block_size": "16"},
            gpu={"status": "not available: NVML Shared Library Not Found"},
        ),
        metrics={
            "interval_s": 0.5,
            "available": True,
            "events": events,
            "samples": [{"t": 0.5, "ok": True, "running": 2, "kv_usage": float("nan")}],
        },
        nvml={
            "status": "not available: test",
            "interval_s": 0.5,
            "device": {},
            "summary": {},
            "samples": [],
        },
        duration_s=9.6,
        interrupted=interrupted,
    )


ARGV = ["flashnext", "validate", "--url", URL, "--api-key", KEY, "--out", "r"]


def test_report_is_a_versioned_record_without_secrets() -> None:
    report = build_report(make_result(failed=True), ARGV)
    check_record(report, kind="flashnext.validate.report", schema_version=2)
    assert report["environment"]["command"] == [
        "flashnext",
        "validate",
        "--url",
        "http://<redacted>@10.1.2.3:8000",
        "--api-key",
        "<redacted>",
        "--out",
        "r",
    ]
    assert report["server"]["server_version"] == "0.32.0"
    assert report["target"] == {
        "url": "http://<redacted>@10.1.2.3:8000",
        "model": "m",
        "max_model_len": 512,
    }
    assert report["config"]["api_key"] == "<redacted>"
    assert report["passed"] is False and report["failed_stages"] == ["concurrency"]
    assert report["interrupted"] is None
    assert report["probes"]["metrics"]["samples"][0]["kv_usage"] is None  # NaN is not JSON
    text = json.dumps(report, allow_nan=False)
    for secret in (KEY, "pa55word", "alice"):
        assert secret not in text and secret not in render_markdown(report)
    assert [s["duration_s"] for s in report["stages"]] == [1.25, 0.75, 0.1, 6.5]


def test_markdown_of_a_passing_run() -> None:
    md = render_markdown(build_report(make_result(), ARGV))
    lines = md.splitlines()
    assert lines[0] == "# flashnext validate: PASSED"
    assert lines[2] == (
        "http://<redacted>@10.1.2.3:8000 · model `m` · max_model_len 512 · server 0.32.0 · "
        "GPU not available: NVML Shared Library Not Found · 10 s · flashnext 0.1.0"
    )
    assert "| ready | pass | 1.2 | time_to_ready_s 1.2, model m |" in lines
    # a "|" inside a reason would break the table
    assert (
        "| multimodal | skip: not a multimodal model (server: HTTP 400: no / pipes) | 0.1 |  |"
    ) in lines
    assert (
        "| concurrency | pass | 6.5 | completed 48/48, ttft_p90_s 0.25, output_tok_s 120, "
        "preemptions 3 |"
    ) in lines
    assert "## Failures" not in md and "## Server events" not in md
    assert lines[-1].startswith("Command: `flashnext validate --url http://<redacted>@")
    assert len(lines) < 40


def test_markdown_names_failures_events_and_preemptions() -> None:
    md = render_markdown(build_report(make_result(failed=True), ARGV))
    assert md.startswith("# flashnext validate: FAILED (concurrency)\n")
    failures = md[md.index("## Failures") : md.index("## Server events")]
    assert "- **concurrency**" in failures
    assert "  - server restarted at t=7.0s: process_start_time_seconds changed 1 -> 2" in failures
    assert "  - preemptions during the stage: 3" in failures
    assert "- t=5.0s unreachable: GET http://<redacted>@10.1.2.3:8000/metrics: refused" in md


def test_markdown_and_record_of_an_interrupted_run() -> None:
    stop = Interruption(signal="SIGINT", stage="concurrency", t=4.0)
    report = build_report(make_result(interrupted=stop), ARGV)
    assert report["passed"] is False and report["failed_stages"] == []
    assert report["interrupted"] == {"signal": "SIGINT", "stage": "concurrency", "t": 4.0}
    md = render_markdown(report)
    assert md.startswith("# flashnext validate: INTERRUPTED (SIGINT during concurrency)\n")
    assert "| concurrency | interrupted | 6.5 |" in md
    assert "Interrupted by SIGINT at t=4.0s: the stages before it are complete" in md


def test_write_then_load_round_trip(tmp_path: Path) -> None:
    report = build_report(make_result(), ARGV)
    written = write_report(report, tmp_path, png=True)
    assert [p.name for p in written.paths] == ["report.json", "report.md", "report.png"]
    assert written.failed == [] and written.notes == []
    assert (tmp_path / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "report.md").read_text() == render_markdown(report)
    assert load_report(tmp_path / "report.json") == report
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [".flashnext-files.json", "report.json", "report.md", "report.png"]
    # each file is recorded as this report's, so a later run may replace it (issue 42)
    own = json.loads((tmp_path / ".flashnext-files.json").read_text())["files"]
    for name in names[1:]:
        assert own[name] == [hashlib.sha256((tmp_path / name).read_bytes()).hexdigest()]


def v1_of(report: dict) -> dict:
    """The same report as flashnext wrote it before records (schema_version 1)."""
    old = {
        k: v for k, v in report.items() if k not in ("kind", "environment", "server", "interrupted")
    }
    env = report["environment"]
    old.update(
        schema_version=1,
        tool={"name": "flashnext", "version": env["flashnext"]},
        created=env["created"],
        command=env["command"],
        python=env["python"],
        platform=env["platform"],
        environment=report["server"],
    )
    return old


def test_compare_reads_version_1_and_2(tmp_path: Path) -> None:
    a = build_report(make_result(), ARGV)
    b = build_report(make_result(tok_s=60.0, failed=True), ARGV)
    b["server"]["server_version"] = "0.33.0"
    b["server"]["cache_config_info"]["block_size"] = "32"
    (tmp_path / "a.json").write_text(json.dumps(v1_of(a)))
    (tmp_path / "b.json").write_text(json.dumps(b))
    old = load_report(tmp_path / "a.json")
    assert (
        old["server"] == a["server"]
        and old["environment"]["command"] == a["environment"]["command"]
    )
    assert old["read_from_schema_version"] == 1
    diff = compare(old, load_report(tmp_path / "b.json"))
    assert diff["server"] == {
        "server_version": ["0.32.0", "0.33.0"],
        "cache_config_info.block_size": ["16", "32"],
    }
    rows = {r["name"]: r for r in diff["stages"]}
    assert rows["ready"] == {"name": "ready", "status": ["pass", "pass"], "changed": {}}
    assert rows["concurrency"]["status"] == ["pass", "fail"]
    assert rows["concurrency"]["changed"] == {
        "completed": {"a": "48/48", "b": "16/48"},
        "output_tok_s": {"a": 120.0, "b": 60.0, "ratio": 0.5},
    }
    text = render_compare(diff)
    assert "  server_version: 0.32.0 -> 0.33.0" in text
    assert "  concurrency: pass -> fail\n    completed: 48/48 -> 16/48\n" in text
    assert "    output_tok_s: 120 -> 60 (x0.5)" in text


def test_compare_a_stage_only_in_one_report() -> None:
    a = build_report(make_result(), ARGV)
    b = copy.deepcopy(a)
    b["stages"] = [s for s in b["stages"] if s["name"] != "concurrency"]
    rows = {r["name"]: r for r in compare(a, b)["stages"]}
    assert rows["concurrency"]["status"] == ["pass", None]
    assert rows["concurrency"]["changed"]["completed"] == {"a": "48/48", "b": None}
    assert "concurrency: pass -> None" in render_compare(compare(a, b))


def test_compare_json_is_a_record(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = build_report(make_result(), ARGV)
    b = build_report(make_result(tok_s=240.0), ARGV)
    write_report(a, tmp_path / "a", png=False)
    write_report(b, tmp_path / "b", png=False)
    argv = ["validate", "compare", tmp_path / "a/report.json", tmp_path / "b/report.json", "--json"]
    code, out, err = run_in_process(argv, capsys)
    assert code == 0, err
    record = check_record(json.loads(out), kind="flashnext.validate.compare", schema_version=1)
    assert record["a"]["passed"] is True and record["b"]["interrupted"] is None
    rows = {r["name"]: r for r in record["stages"]}
    assert rows["concurrency"]["changed"]["output_tok_s"]["ratio"] == 2.0
    assert record["server"] == {} and record["regressions"] == []
    # a stage that passed in A and fails in B: exit 1, named, for a CI gate
    worse = build_report(make_result(failed=True), ARGV)
    write_report(worse, tmp_path / "c", png=False)
    argv = ["validate", "compare", tmp_path / "a/report.json", tmp_path / "c/report.json"]
    code, out, _ = run_in_process(argv, capsys)
    assert code == 1 and "REGRESSED (passed in A, failed in B): concurrency" in out
    code, out, _ = run_in_process([*argv[:2], argv[3], argv[2], "--json"], capsys)  # B -> A
    assert code == 0 and json.loads(out)["regressions"] == []


def test_load_report_refuses_what_it_cannot_read(tmp_path: Path) -> None:
    p = tmp_path / "r.json"
    p.write_text('{"schema_version": 99}')
    with pytest.raises(ValidationError, match=r"schema_version 99, expected 1 or 2; re-run"):
        load_report(p)
    p.write_text('{"schema_version": 2, "kind": "flashnext.ple.info", "environment": {}}')
    with pytest.raises(ValidationError, match="environment block lacks"):
        load_report(p)
    p.write_text("[1, 2]")
    with pytest.raises(ValidationError, match="not a flashnext validate report"):
        load_report(p)
    with pytest.raises(ValidationError, match=r"a directory, not a regular file"):
        load_report(tmp_path)


def test_png_and_markdown_of_every_stage_status(tmp_path: Path) -> None:
    """A stage span per status, interrupted included (report.png once crashed on it)."""
    stop = Interruption(signal="SIGTERM", stage="concurrency", t=4.0)
    report = build_report(make_result(interrupted=stop), ARGV)
    assert [s["status"] for s in report["stages"]] == ["pass", "pass", "skip", "interrupted"]
    report["stages"][3]["t_end"] = 9.5  # a span the plot shades
    written = write_report(report, tmp_path, png=True)
    assert written.failed == [] and [p.name for p in written.paths] == list(REPORT_FILES)
    assert (tmp_path / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_old_reports_say_skipped_and_are_read_as_skip(tmp_path: Path) -> None:
    old = build_report(make_result(), ARGV)
    old["stages"][2]["status"] = "skipped"  # as flashnext wrote it before flashnext.status
    (tmp_path / "old.json").write_text(json.dumps(old))
    (tmp_path / "v1.json").write_text(json.dumps(v1_of(old)))
    for name in ("old.json", "v1.json"):
        assert [s["status"] for s in load_report(tmp_path / name)["stages"]] == [
            "pass", "pass", "skip", "pass"
        ]  # fmt: skip
    new = build_report(make_result(), ARGV)
    rows = {r["name"]: r for r in compare(load_report(tmp_path / "old.json"), new)["stages"]}
    assert rows["multimodal"]["status"] == ["skip", "skip"]  # not a change


@pytest.mark.parametrize(
    ("status", "why"),
    [
        ("passed", f"stages[1]: status 'passed': expected one of {', '.join(STATUSES)}"),
        (None, "field stages[1].status: expected str, found null"),
        (7, "field stages[1].status: expected str, found int 7"),
    ],
)
def test_compare_refuses_a_stage_status_it_cannot_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], status: object, why: str
) -> None:
    report = build_report(make_result(), ARGV)
    report["stages"][1]["status"] = status
    (tmp_path / "a.json").write_text(json.dumps(report))
    line = f"{tmp_path / 'a.json'}: {why}"
    with pytest.raises(ValidationError, match=re.escape(line)):
        load_report(tmp_path / "a.json")
    code, out, err = run_in_process(
        ["validate", "compare", tmp_path / "a.json", tmp_path / "a.json"], capsys
    )
    assert (code, out, err) == (1, "", f"error: {line}\n")


def test_a_deployment_captured_after_a_restart_says_which_process_it_is() -> None:
    report = build_report(make_result(failed=True), ARGV)
    report["deployment"] = {"server": {"version": "0.32.0"}}
    report["deployment_summary"] = "server 0.32.0, launch from port"
    md = render_markdown(report)
    assert "Deployment: server 0.32.0, launch from port" in md and "captured after" not in md
    restart = {"t": 7.0, "kind": "restart", "detail": "process_start_time_seconds 1 -> 2"}
    report["probes"]["metrics"]["events"].append(restart)
    assert ("(captured after the run: it describes the process that started at t=7.0s, not "
            "the one before that restart)") in render_markdown(report)  # fmt: skip

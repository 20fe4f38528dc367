"""Issue 42: a signal at ANY moment after the last stage or prompt finished still leaves the
finished results written.

Each case runs ``flashnext validate`` (or ``validate ab``) as a real subprocess through a small
driver that wraps one function on the way from the last result to the written report: the
wrapper sends the signal to its own process right before (or after) the function runs. No
sleep decides the moment; the list walks every step in order, so a new step between them is
one more row. The report must be whole, the exit 128 + N, one line saying so, no traceback.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from devtools.vllm_cpu import VllmServer

from ..cli.hooks import hooked
from ..cli.runner import BASE_ENV
from ..cli.servers import openai_server

#: validate --stages ready: every step from the last stage's end to the printed report.
VALIDATE_POINTS = [
    ("flashnext.validate.stages.runner:_run_one", "after", 1),  # the last stage just ended
    ("flashnext.validate.stages.runner:_server_environment", "before", 1),
    ("flashnext.validate.stages.run:Run.close", "before", 1),
    ("flashnext.validate.stages.runner:_deployment", "before", 1),
    ("flashnext.validate.report:build_report", "before", 1),
    ("flashnext.validate.report:write_report", "before", 1),
    ("flashnext.validate.output:atomic_write", "before", 2),  # between report.json and .md
    ("flashnext.validate.output:atomic_write", "after", 2),
    ("flashnext.cli.validate:_print_summary", "before", 1),
    ("flashnext.cli.validate:_tell_written", "after", 1),
]


def _drive(point: tuple[str, str, int], sig: str, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        hooked(point, sig, *argv), capture_output=True, text=True, timeout=300,
        env={**os.environ, **BASE_ENV},
    )  # fmt: skip


def _one_line_said(proc: subprocess.CompletedProcess[str], sig: str) -> None:
    assert proc.returncode == 128 + signal.Signals[sig].value, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    said = [line for line in proc.stderr.splitlines() if line.startswith("interrupted by ")]
    assert len(said) == 1 and sig in said[0], proc.stderr[-3000:]


@pytest.fixture(scope="module")
def server_url(tmp_path_factory: pytest.TempPathFactory):
    with openai_server(tmp_path_factory.mktemp("window")) as server:
        yield server.url


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
@pytest.mark.parametrize("point", VALIDATE_POINTS, ids=lambda p: f"{p[0]}-{p[1]}-{p[2]}")
def test_validate_writes_the_finished_stages_whenever_the_signal_comes(
    server_url: str, tmp_path: Path, point: tuple[str, str, int], sig: str
) -> None:
    out = tmp_path / "vk"
    proc = _drive(
        point, sig, "validate", "--url", server_url, "--out", str(out), "--stages", "ready",
        "--no-nvml", "--no-png",
    )  # fmt: skip
    _one_line_said(proc, sig)
    report = json.loads((out / "report.json").read_text())
    ready = next(s for s in report["stages"] if s["name"] == "ready")
    assert ready["status"] == "pass", report["stages"]
    assert (out / "report.md").read_text().startswith("# flashnext validate")
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == [
        "report.json",
        "report.md",
    ]


#: validate ab with one prompt: every step from the last prompt's answer to the printed record.
AB_POINTS = [
    ("flashnext.validate.ab:compare_prompt", "after", 1),  # the last prompt just compared
    ("flashnext.validate.ab:deployments", "before", 1),
    ("flashnext.validate.ab_answers:render_answers", "before", 1),
    ("flashnext.validate.ab_report:write_ab", "before", 1),
    ("flashnext.validate.output:atomic_write", "after", 1),  # ab.json written, ab.md not yet
    ("flashnext.cli.validate:_tell_written", "after", 1),
]


@pytest.mark.parametrize("point", AB_POINTS, ids=lambda p: f"{p[0]}-{p[1]}-{p[2]}")
def test_ab_writes_the_compared_prompts_whenever_the_signal_comes(
    vllm_server: VllmServer, tmp_path: Path, point: tuple[str, str, int]
) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "one", "prompt": "The capital of France is"}\n')
    out = tmp_path / "ab"
    proc = _drive(
        point, "SIGTERM", "validate", "ab", "--baseline", vllm_server.url, "--candidate",
        vllm_server.url, "--prompts", str(prompts), "--max-tokens", "2", "--no-png",
        "--out", str(out),
    )  # fmt: skip
    _one_line_said(proc, "SIGTERM")
    record = json.loads((out / "ab.json").read_text())
    assert [p["id"] for p in record["prompts"]] == ["one"], record["prompts"]
    assert (out / "ab.md").is_file() and (out / "baseline-answers.jsonl").is_file()

"""SIGINT / SIGTERM during ``flashnext validate`` and ``validate ab``: the report of what
finished is written, marked interrupted, with the defaults (report.png / ab.png on).

The validator runs as a real subprocess (stderr is a pipe, not a terminal, so progress comes as
plain lines); the signal is sent once a given progress line appears. The servers are the
suite's shared vLLM server (A/B compares it with itself) and a port nothing listens on.
"""

from __future__ import annotations

import json
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from devtools.vllm_cpu import VllmServer, free_port
from flashnext.records import check_record

from ..cli.runner import popen
from .test_live_server import by_name

PNG = b"\x89PNG\r\n\x1a\n"


class Validator:
    """``flashnext validate ARGS`` in a subprocess, its stderr lines collected as they come."""

    def __init__(self, *args: str) -> None:
        self.proc = popen("validate", *args)
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        self.out: list[str] = []  # stdout, read as it comes (a full pipe would block the run)
        threading.Thread(target=self._read, daemon=True).start()
        self.stdout_reader = threading.Thread(target=self._read_stdout, daemon=True)
        self.stdout_reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.put(line.rstrip("\n"))

    def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        self.out.append(self.proc.stdout.read())

    def stdout(self) -> str:
        """All of stdout (after :meth:`finish`)."""
        self.stdout_reader.join(timeout=30)
        return "".join(self.out)

    def wait_for_line(self, prefix: str, timeout_s: float = 120.0) -> None:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            try:
                line = self.lines.get(timeout=0.5)
            except queue.Empty:
                if self.proc.poll() is not None:
                    break
                continue
            self.seen.append(line)
            if line.startswith(prefix):
                return
        self.proc.kill()
        raise AssertionError(f"no stderr line {prefix!r}; saw: {self.seen}")

    def finish(self, timeout_s: float = 60.0) -> tuple[int, str]:
        """Exit status and all of stderr."""
        try:
            self.proc.wait(timeout=timeout_s)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
        time.sleep(0.1)  # let the reader drain the pipe
        while not self.lines.empty():
            self.seen.append(self.lines.get())
        return self.proc.returncode, "\n".join(self.seen)


def test_sigterm_while_waiting_for_a_dead_port_writes_the_report(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens: `ready` waits (default 600 s)
    v = Validator("--url", url, "--out", str(tmp_path))  # the defaults: report.png too
    # stderr is not a terminal: the wait is said, with its bound, as a plain line
    v.wait_for_line(f"validate: ready: waiting up to 600 s for {url}/health")
    v.proc.send_signal(signal.SIGTERM)
    code, stderr = v.finish()
    assert code == 128 + signal.SIGTERM, stderr
    assert "Traceback" not in stderr
    assert (
        "interrupted by SIGTERM during ready: the report holds the 0 stage(s) that finished"
        in stderr
    )
    report = json.loads((tmp_path / "report.json").read_text())
    assert (
        report["interrupted"]["signal"] == "SIGTERM" and report["interrupted"]["stage"] == "ready"
    )
    assert report["passed"] is False
    s = by_name(report)
    assert s["ready"]["status"] == "interrupted"
    assert s["ready"]["reason"].startswith("interrupted by SIGTERM at t=")
    for name in ("short", "long", "multimodal", "concurrency", "prefix-cache", "sustained"):
        assert (s[name]["status"], s[name]["reason"]) == ("skip", "not run: interrupted by SIGTERM")
    md = (tmp_path / "report.md").read_text()
    assert md.startswith("# flashnext validate: INTERRUPTED (SIGTERM during ready)\n")
    # the plot of an interrupted run (its stage span in the `interrupted` colour) is written
    assert (tmp_path / "report.png").read_bytes()[:8] == PNG
    assert "Deployment record: not captured (the run was interrupted by SIGTERM)" in md


def test_sigint_mid_run_keeps_the_finished_stages(vllm_server: VllmServer, tmp_path: Path) -> None:
    v = Validator(
        "--url", vllm_server.url, "--stages", "ready,short,concurrency,sustained",
        "--rounds", "3", "--concurrency", "8", "--max-tokens", "256",
        "--out", str(tmp_path),
    )  # fmt: skip
    v.wait_for_line("validate: concurrency: round 1/3")
    time.sleep(0.5)  # requests in flight
    v.proc.send_signal(signal.SIGINT)
    code, stderr = v.finish()
    assert code == 128 + signal.SIGINT, stderr
    assert "Traceback" not in stderr
    assert "interrupted by SIGINT during concurrency: the report holds the 2 stage(s)" in stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["kind"] == "flashnext.validate.report" and report["schema_version"] == 2
    assert report["interrupted"]["signal"] == "SIGINT"
    assert report["interrupted"]["stage"] == "concurrency"
    assert report["passed"] is False and report["failed_stages"] == []
    s = by_name(report)
    # the stages that finished are there with their evidence
    assert s["ready"]["status"] == "pass" and s["ready"]["key"]["max_model_len"] == 512
    assert s["short"]["status"] == "pass" and s["short"]["key"]["completion_tokens"] > 0
    conc = s["concurrency"]
    assert conc["status"] == "interrupted"
    assert conc["reason"].startswith("interrupted by SIGINT at t=")
    assert conc["t_end"] >= conc["t_start"] > s["short"]["t_end"] - 1e-3
    assert "probes" in conc["evidence"]
    assert (s["sustained"]["status"], s["sustained"]["reason"]) == (
        "skip", "not run: interrupted by SIGINT")  # fmt: skip
    assert report["server"]["server_version"] == "0.32.0"
    md = (tmp_path / "report.md").read_text()
    assert md.startswith("# flashnext validate: INTERRUPTED (SIGINT during concurrency)\n")
    assert "| short | pass |" in md
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [".flashnext-files.json", "report.json", "report.md", "report.png"]
    assert (tmp_path / "report.png").read_bytes()[:8] == PNG
    # the server is fine afterwards: the cancelled requests were closed, not left hanging
    with urllib.request.urlopen(vllm_server.url + "/health", timeout=30) as r:
        assert r.status == 200


AB_PROMPTS = [
    {"id": f"p{i}", "category": "general", "prompt": text}
    for i, text in enumerate(
        [
            "The river rose in spring and",
            "def fibonacci(n):",
            "Une phrase en français pour finir",
            "Three things the clerk copied:",
            "Once the grain was counted,",
        ]
    )
]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_ab_interrupted_writes_the_finished_prompts(
    vllm_server: VllmServer, tmp_path: Path, sig: signal.Signals
) -> None:
    """`validate ab` stopped after its first prompt: ab.json, ab.md and ab.png (the defaults)
    hold the prompts that finished, marked interrupted; the exit status says which signal."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in AB_PROMPTS))
    out = tmp_path / "ab"
    json_flag = ["--json"] if sig == signal.SIGTERM else []  # both outputs, one run each
    v = Validator(
        "ab", "--baseline", vllm_server.url, "--candidate", vllm_server.url,
        "--prompts", str(prompts), "--max-tokens", "16", "--out", str(out), *json_flag,
    )  # fmt: skip
    v.wait_for_line("validate ab: prompt 1/5 done", timeout_s=300)
    v.proc.send_signal(sig)
    code, stderr = v.finish(timeout_s=120)
    assert code == 128 + sig, stderr
    assert "Traceback" not in stderr and "aborted" not in stderr
    record = check_record(json.loads((out / "ab.json").read_text()), kind="flashnext.validate.ab")
    stop = record["interrupted"]
    assert stop["signal"] == sig.name and stop["prompts_total"] == 5
    done = stop["prompts_done"]
    assert 1 <= done < 5, stop
    assert f"interrupted by {sig.name}: the report holds the {done} of 5 prompt(s)" in stderr
    # the finished prompts, complete: the same server twice gives the same tokens
    assert [r["id"] for r in record["prompts"]] == [f"p{i}" for i in range(done)]
    for r in record["prompts"]:
        assert r["error"] is None and r["first_difference"] is None
        assert len(r["baseline"]["token_ids"]) == 16 and r["tf"]["kl"]["max"] == 0.0
    assert record["summary"]["prompts"] == record["summary"]["compared"] == done
    verdict = record["verdict"]
    assert verdict["status"] == "interrupted" and verdict["passed"] is False
    assert verdict["reasons"][0].startswith(f"interrupted by {sig.name} after {done} of 5")
    for side in ("baseline", "candidate"):
        why = f"the run was interrupted by {sig.name}"
        assert record["deployments"][side] == {"error": why}
    md = (out / "ab.md").read_text()
    assert md.startswith(f"# flashnext validate ab: INTERRUPTED ({sig.name})\n")
    assert "| p0 | general |" in md and "| p4 |" not in md
    assert (out / "ab.png").read_bytes()[:8] == PNG
    stdout = v.stdout()
    if json_flag:
        assert json.loads(stdout) == record
    else:
        assert stdout.startswith(f"# flashnext validate ab: INTERRUPTED ({sig.name})")
    with urllib.request.urlopen(vllm_server.url + "/health", timeout=30) as r:
        assert r.status == 200


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_a_signal_while_the_report_is_written_waits_for_it(tmp_path: Path) -> None:
    """Once the run is over, a SIGINT or SIGTERM cannot cut the report short: it is held back
    until the files are written (a fresh interpreter: signals go to its only thread)."""
    code = (
        "import os, signal, sys, time\n"
        "from flashnext.validate.interrupts import deferred\n"
        "sig = getattr(signal, sys.argv[1])\n"
        "try:\n"
        "    with deferred():\n"
        "        os.kill(os.getpid(), sig)\n"
        "        time.sleep(0.2)\n"
        "        open(sys.argv[2], 'w').write('complete')\n"
        "except KeyboardInterrupt:\n"
        "    print('interrupted after the block')\n"
    )
    for name, status in (("SIGINT", 0), ("SIGTERM", -signal.SIGTERM)):
        done = tmp_path / name
        # SIGINT at its default in the child (as tests/cli/test_json_errors.py does): a suite
        # started in the background by a non-interactive shell runs with SIGINT ignored, which
        # the child would inherit, and Python then raises no KeyboardInterrupt to wait for
        p = subprocess.run([sys.executable, "-c", code, name, str(done)], capture_output=True,
                           text=True, timeout=60, preexec_fn=_default_sigint)  # fmt: skip
        assert p.returncode == status, p.stderr
        assert done.read_text() == "complete"
        assert p.stdout == ("interrupted after the block\n" if name == "SIGINT" else "")

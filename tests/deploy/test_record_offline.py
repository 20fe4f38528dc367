"""Record pieces that need no vLLM server: container inspect, /proc, diff, restore."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flashnext.deploy.process import ProcessError, from_inspect, pid_listening_on, read_pid
from flashnext.deploy.record import redact_launch
from flashnext.deploy.record_diff import record_diff, restore_command, variables_changed
from flashnext.records import REDACTED, make_record

FIXTURES = Path(__file__).parent / "fixtures"


def record(argv, env=None, packages=None, container=None, source="pid", server=None):
    launch = {
        "source": source,
        "argv": argv,
        "env": env or {},
        "cwd": "/srv",
        "container": container or {},
    }
    payload = {"url": "http://127.0.0.1:8000", "server": server or {"version": "0.33.0", "models": [], "cache_config": {}},
               "launch": launch, "checkpoint": None, "packages": packages or {}, "gpus": [],
               "host_memory_bytes": 1, "plugin_log": [], "captured": {"pid": 1}}  # fmt: skip
    return make_record("flashnext.deploy.record", payload)


BASE = ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m", "--port", "8000",
        "--max-num-seqs", "16", "--gpu-memory-utilization", "0.92"]  # fmt: skip


def test_docker_inspect_fixture_is_read_and_secrets_never_leave():
    # Written in `docker inspect`'s schema (Docker Engine 24+); no container runtime here.
    data = json.loads((FIXTURES / "docker_inspect_vllm.json").read_text())
    info = from_inspect(data, "flash-next")
    assert info.argv[:3] == ["vllm", "serve", "/models/flash-next-nvfp4"]
    assert info.container["image"] == "vllm/vllm-openai:v0.33.0"
    assert info.container["restart_count"] == 2
    assert info.container["gpus"] == [{"driver": "", "count": -1, "ids": None}]
    launch = redact_launch(info, [])
    rec = make_record("flashnext.deploy.record", {"launch": launch, "server": {}, "packages": {}})
    text = json.dumps(rec)
    assert "hf_ThisIsASecretTokenValue123" not in text and "sk-container-secret-456" not in text
    cmd = restore_command(rec)
    assert cmd.startswith("docker run -d --name flash-next --gpus all --network host --ipc host")
    assert "-v /data/models:/models:ro" in cmd and "--entrypoint vllm" in cmd
    assert 'HF_TOKEN="${HF_TOKEN:?' in cmd and '--api-key "${API_KEY:?' in cmd
    assert (
        "sha256:9b3f0c1d" in cmd and "serve /models/flash-next-nvfp4 --max-model-len 131072" in cmd
    )


def test_inspect_output_that_is_not_a_container_is_named():
    with pytest.raises(ProcessError, match="no 'Config' object"):
        from_inspect([{"Id": "x"}], "c1")


def test_read_pid_of_a_real_process_keeps_only_relevant_env():
    env = {**os.environ, "VLLM_TEST_FLAG": "7", "UNRELATED_VAR": "x"}
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(20)", "--flag"], env=env
    )
    try:
        info = read_pid(child.pid)
        for _ in range(100):  # until the child has exec'd its command line
            if info.argv and info.argv[-1] == "--flag":
                break
            time.sleep(0.05)
            info = read_pid(child.pid)
        assert info.argv[-1] == "--flag" and info.env["VLLM_TEST_FLAG"] == "7"
        assert "UNRELATED_VAR" not in info.env
    finally:
        child.kill()
        child.wait()
    with pytest.raises(ProcessError, match="no such process"):
        read_pid(child.pid)


def test_pid_listening_on_a_real_socket():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert pid_listening_on(s.getsockname()[1]) == os.getpid()
        port = s.getsockname()[1]
    with pytest.raises(ProcessError, match=f"no local process listens on port {port}"):
        pid_listening_on(port)


def test_diff_names_one_flag_and_warns_on_two():
    a = record(BASE)
    one = record([*BASE[:-4], "--max-num-seqs", "8", *BASE[-2:]])
    changes = record_diff(a, one)
    assert [(c.group, c.name, c.before, c.after) for c in changes] == [
        ("memory", "--max-num-seqs", "16", "8")
    ]
    two = record([*BASE[:-4], "--max-num-seqs", "8", *BASE[-2:], "-tp", "2"], env={"VLLM_X": "1"})
    changes = record_diff(a, two)
    assert variables_changed(changes) == 3
    assert {c.group for c in changes} == {"memory", "parallelism", "environment"}
    assert record_diff(a, record(BASE)) == []


def test_observed_server_changes_are_not_variables():
    a = record(
        BASE,
        server={
            "version": "0.33.0",
            "models": [{"id": "m", "max_model_len": 512}],
            "cache_config": {"num_gpu_blocks": "100"},
        },
    )
    b = record(
        BASE,
        server={
            "version": "0.33.0",
            "models": [{"id": "m", "max_model_len": 512}],
            "cache_config": {"num_gpu_blocks": "90"},
        },
    )
    changes = record_diff(a, b)
    assert len(changes) == 1 and not changes[0].variable and variables_changed(changes) == 0


def test_local_restore_uses_placeholders_for_redacted_values():
    rec = record([*BASE, "--api-key", REDACTED], env={"HF_TOKEN": REDACTED, "VLLM_X": "a b"})
    cmd = restore_command(rec)
    assert cmd.startswith('cd /srv && env HF_TOKEN="${HF_TOKEN:?')
    assert "VLLM_X='a b'" in cmd and '--api-key "${API_KEY:?' in cmd
    out = subprocess.run(["bash", "-c", cmd.replace("/venv/bin/python", "echo")], capture_output=True, text=True,
                         env={"PATH": os.environ["PATH"], "HF_TOKEN": "t", "API_KEY": "k"}, cwd="/")  # fmt: skip
    assert out.returncode == 0 or "cd: /srv" in out.stderr


def test_restore_of_a_remote_capture_is_refused():
    rec = make_record("flashnext.deploy.record", {"launch": None, "server": {}})
    with pytest.raises(Exception, match="nothing to restore"):
        restore_command(rec)

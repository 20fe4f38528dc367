"""Record pieces that need no vLLM server: container inspect, /proc, diff, restore."""

import itertools
import json
import os
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flashnext.deploy.process import (
    ProcessError,
    from_inspect,
    output_files,
    pid_listening_on,
    read_pid,
)
from flashnext.deploy.record import plugin_log, read_bounded, redact_launch
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


def real_inspect() -> list[dict]:
    """Real `docker container inspect` output (runlike's fixture 6; source in fixtures/README.md)."""
    return json.loads((FIXTURES / "docker_inspect_runlike_fixture6.json").read_text())


def test_real_docker_inspect_output_is_read():
    info = from_inspect(real_inspect(), "runlike_fixture6")
    assert info.source == "container" and info.argv == ["/bin/bash", "/sleep.sh"]
    assert info.cwd == "/workdir"
    assert info.env["FOO"] == "thing=\"quoted value with 'spaces' and 'single quotes'\""
    assert info.env["UTF_8"] == "ユーザー別サイト" and "SET_WITHOUT_VALUE" not in info.env
    c = info.container
    assert c["name"] == "runlike_fixture6" and c["image"] == "runlike_fixture"
    assert c["image_id"].startswith("sha256:0f2bf47f7904")
    assert c["entrypoint"] == ["/bin/bash", "/sleep.sh"] and c["cmd"] == []
    assert c["env_without_value"] == ["SET_WITHOUT_VALUE"]
    assert c["user"] == "daemon" and c["privileged"] and c["cap_add"] == ["CHOWN"]
    assert c["memory"] == 2147483648 and c["restart_policy"] == "always"
    assert c["devices"] == ["/dev/null:/dev/null:r"] and c["gpus"] == []
    assert c["mounts"] == [
        {"type": "bind", "source": "/home/rgiuse/runlike/dockerfiles", "destination": "/workdir",
         "rw": True},
        {"type": "volume", "source": None, "destination": "/random_volume", "rw": True},
    ]  # fmt: skip
    assert {"container": "600/udp", "host_ip": "192.168.8.135", "host_port": "601"} in c["ports"]
    assert len(c["ports"]) == 6


def test_restore_of_real_inspect_output_is_a_docker_run_that_parses_back():
    rec = make_record(
        "flashnext.deploy.record",
        {"launch": redact_launch(from_inspect(real_inspect(), "x"), []), "server": {}},
    )
    cmd = restore_command(rec)
    words = shlex.split(cmd)
    assert words[:5] == ["docker", "run", "-d", "--name", "runlike_fixture6"]
    pairs = list(itertools.pairwise(words))
    for expected in [
        ("--user", "daemon"), ("--restart", "always"), ("--memory", "2147483648"),
        ("--cap-add", "CHOWN"), ("--device", "/dev/null:/dev/null:r"), ("-w", "/workdir"),
        ("-p", "300/tcp"), ("-p", "400:400/tcp"), ("-p", "503:502/udp"),
        ("-p", "127.0.0.1:601:600/udp"), ("-p", "192.168.8.135:601:600/udp"),
        ("-v", "/home/rgiuse/runlike/dockerfiles:/workdir"), ("-v", "/random_volume"),
        ("-e", "FOO=thing=\"quoted value with 'spaces' and 'single quotes'\""),
        ("-e", "UTF_8=ユーザー別サイト"), ("-e", "SET_WITHOUT_VALUE"), ("--entrypoint", "/bin/bash"),
    ]:  # fmt: skip
        assert expected in pairs, expected
    assert "--privileged" in words and "--gpus" not in words
    assert words[-2:] == [
        "sha256:0f2bf47f79041fea6ddbc1f460b82fe1e413c29e0e90beb8a3d27cd51f2876b2",
        "/sleep.sh",
    ]


def test_real_inspect_with_a_gpu_request_and_secrets_added():
    # The real file has no GPU and no secret; add both in docker's own schema for this case.
    data = real_inspect()
    data[0]["HostConfig"]["DeviceRequests"] = [
        {"Driver": "", "Count": -1, "DeviceIDs": None, "Capabilities": [["gpu"]], "Options": {}}
    ]
    data[0]["Config"]["Env"].append("HF_TOKEN=hf_ThisIsASecretTokenValue123")
    data[0]["Config"]["Cmd"] = ["--api-key", "sk-container-secret-456"]
    info = from_inspect(data, "x")
    assert info.container["gpus"] == [{"driver": "", "count": -1, "ids": None}]
    rec = make_record("flashnext.deploy.record", {"launch": redact_launch(info, []), "server": {}})
    text = json.dumps(rec)
    assert "hf_ThisIsASecretTokenValue123" not in text and "sk-container-secret-456" not in text
    cmd = restore_command(rec)
    assert "--gpus all" in cmd and 'HF_TOKEN="${HF_TOKEN:?' in cmd
    assert cmd.endswith('/sleep.sh --api-key "${API_KEY:?set API_KEY, redacted from the record}"')
    data[0]["HostConfig"]["DeviceRequests"][0].update(Count=0, DeviceIDs=["0", "1"])
    rec["launch"] = redact_launch(from_inspect(data, "x"), [])
    assert "--gpus '\"device=0,1\"'" in restore_command(rec)


def test_diff_of_two_real_inspects_names_the_container_change():
    a, b = real_inspect(), real_inspect()
    b[0]["HostConfig"]["ShmSize"] = 17179869184
    recs = [
        make_record("flashnext.deploy.record", {"launch": redact_launch(from_inspect(d, "x"), [])})
        for d in (a, b)
    ]
    changes = record_diff(*recs)
    assert [(c.name, c.before, c.after) for c in changes] == [
        ("container shm_size", 67108864, 17179869184)
    ]


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


PLUGIN_LINE = (
    "flashnext plugin: ple sidecar /x (int4, 320001536 rows, placement pinned) on vllm 0.32.0, "
    "flashnext 0.1.0"
)
# A vLLM-like log prefix on stdout, a second plugin line and noise on stderr, then a long sleep.
LOGGER = f"""
import sys, time
print("(APIServer pid=7) INFO 12-01 03:00:00 [plugin.py:12] {PLUGIN_LINE}", flush=True)
print("INFO unrelated line about flashnext-models", flush=True)
print("(EngineCore pid=8) INFO flashnext plugin: moe guard on (token=" + sys.argv[1] + ")",
      file=sys.stderr, flush=True)
print("ready", flush=True)
time.sleep(60)
"""


def _start_logger(tmp_path, stderr_to_stdout: bool):
    env = {**os.environ, "FLASHNEXT_PLE_SIDECAR": "/x", "FLASHNEXT_MOE_GUARD": "1",
           "FLASHNEXT_HUB_TOKEN": "tok-secret-42", "UNRELATED": "1"}  # fmt: skip
    out = open(tmp_path / "server.log", "wb")  # noqa: SIM115
    err = subprocess.STDOUT if stderr_to_stdout else open(tmp_path / "server.err", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-c", LOGGER, "tok-secret-42"], stdout=out, stderr=err, env=env
    )
    out.close()
    if err is not subprocess.STDOUT:
        err.close()
    for _ in range(200):  # until it has printed everything
        if b"ready" in (tmp_path / "server.log").read_bytes():
            break
        time.sleep(0.05)
    return proc


def test_plugin_lines_and_switches_of_a_real_process_by_pid(tmp_path):
    from flashnext.deploy.record import plugin_switches

    proc = _start_logger(tmp_path, stderr_to_stdout=False)
    try:
        files = output_files(proc.pid)
        assert [name for name, _ in files] == [
            str(tmp_path / "server.log"),
            str(tmp_path / "server.err"),
        ]
        launch = read_pid(proc.pid)
        got = plugin_log(None, launch)
        assert got.note is None and got.files == [
            str(tmp_path / "server.log"),
            str(tmp_path / "server.err"),
        ]
        assert got.lines == [PLUGIN_LINE, "flashnext plugin: moe guard on (token=tok-secret-42)"]
        redacted = redact_launch(launch, [])
        assert plugin_switches(redacted["env"]) == {
            "FLASHNEXT_HUB_TOKEN": REDACTED, "FLASHNEXT_MOE_GUARD": "1", "FLASHNEXT_PLE_SIDECAR": "/x",
        }  # fmt: skip
    finally:
        proc.kill()
        proc.wait()
    got = plugin_log(None, launch)  # the process is gone
    assert got.lines == [] and "no such process" in (got.note or "")


def test_plugin_log_of_stderr_sent_to_stdout_and_of_a_pipe(tmp_path):
    proc = _start_logger(tmp_path, stderr_to_stdout=True)
    try:
        got = plugin_log(None, read_pid(proc.pid))
        assert got.files == [str(tmp_path / "server.log")] and len(got.lines) == 2
    finally:
        proc.kill()
        proc.wait()
    piped = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    try:
        got = plugin_log(None, read_pid(piped.pid))
        assert got.lines == [] and got.files == [] and "are not files" in (got.note or "")
    finally:
        piped.kill()
        piped.communicate()


def test_bounded_read_keeps_head_and_tail_whole_lines(tmp_path):
    path = tmp_path / "big.log"
    path.write_text("".join(f"line {i:05d}\n" for i in range(20000)))  # 220 kB
    text = read_bounded(path, head=1000, tail=1000)
    lines = text.splitlines()
    assert lines[0] == "line 00000" and lines[-1] == "line 19999"
    assert all(x.startswith("line ") and len(x) == 10 for x in lines) and len(lines) < 200
    assert read_bounded(path, head=10**6, tail=10**6) == path.read_text()

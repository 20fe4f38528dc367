"""Rule: bounded work on anything a user points at. `record capture --log` reads only a regular
file, and at most its head and tail, whatever the path is: a FIFO nobody writes, an endless
device, a directory, a socket. Each is refused at once, before any request to the server."""

from __future__ import annotations

import json
import os
import socket
import time

import pytest

from flashnext.deploy.record import HEAD_BYTES, TAIL_BYTES, read_bounded

from .inputs import closed_port
from .runner import run_in_process
from .servers import openai_server


def _not_regular(tmp_path, kind):
    path = tmp_path / kind
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "socket":
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(path))
        return path, sock
    else:
        return {"urandom": "/dev/urandom", "zero": "/dev/zero", "null": "/dev/null"}[kind], None
    return path, None


@pytest.mark.parametrize("kind", ["fifo", "urandom", "zero", "null", "directory", "socket"])
def test_log_that_is_not_a_regular_file(tmp_path, capsys, kind):
    path, keep = _not_regular(tmp_path, kind)
    url = f"http://127.0.0.1:{closed_port()}"  # refused before the server is asked
    t0 = time.monotonic()
    code, out, err = run_in_process(["record", "capture", "--url", url, "--log", path], capsys)
    assert time.monotonic() - t0 < 30
    assert code == 1 and out == "" and err.count("\n") == 1, err
    assert err.startswith(f"error: --log {path}:")
    assert "not a regular file (a FIFO, device, socket or directory is never read)" in err
    if keep is not None:
        keep.close()


def test_a_huge_log_is_read_head_and_tail(tmp_path, capsys, rng):
    """A log larger than the bound: the plugin lines at its start and end are found, the middle
    is never read (the result holds at most HEAD_BYTES + TAIL_BYTES)."""
    log = tmp_path / "server.log"
    filler = rng.integers(ord("a"), ord("z"), size=(HEAD_BYTES + TAIL_BYTES) // 2).astype("u1")
    with log.open("wb") as fh:
        fh.write(b"INFO flashnext plugin: first start\n")
        for _ in range(4):
            fh.write(filler.tobytes() + b"\n")
        fh.write(b"INFO flashnext plugin: middle, never read\n")
        for _ in range(4):
            fh.write(filler.tobytes() + b"\n")
        fh.write(b"INFO flashnext plugin: after a restart\n")
    assert len(read_bounded(log)) <= HEAD_BYTES + TAIL_BYTES
    with openai_server(tmp_path) as srv:
        code, out, err = run_in_process(
            ["record", "capture", "--url", srv.url, "--log", log], capsys
        )
    assert code == 0, err
    lines = json.loads(out)["plugin_log"]
    assert lines == ["flashnext plugin: first start", "flashnext plugin: after a restart"]


# -- the one opener (flashnext.user_files), every command that reads a user's file ----------


def _special(tmp_path, kind, name):
    """A FIFO nobody writes, a link to /dev/zero, or a directory, at ``tmp_path/kind/name``."""
    path = tmp_path / kind / name
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "zero":
        path.symlink_to("/dev/zero")
    else:
        path.mkdir()
    return path


def _model_with_config(tmp_path, checkpoint, config):
    """A copy of ``checkpoint`` (its files linked) whose config.json is ``config``."""
    root = tmp_path / f"model-{config.parent.name}"
    root.mkdir()
    for f in checkpoint.iterdir():
        if f.name != "config.json":
            (root / f.name).symlink_to(f)
    (root / "config.json").symlink_to(config)
    return root


def _checkpoint_with_shard(tmp_path, checkpoint, special):
    """A copy of ``checkpoint`` whose first weight file is ``special``; (copy, that file)."""
    root = tmp_path / f"ck-{special.parent.name}"
    shards = sorted(f for f in checkpoint.iterdir() if f.suffix == ".safetensors")
    for f in checkpoint.rglob("*"):
        target = root / f.relative_to(checkpoint)
        target.parent.mkdir(parents=True, exist_ok=True)
        if f.is_dir():
            target.mkdir(exist_ok=True)
        else:
            target.symlink_to(special if f == shards[0] else f)
    return root, root / shards[0].name


def _commands(tmp_path, cli_inputs, kind, x):
    """Command name -> (argv, the path its error must name)."""
    from .inputs import deployment_record, profile_inputs

    rec, report = deployment_record(cli_inputs), cli_inputs.report
    url = f"http://127.0.0.1:{closed_port()}"
    ck = cli_inputs.checkpoint
    out = tmp_path / kind / "out"
    model = _model_with_config(tmp_path, ck, x)
    broken, shard = _checkpoint_with_shard(tmp_path, ck, x)
    prof = profile_inputs(cli_inputs)
    cmds = {
        "ple profile --text": ["ple", "profile", prof.sidecar, "--text", x, "--tokenizer",
                               prof.tokenizer, "--output", out / "p"],
        "record diff (first)": ["record", "diff", x, rec],
        "record diff (second)": ["record", "diff", rec, x],
        "record restore": ["record", "restore", x],
        "validate compare (first)": ["validate", "compare", x, report],
        "validate compare (second)": ["validate", "compare", report, x],
        "validate ab --prompts": ["validate", "ab", "--baseline", url, "--candidate", url,
                                  "--prompts", x, "--out", out / "ab"],
        "explain": ["explain", x],
        "checkpoint plan INDEX": ["checkpoint", "plan", x],
        "plan --from-log": ["plan", "--model", ck, "--gpu-memory", "96GiB", "--from-log", x],
        "plan --model config.json": ["plan", "--model", x, "--gpu-memory", "96GiB"],
    }  # fmt: skip
    named = dict.fromkeys(cmds, x)
    for name, argv, path in (
        ("plan --model DIR", ["plan", "--model", model, "--gpu-memory", "96GiB"], "config.json"),
        ("check --model DIR", ["check", "--model", model, "--gpu", "sm120,96GiB,cuda13.0",
                               "--vllm-version", "0.33.0"], "config.json"),
        ("checkpoint verify --hash", ["checkpoint", "verify", broken, "--hash"], shard),
    ):  # fmt: skip
        cmds[name], named[name] = argv, model / path if path == "config.json" else path
    if kind == "directory":  # a directory is where these look for their file: not refused
        del cmds["plan --model config.json"], cmds["checkpoint plan INDEX"]
    else:
        cmds["validate ab --baseline ANSWERS"] = [
            "validate",
            "ab",
            "--baseline",
            x,
            "--candidate",
            url,
            "--out",
            out / "ab2",
        ]
        named["validate ab --baseline ANSWERS"] = x
    return {name: (argv, named[name]) for name, argv in cmds.items()}


#: Commands whose refusal closes a report of many lines (every file of a checkpoint, a progress
#: display): the last line is the refusal.
REPORTS = ("checkpoint verify --hash",)


class _Timeout(Exception):
    pass


@pytest.mark.parametrize("kind", ["fifo", "zero", "directory"])
def test_every_user_file_reader_refuses_what_is_not_a_file(tmp_path, cli_inputs, capsys, kind):
    """Each command that reads a user's file, given a FIFO nobody writes, a link to /dev/zero
    or a directory where the file goes: one line naming the path, exit 1, at once (an alarm
    stops a command that blocks or reads forever, and fails the case)."""
    import signal

    def alarm(*_):
        raise _Timeout

    x = _special(tmp_path, kind, "config.json")
    previous = signal.signal(signal.SIGALRM, alarm)
    wrong = {}
    try:
        for name, (argv, path) in _commands(tmp_path, cli_inputs, kind, x).items():
            signal.alarm(20)
            try:
                code, _, err = run_in_process(argv, capsys)
            except _Timeout:
                wrong[name] = "blocked or read without end"
                continue
            finally:
                signal.alarm(0)
            lines = err.strip().splitlines()
            # click's own file check (exit 2) refuses a directory in one line as well
            said = (
                ("not a regular file", "is a directory") if code == 2 else ("not a regular file",)
            )
            if code not in (1, 2) or not lines or not any(w in lines[-1] for w in said):
                wrong[name] = (code, err[-300:])
            elif str(path) not in lines[-1] or (len(lines) != 1 and name not in REPORTS):
                wrong[name] = ("not one line naming the path", err[-300:])
    finally:
        signal.signal(signal.SIGALRM, previous)
    assert not wrong, "\n".join(f"{k}: {v}" for k, v in wrong.items())

"""Rule: `--json` means JSON, also on failure. Every command with `--json`, given an input it
must refuse, prints one record (schema_version, kind, error) on stdout and keeps its exit status.

Commands are discovered from the click tree; a new `--json` command fails
``test_every_json_command_has_a_failing_input`` until it is given one here.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from flashnext.records import CLI_ERROR, check_record

from .inputs import closed_port, has_option, leaf_commands
from .runner import popen, run_in_process


def _url() -> str:
    return f"http://127.0.0.1:{closed_port()}"


# command -> (arguments that must fail, given a plain text file F and an empty directory E)
FAILING: dict[str, Callable[[Path, Path], list[object]]] = {
    "check": lambda f, e: ["--model", f, "--gpu", "sm120,96GiB,cuda13.0"],
    "checkpoint override": lambda f, e: [e, "--layer-type", "a=b", "--out", e / "o"],
    "checkpoint plan": lambda f, e: [f, "--repo", "org/model"],
    "checkpoint ple": lambda f, e: [e],
    "checkpoint verify": lambda f, e: [f],
    "demo": lambda f, e: ["--out", f],
    "explain": lambda f, e: [f, "--model", f],
    "plan": lambda f, e: ["--model", f, "--gpu-memory", "8GiB"],
    "ple info": lambda f, e: [e],
    "ple lookup": lambda f, e: [e, "--ids", "1"],
    "ple preflight": lambda f, e: [e],
    "ple profile": lambda f, e: [e, "--text", f, "--tokenizer", f],
    "ple quantize": lambda f, e: [e, e.parent / "q", "--format", "int4"],
    "ple warm": lambda f, e: [e],
    "ple slice": lambda f, e: [e, e.parent / "s", "--tp", "2", "--ranks", "1"],
    "record diff": lambda f, e: [f, f],
    "validate": lambda f, e: ["--url", "ftp://x", "--out", e / "r"],
    "validate ab": lambda f, e: ["--baseline", "ftp://x", "--candidate", _url()],
    "validate compare": lambda f, e: [f, f],
}
#: Commands whose own record already says what failed (it carries its fields and an error).
OWN_FAILURE_RECORD = {"checkpoint verify"}

JSON_COMMANDS = sorted(n for n, c in leaf_commands().items() if has_option(c, "--json"))


def test_every_json_command_has_a_failing_input():
    missing = [n for n in JSON_COMMANDS if n not in FAILING]
    assert not missing, f"give these commands a failing input in FAILING: {missing}"


@pytest.mark.parametrize("command", JSON_COMMANDS)
def test_failure_prints_an_error_record(command, tmp_path, capsys):
    a_file, empty = tmp_path / "a_file", tmp_path / "empty"
    a_file.write_text("not what any command expects\n")
    empty.mkdir()
    argv = [*command.split(), *FAILING[command](a_file, empty), "--json"]
    code, out, err = run_in_process([str(a) for a in argv], capsys)
    assert code in (1, 2), (code, out, err)
    record = check_record(json.loads(out), source=f"flashnext {command} --json")
    assert out.strip().endswith("}") and out.count("\n{") == 0  # one document, nothing else
    assert err.count("error: ") == 1 and err.startswith("error: ")
    if command in OWN_FAILURE_RECORD and record["kind"] != CLI_ERROR:
        return
    assert record["kind"] == CLI_ERROR
    assert record["error"] == err.strip().removeprefix("error: ")
    assert record["exit_code"] == code and record["command"] == command


def test_flag_after_double_dash_is_not_ours(tmp_path, capsys):
    """`check -- ... --json` passes --json to vLLM's argument list: no record is printed."""
    code, out, err = run_in_process(["check", "--model", str(tmp_path), "--", "--json"], capsys)
    assert code != 0 and out == "" and err.startswith("error: ")


def test_interrupt_prints_a_record_and_exits_130(tmp_path):
    """A real SIGINT while `explain -` waits for its log on stdin (a pipe nobody writes; a FIFO
    --model is refused at once since issue 42, so it no longer waits there)."""
    # SIGINT at its default in the child: a suite started in the background by a
    # non-interactive shell runs with SIGINT ignored, which the child would inherit
    default_sigint = lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)  # noqa: E731
    proc = popen("explain", "-", "--json", preexec=default_sigint, stdin=subprocess.PIPE)
    wchan = Path(f"/proc/{proc.pid}/wchan")
    deadline = time.monotonic() + 120
    while "pipe_read" not in wchan.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)  # until the command blocks reading stdin: the signal then meets flashnext
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    record = check_record(json.loads(out))
    assert record["kind"] == CLI_ERROR and record["exit_code"] == 130
    assert record["error"] == "interrupted" and record["command"] == "explain"

"""Issue 22 rule 3: two writers never meet.

Real ``flashnext ple quantize`` processes on one destination (and, issue 42, two real
processes of every writing command). The first is stopped (SIGSTOP)
right after it took the destination's lock, so the second always runs while the first holds
it; the second must be refused naming the first's pid, and nothing of it may be left behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from flashnext.errors import SidecarError
from flashnext.store import open_sidecar, write_sidecar
from flashnext.store.destination import DestinationLock
from flashnext.synthetic import embedding_rows

from .hooks import hooked
from .inputs import ProfileInputs
from .runner import BASE_ENV, popen, run

LINUX = sys.platform.startswith("linux")


def _run(*args: object) -> subprocess.CompletedProcess[str]:
    return run(*args)


def _stop_once_locked(proc: subprocess.Popen[str], dst: Path) -> None:
    """SIGSTOP ``proc`` as soon as its lock file beside ``dst`` names it."""
    lock = dst.with_name(f".{dst.name}.flashnext-lock")
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the first writer never took the lock"
        try:
            if lock.read_text().strip() == str(proc.pid):
                break
        except FileNotFoundError:
            pass
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGSTOP)


@contextmanager
def _locked_writer(source: Path, dst: Path, *flags: str) -> Iterator[subprocess.Popen[str]]:
    """A ``ple quantize source dst *flags`` process, stopped once it holds ``dst``'s lock;
    on the way out it is resumed and killed unless it already finished."""
    first = popen("ple", "quantize", source, dst, *flags)
    try:
        _stop_once_locked(first, dst)
        yield first
    finally:
        if first.poll() is None:
            os.kill(first.pid, signal.SIGCONT)
            first.kill()


def _resume(proc: subprocess.Popen[str]) -> subprocess.CompletedProcess[str]:
    os.kill(proc.pid, signal.SIGCONT)
    out, err = proc.communicate(timeout=300)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _refused_by(proc: subprocess.CompletedProcess[str], holder: int, dst: Path) -> None:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len(lines) == 1, proc.stderr
    assert f"another flashnext process (pid {holder}) is writing {dst}" in lines[0], lines[0]


@pytest.fixture
def source(tmp_path: Path, rng) -> Path:
    write_sidecar(tmp_path / "src", "bf16", embedding_rows(4000, 160, rng), 1000)
    return tmp_path / "src"


def _leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if "flashnext" in p.name)


@pytest.mark.skipif(not LINUX, reason="SIGSTOP/SIGCONT and flock as on Linux")
def test_second_writer_is_refused_naming_the_first(tmp_path, source):
    dst = tmp_path / "dst"
    with _locked_writer(source, dst, "--format", "int4") as first:
        second = _run("ple", "quantize", source, dst, "--format", "int4")
        _refused_by(second, first.pid, dst)
        other = _run("ple", "quantize", source, dst, "--format", "fp8", "--force")
        _refused_by(other, first.pid, dst)
        done = _resume(first)
    assert done.returncode == 0, done.stderr[-3000:]
    assert open_sidecar(dst).format == "int4"
    assert _leftovers(tmp_path) == []  # no lock file, no .dst.flashnext-new


@pytest.mark.skipif(not LINUX, reason="SIGSTOP/SIGCONT and flock as on Linux")
def test_force_race_leaves_no_mixed_table(tmp_path, source, rng):
    dst = tmp_path / "dst"
    write_sidecar(dst, "fp8", embedding_rows(300, 160, rng), 100)
    with _locked_writer(source, dst, "--format", "int4", "--force") as first:
        second = _run("ple", "quantize", source, dst, "--format", "nvfp4", "--force")
        _refused_by(second, first.pid, dst)
        done = _resume(first)
    assert done.returncode == 0, done.stderr[-3000:]
    table = open_sidecar(dst)  # META.json and every shard agree (the reader checks both)
    assert table.format == "int4" and table.num_rows == 4000
    assert _leftovers(tmp_path) == []


@pytest.mark.skipif(not LINUX, reason="SIGKILL releases flock as on Linux")
def test_a_killed_writer_does_not_block_the_next(tmp_path, source):
    dst = tmp_path / "dst"
    first = popen("ple", "quantize", source, dst, "--format", "int4")
    _stop_once_locked(first, dst)
    first.kill()
    first.communicate(timeout=60)
    assert dst.with_name(".dst.flashnext-lock").exists()  # its lock file stays, unlocked
    again = _run("ple", "quantize", source, dst, "--format", "int4")
    assert again.returncode == 0, again.stderr[-3000:]
    assert open_sidecar(dst).format == "int4" and _leftovers(tmp_path) == []


def test_lock_in_one_process_is_exclusive_and_released(tmp_path):
    """Two opens of the lock file conflict even in one process (flock is per open file)."""
    dst = tmp_path / "d"
    held = rf"another flashnext process \(pid {os.getpid()}\)"
    with DestinationLock(dst), pytest.raises(SidecarError, match=held):
        DestinationLock(dst).acquire()
    assert _leftovers(tmp_path) == []
    with DestinationLock(dst):  # free again
        pass


# -- issue 42: every writing command takes its destination's lock (the library takes it) --------
#: After the NTH DestinationLock.acquire returns, the writer stops itself (SIGSTOP): the second
#: writer then always meets a held lock, whatever the machine's speed.
LOCKED = ("flashnext.store.destination:DestinationLock.acquire", "after", 1)


def _writers(w: Any, openai_url: str) -> dict[str, tuple[list[object], str, int]]:
    """command -> (argv, destination, exit status of the first writer when left to finish)."""
    dead = "http://127.0.0.1:9"
    override = ["checkpoint", "override", w.checkpoint, "--layer-type",
                "qwen_sparse_attention=full_attention", "--out", "o"]  # fmt: skip
    validate = ["validate", "--url", dead, "--ready-timeout", "0.5", "--no-png", "--out", "v"]
    ab = ["validate", "ab", "--baseline", dead, "--candidate", dead[:-1] + "7", "--prompts", w.prompts,
          "--timeout", "1", "--no-png", "--out", "a"]  # fmt: skip
    capture = ["record", "capture", "--url", openai_url, "--output", "r.json"]
    return {
        "ple quantize": (["ple", "quantize", w.sidecar, "q", "--format", "int4"], "q", 0),
        "ple slice": (["ple", "slice", w.sidecar, "s", "--tp", "1", "--ranks", "0"], "s", 0),
        "ple profile": ([*w.profile.argv(), "--output", "p.safetensors"], "p.safetensors", 0),
        "demo": (["demo", "--base", "1000", "--out", "d"], "d", -signal.SIGKILL),
        "record capture": (capture, "r.json", 0),
        "record restore --output": (["record", "restore", w.record, "--output", "r.sh"], "r.sh", 0),
        "checkpoint override": (override, "o", 0),
        "validate": (validate, "v", 1),
        "validate ab": (ab, "a", 1),
    }


@dataclass
class _World:
    sidecar: Path
    profile: ProfileInputs
    record: Path
    checkpoint: Path
    prompts: Path


@pytest.fixture(scope="module")
def writers_world(tmp_path_factory: pytest.TempPathFactory, cli_inputs) -> _World:
    from .inputs import build_profile_inputs, deployment_record

    root = tmp_path_factory.mktemp("writers")
    prompts = root / "p.jsonl"
    prompts.write_text('{"id": "p1", "prompt": "Hello"}\n')
    return _World(cli_inputs.sidecar, build_profile_inputs(root / "profile"),
                  deployment_record(cli_inputs), cli_inputs.checkpoint, prompts)  # fmt: skip


@pytest.fixture(scope="module")
def openai_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from .servers import openai_server

    with openai_server(tmp_path_factory.mktemp("writers-server")) as server:
        yield server.url


def _wait_stopped(proc: subprocess.Popen[str]) -> None:
    """Until ``proc`` has stopped itself (state T in /proc): it then holds the lock."""
    deadline = time.monotonic() + 120
    while Path(f"/proc/{proc.pid}/stat").read_text().rpartition(")")[2].split()[0] != "T":
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the first writer never took its lock"
        time.sleep(0.01)


COMMANDS_42 = ["ple quantize", "ple slice", "ple profile", "demo", "record capture",
               "record restore --output", "checkpoint override", "validate", "validate ab"]  # fmt: skip


@pytest.mark.skipif(not LINUX, reason="SIGSTOP, /proc and flock as on Linux")
@pytest.mark.parametrize("command", COMMANDS_42)
def test_two_writers_of_every_command_never_meet(
    tmp_path, writers_world, openai_url, command
) -> None:
    argv, dst, first_code = _writers(writers_world, openai_url)[command]
    env = {**os.environ, **BASE_ENV}
    first = subprocess.Popen(hooked(LOCKED, "SIGSTOP", *argv), cwd=tmp_path, env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    try:
        _wait_stopped(first)
        before = sorted(p.name for p in tmp_path.iterdir())
        second = run(*argv, cwd=tmp_path)
        _refused_by(second, first.pid, Path(dst))
        assert sorted(p.name for p in tmp_path.iterdir()) == before, "the second wrote"
        if first_code == -signal.SIGKILL:  # a long run (the demo): a killed holder, not waited
            first.kill()
        os.kill(first.pid, signal.SIGCONT)
        _, err = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            first.kill()
            first.communicate()
    assert first.returncode == first_code, err[-3000:]
    if first_code != -signal.SIGKILL:
        assert not [p for p in tmp_path.iterdir() if p.name.endswith("flashnext-lock")]

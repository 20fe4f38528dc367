"""Issue 22 rule 3: two writers never meet.

Real ``flashnext ple quantize`` processes on one destination. The first is stopped (SIGSTOP)
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
from pathlib import Path

import pytest

from flashnext.errors import SidecarError
from flashnext.ple import open_sidecar, write_sidecar
from flashnext.ple.destination import DestinationLock
from flashnext.synthetic import embedding_rows

from .runner import popen, run

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

"""A memory cgroup other than one's own: ``ple preflight --memory-cgroup``, ``plan
--memory-cgroup`` (a server started in that cgroup; vLLM reads no limit), and the devtools helper
that owns such a cgroup's life (devtools/cgroup.py).

The commands are checked against a real cgroup made here (this host's v1 or v2; root only) and
against the captured v1 and v2 trees of tests/host/fixtures/preflight (both versions whatever
the host offers).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from devtools.cgroup import MemoryCgroup, memory_hierarchy
from flashnext.host.preflight import GIB, PreflightError, named_cgroup_levels

from ..cli.runner import run
from ..plan.test_planner import QWEN4
from .test_preflight_fixtures import FILES, V1_OWN, V2_POD, _tree

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="making a memory cgroup needs root")


@pytest.fixture
def one_gib() -> Iterator[MemoryCgroup]:
    with MemoryCgroup(f"flashnext-test-{os.getpid()}", GIB) as cg:
        yield cg


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_a_named_cgroup_is_read_with_its_ancestors(tmp_path: Path, version: str) -> None:
    root = _tree(tmp_path, f"cgroup_{version}")
    level = root / (V1_OWN if version == "v1" else V2_POD)
    limit, usage, _ = FILES[version]
    (level / limit).write_text(f"{3 * GIB}\n")
    (level / usage).write_text(f"{GIB}\n")
    levels = named_cgroup_levels(level)
    mine = next(lv for lv in levels if lv.path.endswith(level.name))
    assert (mine.version, mine.limit, mine.usage) == (version, 3 * GIB, GIB)
    assert mine.path == "/" + level.relative_to("/").as_posix()


def test_a_directory_that_is_no_cgroup_is_named(tmp_path: Path, cli_inputs) -> None:
    with pytest.raises(PreflightError, match=rf"--memory-cgroup {tmp_path}: not a memory cgroup"):
        named_cgroup_levels(tmp_path)
    for argv in (
        ["ple", "preflight", cli_inputs.sidecar],
        ["plan", "--model", QWEN4, "--gpu-memory", "96GiB"],
    ):
        done = run(*argv, "--memory-cgroup", tmp_path)
        assert done.returncode == 1 and done.stderr == (
            f"error: --memory-cgroup {tmp_path}: not a memory cgroup (expected memory.max, v2, "
            "or memory.limit_in_bytes, v1)\n"
        )


@needs_root
def test_preflight_checks_the_named_cgroup(cli_inputs, one_gib: MemoryCgroup) -> None:
    """The checkpoint's table (copied by stock vLLM: resident) plus 2 GiB headroom fits this
    host but not the 1 GiB cgroup; the sidecar memory-mapped is a warning there, not a refusal."""
    ck = cli_inputs.checkpoint
    host = json.loads(run("ple", "preflight", ck, "--json").stdout)
    assert host["ok"] and host["residency"] == "resident"
    capped = run("ple", "preflight", ck, "--memory-cgroup", one_gib.path, "--json")
    record = json.loads(capped.stdout)
    assert capped.returncode == 1 and not record["ok"]
    assert record["memory"]["cgroup"]["limit"] == GIB
    assert str(one_gib.path) in record["refusals"][0] and "checkpoint" in record["what"]
    assert "ple quantize it to a sidecar" in record["refusals"][0]  # not "--residency mmap"
    side = run("ple", "preflight", cli_inputs.sidecar, "--memory-cgroup", one_gib.path, "--json")
    assert side.returncode == 0 and json.loads(side.stdout)["warnings"], side.stdout


def test_a_checkpoint_is_not_checked_memory_mapped(cli_inputs) -> None:
    done = run("ple", "preflight", cli_inputs.checkpoint, "--residency", "mmap")
    assert done.returncode == 2 and "served resident" in done.stderr, done.stderr


@needs_root
def test_plan_takes_host_memory_from_the_named_cgroup(one_gib: MemoryCgroup) -> None:
    """A staged, memory-mapped table is page cache: a 512 MiB worker fits the 1 GiB cgroup; the
    default 8 GiB worker does not."""
    base = ["plan", "--model", QWEN4, "--gpu-memory", "96GiB", "--ple-format", "int4",
            "--ple-placement", "staged", "--max-model-len", "8192", "--json"]  # fmt: skip
    fits = run(*base, "--memory-cgroup", one_gib.path, "--worker-host-memory", "512MiB")
    record = json.loads(fits.stdout)
    assert record["request"]["host_memory"] == GIB and record["host_fits"] is True, fits.stderr
    worker = next(i for i in record["host"] if i["name"] == "vLLM worker process")
    assert worker["bytes"] == 512 << 20 and "--worker-host-memory" in worker["note"]
    over = run(*base, "--memory-cgroup", one_gib.path)
    assert over.returncode == 3 and json.loads(over.stdout)["host_fits"] is False
    both = run(*base, "--memory-cgroup", one_gib.path, "--host-memory", "1GiB")
    assert both.returncode == 2 and "not both" in both.stderr


@needs_root
def test_the_helper_owns_a_cgroup_life(tmp_path: Path) -> None:
    """A process started through wrap() is charged to the group, the OOM killer's kill is
    counted, the peak stays under the limit, and the group is gone afterwards."""
    version, parent = memory_hierarchy()
    grab = "b = bytearray(256 << 20); b[::4096] = b'x' * len(b[::4096])"  # 256 MiB touched
    with MemoryCgroup(f"flashnext-test-{os.getpid()}", 64 << 20) as cg:
        assert cg.version == version and cg.path.parent == parent
        done = subprocess.run([*cg.wrap(), sys.executable, "-c", grab], capture_output=True)
        assert done.returncode == -9, done.stderr
        assert cg.oom_kills() == 1
        peak = cg.peak()
        assert peak is not None and 32 << 20 < peak <= 64 << 20
        sleeper = subprocess.Popen(
            [*cg.wrap(), sys.executable, "-c", "import time; time.sleep(60)"]
        )
        for _ in range(50):
            if cg.pids():
                break
            time.sleep(0.1)
        assert cg.pids() == [sleeper.pid]
    assert sleeper.wait(timeout=10) == -9 and not cg.path.exists()


def test_the_helper_speaks_v2_files(tmp_path: Path) -> None:
    """The v2 spelling, on a tree of plain files (this host's kernel offers v1): the memory
    controller is enabled for children, the limit goes to memory.max, and peak and OOM kills
    come from memory.peak and memory.events."""
    (tmp_path / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    (tmp_path / "cgroup.subtree_control").write_text("cpu\n")
    cg = MemoryCgroup("server", 3 << 30, root=tmp_path)
    assert cg.version == "v2" and cg.path == tmp_path / "server"
    cg.create()
    assert (tmp_path / "cgroup.subtree_control").read_text() == "+memory"
    assert (cg.path / "memory.max").read_text() == str(3 << 30)
    (cg.path / "memory.peak").write_text("123456\n")
    (cg.path / "memory.events").write_text("low 0\nhigh 0\nmax 7\noom 2\noom_kill 1\n")
    assert (cg.peak(), cg.oom_kills(), cg.pids()) == (123456, 1, [])

"""Preflight against /proc and /sys trees captured on real machines (tests/host/fixtures/preflight).

Each case copies a captured tree and edits only the numbers its README names: the binding
cgroup's limit, usage and inactive page cache, or vm.overcommit_memory.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from flashnext.host.preflight import GIB, host_memory, preflight_table

FIXTURES = Path(__file__).parent / "fixtures" / "preflight"
V1_OWN = "sys/fs/cgroup/memory/process_api/c43d7b5ac2a75bc41e2a5c44ee15e92d"
V2_POD = "sys/fs/cgroup/kubepods.slice/kubepods-burstable.slice/pod123.slice"
# file names per cgroup version: limit, usage, memory.stat key of the reclaimable page cache
FILES = {
    "v1": ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"),
    "v2": ("memory.max", "memory.current", "inactive_file"),
}


def _tree(tmp_path: Path, kind: str) -> Path:
    root = tmp_path / kind
    shutil.copytree(FIXTURES / kind, root)
    return root


def _set_stat(path: Path, key: str, value: int) -> None:
    text, n = re.subn(rf"(?m)^{key} \d+$", f"{key} {value}", path.read_text())
    assert n == 1, f"{path} has no line {key}"
    path.write_text(text)


def _limited(tmp_path: Path, version: str, reclaimable: int) -> Path:
    """The captured tree of ``version`` with its binding cgroup at limit 8 GiB, usage 7.5 GiB."""
    root = _tree(tmp_path, f"cgroup_{version}")
    level = root / (V1_OWN if version == "v1" else V2_POD)
    limit, usage, key = FILES[version]
    (level / limit).write_text(f"{8 * GIB}\n")
    (level / usage).write_text(f"{int(7.5 * GIB)}\n")
    _set_stat(level / "memory.stat", key, reclaimable)
    return root


def test_captured_trees_read_as_captured():
    v1 = host_memory(FIXTURES / "cgroup_v1")
    assert v1.cgroup is None  # every level of this VM's memory cgroups is unlimited
    assert v1.mem_available == 23033904 * 1024 and v1.overcommit_mode == 0
    v2 = host_memory(FIXTURES / "cgroup_v2")
    assert v2.cgroup is not None and v2.cgroup.version == "v2"
    assert v2.cgroup.path == "/kubepods.slice/kubepods-burstable.slice/pod123.slice"
    assert (v2.cgroup.limit, v2.cgroup.usage) == (42949672960, 34255089664)
    assert v2.cgroup.reclaimable == 20126994432  # runc's captured inactive_file
    assert v2.available == 11225936 * 1024  # MemAvailable binds: the cgroup has more room
    none = host_memory(FIXTURES / "no_cgroup")
    assert none.cgroup is None and none.commit_limit == 16122784 * 1024


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_cgroup_limit_smaller_than_the_table_refuses(tmp_path, version):
    memory = host_memory(_limited(tmp_path, version, reclaimable=int(0.2 * GIB)))
    assert memory.cgroup is not None and memory.cgroup.version == version
    verdict = preflight_table(4 * GIB, "resident", "ple_int4 (int4)", memory=memory)
    assert not verdict.ok
    path = "/process_api/c43d7b5ac2a75bc41e2a5c44ee15e92d" if version == "v1" else "/kubepods"
    assert re.fullmatch(
        r"a resident copy of ple_int4 \(int4\) needs 4\.0 GiB plus 2\.0 GiB headroom, but only "
        r"0\.7 GiB is available \(MemAvailable \d+\.\d GiB; cgroup "
        + version
        + " "
        + re.escape(path)
        + r"\S* limit 8\.0 GiB less usage 7\.5 GiB plus reclaimable page cache 0\.2 GiB = "
        r"0\.7 GiB\)\. Serve it memory-mapped instead .*",
        verdict.refusals[0],
    ), verdict.refusals[0]
    # Memory-mapped, the same table only warns: page cache, no anonymous copy.
    mapped = preflight_table(4 * GIB, "mmap", "ple_int4 (int4)", memory=memory)
    assert mapped.ok and "page cache can keep only 0 B" in mapped.warnings[0]


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_reclaimable_page_cache_makes_it_fit(tmp_path, version):
    memory = host_memory(_limited(tmp_path, version, reclaimable=6 * GIB))
    assert memory.available == int(6.5 * GIB)
    verdict = preflight_table(4 * GIB, "resident", "ple_int4 (int4)", memory=memory)
    assert verdict.ok and not verdict.warnings
    # 4 GiB mapped with a 0.25 GiB hot tier still fits the cache: no warning either.
    mapped = preflight_table(4 * GIB, "mmap", "t", hot_bytes=GIB // 4, memory=memory)
    assert mapped.ok and not mapped.warnings and mapped.anonymous_bytes == GIB // 4


def test_no_cgroup_memavailable_binds(tmp_path):
    memory = host_memory(FIXTURES / "no_cgroup")  # MemAvailable 10.7 GiB, MemFree 8.2 GiB
    refused = preflight_table(9 * GIB, "resident", "t", memory=memory)
    assert refused.refusals[0].startswith(
        "a resident copy of t needs 9.0 GiB plus 2.0 GiB headroom, but only 10.7 GiB is "
        "available (MemAvailable 10.7 GiB)."
    )
    # More than MemFree, but the kernel's reclaimable cache (counted in MemAvailable) covers it.
    fits = preflight_table(int(8.5 * GIB), "resident", "t", memory=memory)
    assert fits.ok and 8.5 * GIB > 8577628 * 1024


def test_strict_overcommit_limits_resident_copies_not_maps(tmp_path):
    root = _tree(tmp_path, "cgroup_v1")
    (root / "proc/sys/vm/overcommit_memory").write_text("2\n")
    memory = host_memory(root)  # CommitLimit 11.8 GiB less Committed_AS 1.7 GiB
    assert memory.commit_available == (12341828 - 1830936) * 1024
    refused = preflight_table(10 * GIB, "resident", "t", memory=memory)
    assert (
        "vm.overcommit_memory=2: CommitLimit 11.8 GiB less Committed_AS 1.7 GiB = 10.0 GiB"
        in (refused.refusals[0])
    )
    assert preflight_table(10 * GIB, "mmap", "t", memory=memory).ok  # file pages: no commit
    hot = preflight_table(10 * GIB, "mmap", "t", hot_bytes=10 * GIB, memory=memory)
    assert hot.refusals[0].startswith("the hot tier of t needs 10.0 GiB")

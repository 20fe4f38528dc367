"""Host-memory preflight on this machine's real /proc and on cgroup files laid out on disk."""

import numpy as np
import pytest

from flashnext.ple import open_table, write_sidecar
from flashnext.ple.preflight import GIB, HostMemory, PreflightError, check_fits, host_memory


def test_reads_this_machine():
    mem = host_memory()
    with open("/proc/meminfo") as f:
        avail_kb = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    assert abs(mem.mem_available - avail_kb * 1024) < 512 * 1024**2  # moved a little since
    assert 0 < mem.available <= mem.mem_available


def _cgroup_tree(tmp_path, version, limit, usage, inactive_file):
    (tmp_path / "meminfo").write_text("MemTotal: 100000000 kB\nMemAvailable: 60000000 kB\n")
    if version == 2:
        d = tmp_path / "cg" / "job"
        d.mkdir(parents=True)
        (d / "memory.max").write_text(f"{limit}\n")
        (d / "memory.current").write_text(f"{usage}\n")
        (d / "memory.stat").write_text(f"anon 123\ninactive_file {inactive_file}\nactive_file 5\n")
        (tmp_path / "self_cgroup").write_text("0::/job\n")
    else:
        d = tmp_path / "cg" / "memory" / "docker" / "abc"
        d.mkdir(parents=True)
        (d / "memory.limit_in_bytes").write_text(f"{limit}\n")
        (d / "memory.usage_in_bytes").write_text(f"{usage}\n")
        (d / "memory.stat").write_text(f"cache 1\ntotal_inactive_file {inactive_file}\n")
        (tmp_path / "self_cgroup").write_text("4:memory:/docker/abc\n1:cpu:/\n")
    return host_memory(tmp_path / "meminfo", tmp_path / "cg", tmp_path / "self_cgroup")


@pytest.mark.parametrize("version", [1, 2])
def test_cgroup_limit_less_usage_plus_reclaimable(tmp_path, version):
    mem = _cgroup_tree(tmp_path, version, 48 * GIB, 40 * GIB, 6 * GIB)
    assert mem.cgroup_available == 14 * GIB and mem.available == 14 * GIB
    assert "limit 48.0 GiB less usage 40.0 GiB plus reclaimable page cache 6.0 GiB" in mem.explain()


def test_unlimited_cgroup_uses_memavailable(tmp_path):
    mem = _cgroup_tree(tmp_path, 2, "max", 40 * GIB, 0)
    assert mem.cgroup_limit is None and mem.available == 60000000 * 1024


def test_refuses_with_numbers():
    mem = HostMemory(
        mem_available=40 * GIB,
        cgroup_limit=48 * GIB,
        cgroup_usage=40 * GIB,
        cgroup_reclaimable=2 * GIB,
        cgroup_path="/sys/fs/cgroup/job",
    )
    with pytest.raises(
        PreflightError,
        match=r"table needs 29\.8 GiB plus 2\.0 GiB headroom, but only 10\.0 GiB is available",
    ) as info:
        check_fits(int(29.8 * GIB), "table", memory=mem)
    assert "residency='mmap'" in str(info.value)
    assert check_fits(7 * GIB, "table", memory=mem) is mem


def test_open_table_resident_refuses_what_cannot_fit(tmp_path, rng):
    x = rng.standard_normal((64, 160)).astype(np.float32)
    write_sidecar(tmp_path, "int4", x, 32)
    small_host = HostMemory(mem_available=2 * GIB)  # 2 GiB free: less than the headroom alone
    with pytest.raises(
        PreflightError,
        match=r"a resident copy of .* \(int4, rows 32\.\.64\) needs 0\.0 GiB plus 2\.0 GiB headroom, but only 2\.0 GiB",
    ):
        open_table(tmp_path, "resident", row_range=(32, 64), preflight=small_host)
    assert open_table(tmp_path, "mmap", preflight=small_host).resident_bytes == 0
    assert open_table(tmp_path, "resident").resident_bytes == 64 * 100  # this machine: fits

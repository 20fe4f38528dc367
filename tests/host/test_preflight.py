"""Host-memory preflight on this machine's real /proc and /sys, and in open_table."""

from pathlib import Path

import numpy as np
import pytest

from flashnext.host import open_table
from flashnext.host.preflight import (
    GIB,
    CgroupLevel,
    HostMemory,
    PreflightError,
    check_fits,
    host_memory,
)
from flashnext.store import write_sidecar


def _meminfo_bytes(key: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def test_reads_this_machine():
    mem = host_memory()
    assert abs(mem.mem_available - _meminfo_bytes("MemAvailable")) < 512 * 1024**2  # moved since
    assert mem.commit_limit == _meminfo_bytes("CommitLimit")
    assert mem.overcommit_mode == int(Path("/proc/sys/vm/overcommit_memory").read_text())
    assert 0 < mem.available <= mem.page_cache_room <= mem.mem_available
    if mem.cgroup is not None:  # a limited memory cgroup: its numbers are this host's files
        assert 0 < mem.cgroup.limit < 1 << 60 and mem.cgroup.path in mem.sources


def test_refuses_with_numbers():
    mem = HostMemory(
        mem_available=40 * GIB,
        cgroup=CgroupLevel("/job", "v2", limit=48 * GIB, usage=40 * GIB, reclaimable=2 * GIB),
    )
    with pytest.raises(
        PreflightError,
        match=r"table needs 29\.8 GiB plus 2\.0 GiB headroom, but only 10\.0 GiB is available",
    ) as info:
        check_fits(int(29.8 * GIB), "table", memory=mem)
    assert "limit 48.0 GiB less usage 40.0 GiB plus reclaimable page cache 2.0 GiB" in str(
        info.value
    )
    assert "residency='mmap'" in str(info.value)
    assert check_fits(7 * GIB, "table", memory=mem) is mem


def test_open_table_resident_refuses_what_cannot_fit(tmp_path, rng):
    x = rng.standard_normal((64, 160)).astype(np.float32)
    write_sidecar(tmp_path, "int4", x, 32)
    small_host = HostMemory(mem_available=2 * GIB)  # 2 GiB free: less than the headroom alone
    with pytest.raises(
        PreflightError,
        match=r"a resident copy of .* \(int4, rows 32\.\.64\) needs 3\.1 KiB plus 2\.0 GiB headroom, but only 2\.0 GiB",
    ):
        open_table(tmp_path, "resident", row_range=(32, 64), preflight=small_host)
    assert open_table(tmp_path, "mmap", preflight=small_host).resident_bytes == 0
    assert open_table(tmp_path, "resident").resident_bytes == 64 * 100  # this machine: fits

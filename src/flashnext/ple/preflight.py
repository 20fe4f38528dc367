"""Host-memory preflight: will a resident table fit, before we start copying it?

A resident table is anonymous memory. Copying 30 GiB and failing at 25 is the worst outcome,
so we refuse up front with the numbers. Available memory is the smaller of

- the kernel's ``MemAvailable`` (``/proc/meminfo``), and
- in a container, the cgroup limit less its usage, plus the cgroup's reclaimable page cache
  (``inactive_file``): a cgroup's usage counts page cache, which the kernel drops under pressure.

cgroup v2 (``memory.max``, ``memory.current``, ``memory.stat``) and v1
(``memory.limit_in_bytes``, ``memory.usage_in_bytes``, ``total_inactive_file``) are read.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from flashnext.errors import FlashnextError

GIB = 1024**3
#: What we leave free beyond the table: the worker's own allocations and the kernel's.
DEFAULT_HEADROOM = 2 * GIB
_UNLIMITED = 1 << 60


class PreflightError(FlashnextError, MemoryError):
    """The host does not have the memory a resident table needs."""


@dataclass(frozen=True)
class HostMemory:
    """What this process may still allocate, in bytes, and where each number came from."""

    mem_available: int
    cgroup_limit: int | None = None
    cgroup_usage: int | None = None
    cgroup_reclaimable: int | None = None
    cgroup_path: str | None = None

    @property
    def cgroup_available(self) -> int | None:
        if self.cgroup_limit is None or self.cgroup_usage is None:
            return None
        return max(0, self.cgroup_limit - self.cgroup_usage + (self.cgroup_reclaimable or 0))

    @property
    def available(self) -> int:
        cg = self.cgroup_available
        return self.mem_available if cg is None else min(self.mem_available, cg)

    def explain(self) -> str:
        """One line: every number that went into :attr:`available`."""
        text = f"MemAvailable {self.mem_available / GIB:.1f} GiB"
        cg = self.cgroup_available
        if cg is not None:
            text += (
                f"; cgroup {self.cgroup_path} limit {(self.cgroup_limit or 0) / GIB:.1f} GiB less "
                f"usage {(self.cgroup_usage or 0) / GIB:.1f} GiB plus reclaimable page cache "
                f"{(self.cgroup_reclaimable or 0) / GIB:.1f} GiB = {cg / GIB:.1f} GiB"
            )
        return text


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return _UNLIMITED
    try:
        return int(text)
    except ValueError:
        return None


def _stat_value(path: Path, *keys: str) -> int | None:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    values = {}
    for line in lines:
        parts = line.split()
        if len(parts) >= 2:
            values[parts[0]] = parts[1]  # "MemAvailable: 123 kB" and "inactive_file 123"
    for key in keys:
        if key in values and values[key].isdigit():
            return int(values[key])
    return None


def _cgroup_dirs(cgroup_root: Path, proc_cgroup: Path) -> list[tuple[str, Path]]:
    """Candidate (version, directory) pairs holding this process's memory controller files."""
    rel_v2: str | None = None
    rel_v1: str | None = None
    try:
        for line in proc_cgroup.read_text().splitlines():
            hid, controllers, rel = line.split(":", 2)
            if hid == "0" and controllers == "":
                rel_v2 = rel
            elif "memory" in controllers.split(","):
                rel_v1 = rel
    except (OSError, ValueError):
        pass
    out = []
    for version, base, own in (
        ("v1", cgroup_root / "memory", rel_v1),
        ("v2", cgroup_root, rel_v2),
        ("v2", cgroup_root / "unified", rel_v2),
    ):
        if own is None:
            continue
        # Inside a container the mount usually shows the process's own cgroup as the root.
        for directory in (base / own.lstrip("/"), base):
            out.append((version, directory))
    return out


def host_memory(
    meminfo: str | Path = "/proc/meminfo",
    cgroup_root: str | Path = "/sys/fs/cgroup",
    proc_cgroup: str | Path = "/proc/self/cgroup",
) -> HostMemory:
    """Read the memory this process may still allocate (the paths exist for tests).

    Raises:
        PreflightError: ``meminfo`` cannot be read or has no MemAvailable line.
    """
    avail_kb = _stat_value(Path(meminfo), "MemAvailable:")
    if avail_kb is None:
        raise PreflightError(f"{meminfo}: no MemAvailable line; cannot check host memory")
    mem_available = avail_kb * 1024
    for version, directory in _cgroup_dirs(Path(cgroup_root), Path(proc_cgroup)):
        if version == "v2":
            limit = _read_int(directory / "memory.max")
            usage = _read_int(directory / "memory.current")
            reclaim = _stat_value(directory / "memory.stat", "inactive_file")
        else:
            limit = _read_int(directory / "memory.limit_in_bytes")
            usage = _read_int(directory / "memory.usage_in_bytes")
            reclaim = _stat_value(directory / "memory.stat", "total_inactive_file", "inactive_file")
        if limit is None or usage is None:
            continue
        if limit >= _UNLIMITED // 2:  # "max" or v1's page-rounded 2**63
            return HostMemory(mem_available)
        return HostMemory(mem_available, limit, usage, reclaim, str(directory))
    return HostMemory(mem_available)


def check_fits(
    needed: int,
    what: str,
    headroom: int = DEFAULT_HEADROOM,
    memory: HostMemory | None = None,
) -> HostMemory:
    """Raise :class:`PreflightError` unless ``needed`` bytes plus ``headroom`` are available.

    ``what`` names the allocation in the message, e.g. "a resident copy of /ples_int4 (int4)".
    Returns the :class:`HostMemory` reading that was checked.
    """
    memory = memory or host_memory()
    if needed + headroom > memory.available:
        raise PreflightError(
            f"{what} needs {needed / GIB:.1f} GiB plus {headroom / GIB:.1f} GiB headroom, but only "
            f"{memory.available / GIB:.1f} GiB is available ({memory.explain()}). Serve it "
            "memory-mapped instead (residency='mmap': page cache, reclaimable under pressure), "
            "open only this rank's rows (row_range), or free host memory."
        )
    return memory

"""Host-memory preflight: will a table fit, before we start copying or mapping it?

A resident table (or an mmapped table's hot tier) is anonymous memory. Copying 30 GiB and
failing at 25 is the worst outcome, so we refuse up front with the numbers. A memory-mapped
table costs page cache instead: it cannot fail to open, but when the cache cannot hold the
table, evicted rows are read from disk again on every lookup, so we warn.

Everything is read from a root directory (``/`` on a live host; a fixture tree in tests):

- ``proc/meminfo``: ``MemAvailable`` (what the kernel can hand out without swapping: free
  memory plus reclaimable page cache) and ``CommitLimit`` / ``Committed_AS``;
- ``proc/sys/vm/overcommit_memory``: under mode 2 (strict) an anonymous copy must also fit in
  ``CommitLimit - Committed_AS``; modes 0 and 1 do not limit what we allocate up front;
- ``proc/self/cgroup`` and ``sys/fs/cgroup``: the memory cgroup this process is in and every
  ancestor up to the mount's root, cgroup v2 (``memory.max``, ``memory.current``,
  ``memory.stat`` ``inactive_file``) or v1 (``memory/memory.limit_in_bytes``,
  ``memory.usage_in_bytes``, ``memory.stat`` ``total_inactive_file``). A level's room is its
  limit less its usage plus its reclaimable page cache (a cgroup's usage counts page cache,
  which the kernel drops under pressure); the tightest level binds. A server started in another
  cgroup (vLLM itself reads no cgroup limit) is checked against that cgroup's directory instead
  (:func:`named_cgroup_levels`: ``--memory-cgroup``).
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flashnext.errors import FlashnextError
from flashnext.host.mapping import cached_pages
from flashnext.host.pageout import PageOut, page_cache_pageout
from flashnext.placement import RESIDENCIES, Residency
from flashnext.sizes import size_text

GIB = 1024**3
#: What we leave free beyond the table: the worker's own allocations and the kernel's.
DEFAULT_HEADROOM = 2 * GIB
_UNLIMITED = 1 << 60
#: vm.overcommit_memory's strict mode: allocations beyond CommitLimit fail.
OVERCOMMIT_NEVER = 2


@dataclass(frozen=True)
class Fixes:
    """How a message names the ways out: the library's arguments, or the command line's flags
    (a CLI user cannot pass ``preflight=False``)."""

    mmap: str = "residency='mmap'"
    hot_tier: str = "a hot tier for the most-used rows (hot_tier)"
    row_range: str = "open only this rank's rows (row_range)"
    skip: str = " Pass preflight=False to open_table to skip the check."


#: The wording for callers of :func:`flashnext.host.open_table` (the default).
LIBRARY = Fixes()
#: The wording for ``flashnext ple preflight`` and other commands.
COMMAND_LINE = Fixes(
    mmap="--residency mmap",
    hot_tier="a hot tier for the most-used rows (--hot-tier N or a profile)",
    row_range="split the rows across tensor-parallel ranks (each rank maps only its own)",
    skip="",
)


class PreflightError(FlashnextError, MemoryError):
    """The host does not have the memory a resident table (or hot tier) needs."""


@dataclass(frozen=True)
class CgroupLevel:
    """One memory cgroup on the path from this process's cgroup to the root, in bytes."""

    path: str
    version: str  # "v1" | "v2"
    limit: int
    usage: int
    reclaimable: int  # inactive page cache the kernel can drop

    @property
    def available(self) -> int:
        return max(0, self.limit - self.usage + self.reclaimable)

    def explain(self) -> str:
        return (
            f"cgroup {self.version} {self.path} limit {_gib(self.limit)} less usage "
            f"{_gib(self.usage)} plus reclaimable page cache {_gib(self.reclaimable)} = "
            f"{_gib(self.available)}"
        )


@dataclass(frozen=True)
class HostMemory:
    """What this process may still allocate, in bytes, and where each number came from.

    ``cgroup`` is the binding level (the least room) of the memory cgroups that limit this
    process, ``None`` when none does; ``commit_limit`` / ``committed`` are ``CommitLimit`` /
    ``Committed_AS`` from meminfo; ``overcommit_mode`` is ``vm.overcommit_memory``;
    ``pageout`` the agents that page out page cache on their own (:mod:`flashnext.host.pageout`).
    """

    mem_available: int
    cgroup: CgroupLevel | None = None
    overcommit_mode: int | None = None
    commit_limit: int | None = None
    committed: int | None = None
    sources: tuple[str, ...] = field(default=(), compare=False)
    pageout: tuple[PageOut, ...] = field(default=(), compare=False)

    @property
    def cgroup_available(self) -> int | None:
        return None if self.cgroup is None else self.cgroup.available

    @property
    def commit_available(self) -> int | None:
        """Room left under the commit limit, when strict overcommit enforces it."""
        if self.overcommit_mode != OVERCOMMIT_NEVER or self.commit_limit is None:
            return None
        return max(0, self.commit_limit - (self.committed or 0))

    @property
    def page_cache_room(self) -> int:
        """Bytes of page cache a memory-mapped table can keep (no commit charge for file maps)."""
        cg = self.cgroup_available
        return self.mem_available if cg is None else min(self.mem_available, cg)

    @property
    def available(self) -> int:
        """Bytes of anonymous memory (a resident copy, a hot tier) that can still be allocated."""
        commit = self.commit_available
        room = self.page_cache_room
        return room if commit is None else min(room, commit)

    def explain(self, anonymous: bool = True) -> str:
        """One line: every number that went into :attr:`available` (or :attr:`page_cache_room`)."""
        parts = [f"MemAvailable {_gib(self.mem_available)}"]
        if self.cgroup is not None:
            parts.append(self.cgroup.explain())
        commit = self.commit_available
        if anonymous and commit is not None:
            parts.append(
                f"vm.overcommit_memory=2: CommitLimit {_gib(self.commit_limit or 0)} less "
                f"Committed_AS {_gib(self.committed or 0)} = {_gib(commit)}"
            )
        return "; ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready numbers (bytes) for a record."""
        cg = self.cgroup
        return {
            "mem_available": self.mem_available,
            "cgroup": None if cg is None else {**cg.__dict__, "available": cg.available},
            "overcommit_mode": self.overcommit_mode,
            "commit_limit": self.commit_limit,
            "committed": self.committed,
            "commit_available": self.commit_available,
            "available": self.available,
            "page_cache_room": self.page_cache_room,
            "pageout": [p.to_dict() for p in self.pageout],
        }


def _gib(n: int) -> str:
    return size_text(n)  # "3.1 KiB", never "0.0 GiB"


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


def _stat_values(path: Path) -> dict[str, int]:
    """``key value`` lines (memory.stat) and ``Key: value kB`` lines (meminfo), values as ints
    (meminfo's kB are converted to bytes)."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return {}
    values = {}
    for line in lines:
        parts = line.split()
        if len(parts) >= 2 and parts[1].isdigit():
            scale = 1024 if len(parts) >= 3 and parts[2] == "kB" else 1
            values[parts[0].rstrip(":")] = int(parts[1]) * scale
    return values


def _own_cgroups(proc_cgroup: Path) -> tuple[str | None, str | None]:
    """This process's (v1 memory, v2) cgroup paths from /proc/self/cgroup."""
    rel_v1: str | None = None
    rel_v2: str | None = None
    try:
        for line in proc_cgroup.read_text().splitlines():
            hid, controllers, rel = line.split(":", 2)
            if hid == "0" and controllers == "":
                rel_v2 = rel
            elif "memory" in controllers.split(","):
                rel_v1 = rel
    except (OSError, ValueError):
        pass
    return rel_v1, rel_v2


def _level(directory: Path, version: str, mount: Path) -> CgroupLevel | None:
    if version == "v2":
        limit = _read_int(directory / "memory.max")
        usage = _read_int(directory / "memory.current")
        stat = _stat_values(directory / "memory.stat")
        reclaim = stat.get("inactive_file", 0)
    else:
        limit = _read_int(directory / "memory.limit_in_bytes")
        usage = _read_int(directory / "memory.usage_in_bytes")
        stat = _stat_values(directory / "memory.stat")
        reclaim = stat.get("total_inactive_file", stat.get("inactive_file", 0))
    if limit is None or usage is None or limit >= _UNLIMITED // 2:  # "max"; v1's ~2**63
        return None
    rel = directory.relative_to(mount).as_posix()
    return CgroupLevel("/" + rel if rel != "." else "/", version, limit, usage, reclaim)


def _cgroup_levels(root: Path) -> list[CgroupLevel]:
    """Every limiting memory cgroup from this process's own up to the mount's root."""
    rel_v1, rel_v2 = _own_cgroups(root / "proc/self/cgroup")
    sys_cgroup = root / "sys/fs/cgroup"
    mounts = [("v1", sys_cgroup / "memory", rel_v1)]
    mounts += [("v2", sys_cgroup, rel_v2), ("v2", sys_cgroup / "unified", rel_v2)]
    for version, mount, own in mounts:
        if own is None or not mount.is_dir():
            continue
        start = mount / own.lstrip("/")
        # Inside a container the mount usually shows the process's own cgroup as the root.
        directory = start if start.is_dir() else mount
        levels = []
        while True:
            level = _level(directory, version, mount)
            if level is not None:
                levels.append(level)
            if directory == mount:
                break
            directory = directory.parent
        if levels:  # the memory controller lives in one hierarchy only
            return levels
    return []


def named_cgroup_levels(directory: Path) -> list[CgroupLevel]:
    """The limiting levels of the memory cgroup ``directory`` (v2 when it has ``memory.max``,
    v1 when it has ``memory.limit_in_bytes``) and of its ancestors that are cgroups too.

    Raises:
        PreflightError: ``directory`` is not a memory cgroup.
    """
    version = "v2" if (directory / "memory.max").exists() else "v1"
    limit_file = "memory.max" if version == "v2" else "memory.limit_in_bytes"
    if not (directory / limit_file).exists():
        raise PreflightError(
            f"--memory-cgroup {directory}: not a memory cgroup (expected memory.max, v2, or "
            "memory.limit_in_bytes, v1)"
        )
    levels, level_dir = [], directory.resolve()
    # up to the hierarchy's root: the last directory with the limit file (v2's root has none)
    while (level_dir / limit_file).exists():
        level = _level(level_dir, version, Path(level_dir.anchor))
        if level is not None:
            levels.append(level)
        if level_dir.parent == level_dir:
            break
        level_dir = level_dir.parent
    return levels


def host_memory(
    root: str | Path = "/", fixes: Fixes = LIBRARY, cgroup: Path | None = None
) -> HostMemory:
    """Read the memory this process may still allocate from the tree at ``root``; with
    ``cgroup`` (a memory cgroup's directory), what a process started in that cgroup may.

    Raises:
        PreflightError: ``proc/meminfo`` cannot be read or has no MemAvailable line, or
            ``cgroup`` is not a memory cgroup.
    """
    base = Path(root)
    meminfo_path = base / "proc/meminfo"
    meminfo = _stat_values(meminfo_path)
    if "MemAvailable" not in meminfo:
        raise PreflightError(
            f"{meminfo_path}: no MemAvailable line (Linux >= 3.14 has one); cannot check host "
            f"memory.{fixes.skip}"
        )
    levels = _cgroup_levels(base) if cgroup is None else named_cgroup_levels(cgroup)
    return HostMemory(
        mem_available=meminfo["MemAvailable"],
        cgroup=min(levels, key=lambda lv: lv.available) if levels else None,
        overcommit_mode=_read_int(base / "proc/sys/vm/overcommit_memory"),
        commit_limit=meminfo.get("CommitLimit"),
        committed=meminfo.get("Committed_AS"),
        sources=tuple(lv.path for lv in levels),
        pageout=page_cache_pageout(base),
    )


def check_fits(
    needed: int,
    what: str,
    headroom: int = DEFAULT_HEADROOM,
    memory: HostMemory | None = None,
) -> HostMemory:
    """Raise :class:`PreflightError` unless ``needed`` bytes of anonymous memory plus
    ``headroom`` are available.

    ``what`` names the allocation in the message, e.g. "a resident copy of /ples_int4 (int4)".
    Returns the :class:`HostMemory` reading that was checked.
    """
    memory = memory or host_memory()
    refusal = _refusal(needed, what, headroom, memory, LIBRARY)
    if refusal:
        raise PreflightError(refusal)
    return memory


def _refusal(needed: int, what: str, headroom: int, memory: HostMemory, fixes: Fixes) -> str | None:
    if needed + headroom <= memory.available:
        return None
    return (
        f"{what} needs {_gib(needed)} plus {_gib(headroom)} headroom, but only "
        f"{_gib(memory.available)} is available ({memory.explain()}). Serve it "
        f"memory-mapped instead ({fixes.mmap}: page cache, reclaimable under pressure), "
        f"{fixes.row_range}, or free host memory."
    )


@dataclass(frozen=True)
class Preflight:
    """The verdict on serving a table of ``table_bytes`` with ``residency`` on this host.

    ``anonymous_bytes`` is what the process copies (the table when resident, the hot tier when
    mmapped); ``page_cache_bytes`` what the kernel caches for it (the table when mmapped).
    ``refusals`` (the table cannot be opened) and ``warnings`` (it can, but will be slow) are
    one line each.
    """

    what: str
    residency: Residency
    table_bytes: int
    hot_bytes: int
    headroom: int
    memory: HostMemory
    refusals: tuple[str, ...]
    warnings: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.refusals

    @property
    def anonymous_bytes(self) -> int:
        return self.table_bytes if self.residency == "resident" else self.hot_bytes

    @property
    def page_cache_bytes(self) -> int:
        return 0 if self.residency == "resident" else self.table_bytes

    def to_dict(self) -> dict[str, Any]:
        """The ``ple preflight --json`` payload."""
        return {
            "what": self.what,
            "residency": self.residency,
            "ok": self.ok,
            "table_bytes": self.table_bytes,
            "hot_bytes": self.hot_bytes,
            "anonymous_bytes": self.anonymous_bytes,
            "page_cache_bytes": self.page_cache_bytes,
            "headroom": self.headroom,
            "refusals": list(self.refusals),
            "warnings": list(self.warnings),
            "memory": self.memory.to_dict(),
        }


def preflight_table(
    table_bytes: int,
    residency: Residency,
    what: str,
    *,
    hot_bytes: int = 0,
    memory: HostMemory | None = None,
    headroom: int = DEFAULT_HEADROOM,
    fixes: Fixes = LIBRARY,
) -> Preflight:
    """Check a table of ``table_bytes`` served with ``residency`` against host memory.

    Resident: the whole table is anonymous memory and must fit (MemAvailable, the cgroup's
    room, the commit limit under strict overcommit), else a refusal. Memory-mapped: the hot
    tier (``hot_bytes``) is anonymous and must fit the same way; the table itself is page
    cache, and when it will not stay cached (MemAvailable or the cgroup's room, less the hot
    tier and headroom, is smaller than the table) that is a warning, not a refusal.
    ``fixes`` words the way out in the messages (:data:`LIBRARY` or :data:`COMMAND_LINE`).

    Raises:
        ValueError: ``residency`` is neither "mmap" nor "resident", or ``hot_bytes`` is given
            for a resident table.
    """
    if residency not in RESIDENCIES:
        raise ValueError(f"residency must be 'mmap' or 'resident', found {residency!r}")
    if residency == "resident" and hot_bytes:
        raise ValueError("a hot tier applies to residency='mmap'; a resident table holds every row")
    memory = memory or host_memory()
    refusals: list[str] = []
    warnings: list[str] = []
    anonymous = table_bytes if residency == "resident" else hot_bytes
    if anonymous:
        name = (
            f"a resident copy of {what}" if residency == "resident" else f"the hot tier of {what}"
        )
        refusal = _refusal(anonymous, name, headroom, memory, fixes)
        if refusal:
            refusals.append(refusal)
    if residency == "mmap":
        room = memory.page_cache_room - hot_bytes - headroom
        if table_bytes > room:
            warnings.append(
                f"{what} is {_gib(table_bytes)} but the page cache can keep only {_gib(max(room, 0))} "
                f"of it ({memory.explain(anonymous=False)}; less {_gib(hot_bytes)} hot tier and "
                f"{_gib(headroom)} headroom): rows evicted under pressure are read from disk again "
                f"on lookup. Use a smaller format, {fixes.hot_tier}, {fixes.row_range}, or raise "
                "the memory limit."
            )
        warnings += [pageout_warning(p, what) for p in memory.pageout]
    return Preflight(
        what, residency, table_bytes, hot_bytes, headroom, memory, tuple(refusals), tuple(warnings)
    )


def pageout_warning(agent: PageOut, what: str) -> str:
    """One line: what ``agent`` does to the page cache of the memory-mapped table ``what``."""
    age = f"{agent.min_age_s:.0f} s"
    if agent.unmapped_only:
        return (
            f"{agent.describe()}: warm {what} (flashnext ple warm) less than {age} before its "
            "server maps it, or the first lookups read it from disk again; pages a server maps "
            "are spared (the staged placement maps every page at start)."
        )
    return (
        f"{agent.describe()}: rows of {what} that no lookup reads for {age} are read from disk "
        "again when next looked up; exclude the table from the scheme or raise its minimum age."
    )


def page_cache_bytes(path: str | os.PathLike[str]) -> int:
    """Bytes of the file ``path`` now in the page cache (``mincore`` on a fresh read-only map).

    Raises:
        OSError: the file cannot be opened or mapped, or ``mincore`` fails.
    """
    size = os.path.getsize(path)
    if size == 0:
        return 0
    with open(path, "rb") as fh:
        view = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        pages = cached_pages(view)
    finally:
        view.close()
    if pages is None:
        raise OSError(f"mincore of {path} failed or is not available here")
    return min(size, int(pages.sum()) * mmap.PAGESIZE)

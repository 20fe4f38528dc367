"""A memory cgroup owned by a test: create, limit, run a process group in it, read, kill, remove.

v1 or v2, whichever the host offers (v1's memory hierarchy first: a hybrid host, like this one,
mounts v2 without the memory controller at ``sys/fs/cgroup/unified``). Needs root.

====================  ==========================  ===========================
                      v1 (``memory/NAME``)        v2 (``NAME``)
====================  ==========================  ===========================
limit                 ``memory.limit_in_bytes``   ``memory.max``
usage                 ``memory.usage_in_bytes``   ``memory.current``
peak                  ``memory.max_usage_in_bytes``  ``memory.peak`` (Linux 5.19)
OOM kills             ``memory.oom_control`` ``oom_kill``  ``memory.events`` ``oom_kill``
====================  ==========================  ===========================

A process enters the group by writing its own pid to ``cgroup.procs`` before it execs
(:meth:`MemoryCgroup.wrap`), so every process it forks is charged from the first byte.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")


class CgroupError(RuntimeError):
    """The host offers no writable memory cgroup, or one could not be set up or removed."""


def _keyed(path: Path) -> dict[str, int]:
    """``key value`` lines (memory.events, memory.oom_control, memory.stat) as ints."""
    out = {}
    for line in path.read_text().splitlines():
        key, _, value = line.partition(" ")
        if value.strip().isdigit():
            out[key] = int(value)
    return out


def memory_hierarchy(root: Path = ROOT) -> tuple[str, Path]:
    """("v1" | "v2", the directory new memory cgroups are made in) for the host at ``root``.

    Raises:
        CgroupError: neither a v1 memory hierarchy nor a v2 one with the memory controller.
    """
    if (root / "memory" / "memory.limit_in_bytes").exists():
        return "v1", root / "memory"
    controllers = root / "cgroup.controllers"
    if controllers.exists() and "memory" in controllers.read_text().split():
        return "v2", root
    raise CgroupError(
        f"{root}: no memory cgroup hierarchy (neither memory/memory.limit_in_bytes, v1, nor "
        "'memory' in cgroup.controllers, v2)"
    )


class MemoryCgroup:
    """One memory cgroup ``NAME`` with a limit (None: none, only the accounting), for the
    life of a ``with`` block.

    ``with MemoryCgroup("x", 1 << 30) as cg:`` makes the group (v2: with the memory controller
    enabled in the root's ``cgroup.subtree_control``) and sets the limit; leaving the block
    SIGKILLs whatever is still in it and removes it.
    """

    def __init__(self, name: str, limit: int | None, root: Path = ROOT) -> None:
        self.version, parent = memory_hierarchy(root)
        self.path = parent / name
        self.limit = limit

    def __enter__(self) -> MemoryCgroup:
        self.create()
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def _file(self, v1: str, v2: str) -> Path:
        return self.path / (v1 if self.version == "v1" else v2)

    def create(self) -> None:
        """Make the group (a stale one of the same name, left by a killed run, is removed
        first) and write its limit."""
        if self.path.exists():
            self.remove()
        if self.version == "v2":
            control = self.path.parent / "cgroup.subtree_control"
            if "memory" not in control.read_text().split():
                control.write_text("+memory")
        self.path.mkdir()
        if self.limit is not None:
            self._file("memory.limit_in_bytes", "memory.max").write_text(str(self.limit))
        if self.version == "v2":
            # no swap here, and none may hide an overrun where there is
            swap = self.path / "memory.swap.max"
            if swap.exists():
                swap.write_text("0")

    def wrap(self) -> list[str]:
        """A command prefix that moves the process into the group, then execs the command."""
        procs = self.path / "cgroup.procs"
        return ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', str(procs)]

    def pids(self) -> list[int]:
        """The processes now in the group."""
        try:
            text = (self.path / "cgroup.procs").read_text()
        except FileNotFoundError:
            return []
        return [int(p) for p in text.split()]

    def usage(self) -> int:
        """Bytes charged now (anonymous memory and page cache)."""
        return int(self._file("memory.usage_in_bytes", "memory.current").read_text())

    def peak(self) -> int | None:
        """The most bytes ever charged; None on a v2 kernel before 5.19 (no memory.peak)."""
        path = self._file("memory.max_usage_in_bytes", "memory.peak")
        return int(path.read_text()) if path.exists() else None

    def oom_kills(self) -> int:
        """How many processes the kernel's OOM killer ended in this group."""
        events = _keyed(self._file("memory.oom_control", "memory.events"))
        return events.get("oom_kill", 0)

    def kill(self, timeout_s: float = 10.0) -> None:
        """SIGKILL every process in the group and wait until it is empty."""
        end = time.monotonic() + timeout_s
        while (pids := self.pids()) and time.monotonic() < end:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.1)
        if self.pids():
            raise CgroupError(f"{self.path}: processes {self.pids()} survive SIGKILL")

    def remove(self) -> None:
        """:meth:`kill`, then rmdir (retried: an exiting process leaves the group late)."""
        if not self.path.exists():
            return
        self.kill()
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)
        raise CgroupError(f"{self.path}: cannot be removed")


def process_memory(pid: int) -> dict[str, int | str]:
    """``comm``, ``rss`` and ``pss`` (bytes, from ``/proc/PID/smaps_rollup``) of a live process."""
    proc = Path(f"/proc/{pid}")
    out: dict[str, int | str] = {"pid": pid, "comm": (proc / "comm").read_text().strip()}
    for line in (proc / "smaps_rollup").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("Rss", "Pss"):
            out[key.lower()] = int(rest.split()[0]) * 1024
    return out

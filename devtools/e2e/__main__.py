"""``python -m devtools.e2e serve DIR [--format F]``: the README's end-to-end demo.

Builds (into DIR, cached) the e2e runtime, the tiny Qwen4Exp and a sidecar of its own table
(``flashnext ple quantize ... --format F --layer 0``, bf16 by default), then serves the model twice
on 127.0.0.1: stock vLLM (plugin off) on --port, and with ``FLASHNEXT_PLE_SIDECAR`` on --port + 1.
Prints both URLs on stdout once healthy and serves until Ctrl-C (or SIGTERM), then stops both.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time
from pathlib import Path

from devtools.e2e.runtime import ensure_e2e_runtime
from devtools.e2e.servers import e2e_server
from devtools.vllm_cpu import start_all


def main(argv: list[str] | None = None) -> int:
    """Run the demo; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m devtools.e2e")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve the tiny Qwen4Exp with and without the plugin")
    serve.add_argument("dir", type=Path)
    serve.add_argument("--format", default="bf16", choices=["bf16", "fp8", "int4", "nvfp4"])
    serve.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)
    rt = ensure_e2e_runtime()
    model = args.dir / "tiny-qwen4exp"
    if not (model / "config.json").exists():
        rt.build_tiny_qwen4exp(model)
    sidecar = args.dir / f"sidecar-{args.format}"
    if not (sidecar / "META.json").exists():
        subprocess.run(
            [sys.executable, "-m", "flashnext", "ple", "quantize", str(model), str(sidecar),
             "--format", args.format, "--layer", "0"],
            check=True,
        )  # fmt: skip
    off = e2e_server(rt, model, args.dir / "logs-off")
    on = e2e_server(
        rt, model, args.dir / "logs-plugin", plugin=True,
        env={"FLASHNEXT_PLE_SIDECAR": str(sidecar)},
    )  # fmt: skip
    off.port, on.port = args.port, args.port + 1
    # SIGTERM as Ctrl-C: the servers run in sessions of their own and would outlive this one
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        start_all([off, on])
        print(f"plugin off: {off.url}\nplugin on:  {on.url} ({sidecar})", flush=True)
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        return 0
    finally:
        off.stop()
        on.stop()


if __name__ == "__main__":
    sys.exit(main())

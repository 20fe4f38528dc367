"""Shared fixtures: one printed seed for every random generator, real inputs for every command.

Seeds (see seeding.py): ``FLASHNEXT_TEST_SEED=N`` repeats a run; without it a fresh seed is drawn
per run. The seed is printed in the report header and with every failure, and is Hypothesis's
seed unless ``--hypothesis-seed`` is given. Each test's ``rng`` is seeded from (seed, test id),
so a test draws the same numbers whichever tests run before it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from .seeding import SEED, SEED_ENV, seeded_rng


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    # Hypothesis's plugin reads its seed option in its own pytest_configure, after this one.
    if config.getoption("hypothesis_seed", None) is None:
        config.option.hypothesis_seed = str(SEED)


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
    from .cli_inputs import build_inputs

    return build_inputs(tmp_path_factory.mktemp("cli-inputs"), seeded_rng("cli_inputs"))


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """``flashnext demo --base 2000 --out DIR --json`` run once: (DIR, stdout)."""
    from .cli_inputs import run_subprocess

    out = tmp_path_factory.mktemp("demo") / "demo"
    code, stdout, stderr = run_subprocess(["demo", "--base", "2000", "--out", out, "--json"])
    assert code == 0, stderr
    return out, stdout

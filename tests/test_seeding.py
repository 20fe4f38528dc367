"""Every random generator in tests/ is seeded from the run's one printed seed (see seeding.py).

The tree walk fails on an unseeded generator: ``default_rng()`` or ``SeedSequence()`` without a
seed, numpy's global-state functions (``np.random.rand(...)``), the ``random`` module's
functions (``random.random()``; ``random.Random(seed)`` is fine), ``secrets`` / ``os.urandom``
outside seeding.py, and torch's random constructors without ``generator=`` in a module that
never calls ``torch.manual_seed``.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .seeding import SEED, SEED_ENV, current_test_rng, seeded_rng

TESTS = Path(__file__).parent
SEED_SOURCE = TESTS / "seeding.py"  # the one place that draws the run's seed from the OS
NUMPY_SEEDED_TYPES = {
    "Generator",
    "SeedSequence",
    "PCG64",
    "PCG64DXSM",
    "Philox",
    "SFC64",
    "MT19937",
}
TORCH_RANDOM = {"rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like",
                "normal", "bernoulli", "multinomial", "poisson"}  # fmt: skip


def _dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def _why_unseeded(call: ast.Call, name: str, torch_seeded: bool) -> str | None:
    """Why ``call`` (to the dotted ``name``) draws from an unseeded source, or None."""
    parts = name.split(".")
    bare = not call.args and not call.keywords
    if parts[-1] in ("default_rng", "SeedSequence") and bare:
        return f"{name}() without a seed"
    numpy_global = parts[0] in ("np", "numpy") and parts[1:2] == ["random"] and len(parts) == 3
    if numpy_global and parts[2] not in NUMPY_SEEDED_TYPES | {"default_rng"}:
        return f"{name}(): numpy's global, unseeded generator"
    if parts[0] == "random" and len(parts) == 2 and (parts[1] != "Random" or bare):
        return f"{name}(): the random module's unseeded generator"
    if parts[0] == "secrets" or name == "os.urandom":
        return f"{name}(): OS entropy"
    torch_random = parts[0] == "torch" and len(parts) == 2 and parts[1] in TORCH_RANDOM
    has_generator = any(k.arg == "generator" for k in call.keywords)
    if torch_random and not torch_seeded and not has_generator:
        return f"{name}() without generator= or torch.manual_seed"
    return None


def unseeded_calls(source: str, filename: str = "<test>") -> list[str]:
    """``file:line: why`` for every unseeded random draw in ``source``."""
    tree = ast.parse(source, filename)
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
    torch_seeded = any(_dotted(c.func) == "torch.manual_seed" for c in calls)
    found = []
    for call in calls:
        why = _why_unseeded(call, _dotted(call.func), torch_seeded)
        if why:
            found.append(f"{filename}:{call.lineno}: {why}")
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in ("random", "numpy.random"):
            names = {a.name for a in node.names} - NUMPY_SEEDED_TYPES - {"Random"}
            if names:
                found.append(f"{filename}:{node.lineno}: from {node.module} import {names}")
    return found


def test_no_unseeded_generator_in_tests() -> None:
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        if path == SEED_SOURCE:
            continue
        found += unseeded_calls(path.read_text(), str(path.relative_to(TESTS.parent)))
    assert not found, (
        "unseeded random generators (use the `rng` fixture, seeding.seeded_rng or "
        "seeding.current_test_rng):\n" + "\n".join(found)
    )


@pytest.mark.parametrize(
    "line",
    [
        "x = np.random.default_rng()",
        "x = numpy.random.default_rng().random(3)",
        "x = np.random.rand(3)",
        "np.random.seed(1)",
        "s = np.random.SeedSequence().entropy",
        "x = random.random()",
        "x = random.randrange(10)",
        "r = random.Random()",
        "r = random.SystemRandom()",
        "from random import randint",
        "from numpy.random import default_rng, rand",
        "k = secrets.randbits(8)",
        "b = os.urandom(4)",
        "t = torch.randn(3)",
    ],
)
def test_the_walk_flags_each_unseeded_form(line: str) -> None:
    assert unseeded_calls(line), line


@pytest.mark.parametrize(
    "source",
    [
        "x = np.random.default_rng(seed)",
        "x = np.random.default_rng([1, 2])",
        "g: np.random.Generator = rng",
        "r = random.Random(seed)",
        "t = torch.randn(3, generator=g)",
        "torch.manual_seed(0)\nt = torch.randn(3)",
        "x = rng.random(3)",
    ],
)
def test_the_walk_passes_seeded_forms(source: str) -> None:
    assert unseeded_calls(source) == []


def test_generators_follow_the_run_seed() -> None:
    a, b = seeded_rng("k"), seeded_rng("k")
    assert a.integers(2**63) == b.integers(2**63)
    assert seeded_rng("k").integers(2**63) != seeded_rng("other").integers(2**63)
    # The n-th call of one label in one test repeats; successive calls differ.
    first, second = current_test_rng("label"), current_test_rng("label")
    assert first.integers(2**63) != second.integers(2**63)
    assert isinstance(SEED, int)


def test_the_env_seed_repeats_draws_across_processes() -> None:
    code = "from tests.seeding import seeded_rng; print(seeded_rng('k').integers(2**63))"
    env = {**os.environ, SEED_ENV: "12345"}
    argv = [sys.executable, "-c", code]
    runs = [
        subprocess.run(argv, env=env, capture_output=True, text=True, check=True, cwd=TESTS.parent)
        for _ in range(2)
    ]
    assert runs[0].stdout == runs[1].stdout and runs[0].stdout.strip().isdigit()

"""Each e2e shim is needed and right: with it the behaviour matches torch/numpy, without it the
upstream bug shows (devtools/e2e/shims; a child process in the e2e runtime, shims on and off)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from devtools.e2e.runtime import E2eRuntime

from ..seeding import seeded_rng

CHILD = Path(__file__).parent / "shim_child.py"


def _child(rt: E2eRuntime, seed: int, off: str = "") -> dict:
    env = {**os.environ, **rt.env(), "FLASHNEXT_E2E_SHIMS_OFF": off}
    run = subprocess.run(
        [str(rt.python), str(CHILD), str(seed)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def rng_seed(request: pytest.FixtureRequest) -> int:
    """One seed for the module's children, so the shimmed run is made once and compared."""
    return int(seeded_rng(request.node.nodeid, request.fixturename).integers(0, 2**31))


@pytest.fixture(scope="module")
def with_every_shim(e2e_runtime: E2eRuntime, rng_seed: int) -> dict:
    """The child's report with every shim on (what every e2e server runs)."""
    return _child(e2e_runtime, rng_seed)


def test_with_the_shims_everything_matches_torch_and_numpy(with_every_shim: dict) -> None:
    got = with_every_shim
    assert got["torchvision"] == "imported"
    assert got["bf16_equal_to_torch"] == [True, True, True, True]
    assert got["mask_equal_to_numpy"] is True
    assert got["cpu_backend"] is True


def test_without_the_interpreter_fix_bf16_math_and_scalar_masks_break(
    e2e_runtime: E2eRuntime, rng_seed: int
) -> None:
    got = _child(e2e_runtime, rng_seed, off="triton_interpreter")
    # bf16 adds the raw bit patterns: silently wrong values (compares of the bits too)
    assert got["bf16_equal_to_torch"] != [True, True, True, True], got
    assert "mask has unsupported dtype" in str(got["mask_equal_to_numpy"]), got


def test_skipping_the_repatching_changes_no_bit(
    e2e_runtime: E2eRuntime, rng_seed: int, with_every_shim: dict
) -> None:
    fast = with_every_shim
    slow = _child(e2e_runtime, rng_seed, off="triton_repatch")
    assert isinstance(fast["nested_bits"], list) and len(fast["nested_bits"]) == 8, fast
    assert fast["nested_bits"] == slow["nested_bits"]
    assert fast["bf16_equal_to_torch"] == slow["bf16_equal_to_torch"] == [True] * 4


def test_the_fast_paths_change_no_bit(
    e2e_runtime: E2eRuntime, rng_seed: int, with_every_shim: dict
) -> None:
    """bf16 <-> fp32 casts (random and special values, subnormals included), int32 arithmetic
    that overflows, a tiled norm of broadcasts and reductions (the types built once), and every
    other case: the same bits without ``triton_fast_paths``."""
    fast = with_every_shim
    slow = _child(e2e_runtime, rng_seed, off="triton_fast_paths")
    assert isinstance(fast["cast_bits"], list) and len(fast["cast_bits"][0]) == 256, fast
    wrapped, reference = fast["int_wrap"]  # int32 wraps as on a GPU: no overflow error
    assert wrapped == reference
    bits, error = fast["tile_norm"]  # types built once: broadcasts and reductions as before
    assert len(bits) == 3 * 64 and error < 1e-4, fast["tile_norm"]
    assert fast == slow


def test_without_the_torchvision_shim_the_cuda_build_does_not_import(
    e2e_runtime: E2eRuntime, rng_seed: int
) -> None:
    got = _child(e2e_runtime, rng_seed, off="torchvision_registrations")
    assert "operator torchvision::nms does not exist" in got["torchvision"], got


def test_without_the_shim_directory_triton_has_no_cpu_backend(e2e_runtime: E2eRuntime) -> None:
    env = {**os.environ, "PYTHONPATH": str(e2e_runtime.overlay)}
    code = "from triton.backends import backends; print(sorted(backends))"
    run = subprocess.run(
        [str(e2e_runtime.python), "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "'cpu'" not in run.stdout and "nvidia" in run.stdout

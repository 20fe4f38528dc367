"""The staged step context has one declaration (``kernels/_layout.StepContext``): the filler
(``HostStager._build_context``) names every field by keyword and the kernel (``stage_step``)
reads every field through ``AT``; a field on one side only fails here. Also the one
``slot_offsets`` and the one ``rows_that_fit``, against plain references."""

import ast
import inspect
import textwrap

import numpy as np
import pytest

from flashnext.errors import KernelError
from flashnext.kernels import _layout, stager
from flashnext.kernels._layout import AT, LAYOUT_ID, StepContext, rows_that_fit, slot_offsets


def one_sided(declared: tuple[str, ...], filler: str, kernel: str) -> list[str]:
    """What breaks the one-declaration rule, as lines: a declared field the filler's
    ``StepContext(...)`` call does not name, one it names that is not declared, a declared
    field the kernel never reads as ``AT.<name>``, one it reads that is not declared."""
    calls = [n for n in ast.walk(ast.parse(textwrap.dedent(filler)))
             if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "StepContext"]  # fmt: skip
    assert len(calls) == 1, "the filler builds one StepContext"
    written = {k.arg for k in calls[0].keywords}
    read = {n.attr for n in ast.walk(ast.parse(textwrap.dedent(kernel)))
            if isinstance(n, ast.Attribute) and getattr(n.value, "id", None) == "AT"}  # fmt: skip
    want = set(declared)
    return ([f"not filled: {f}" for f in sorted(want - written)]
            + [f"filled, not declared: {f}" for f in sorted(written - want)]
            + [f"not read by the kernel: {f}" for f in sorted(want - read)]
            + [f"read, not declared: {f}" for f in sorted(read - want)])  # fmt: skip


def _sides() -> tuple[str, str]:
    filler = inspect.getsource(stager.HostStager._build_context)
    kernel = "".join(inspect.getsource(f.py_func) for f in (
        stager.stage_step, stager.stage_cached, stager.stage_sorted, stager._slot_of,
        stager._gather_step))  # fmt: skip
    return filler, kernel


def test_every_context_field_is_filled_and_read() -> None:
    filler, kernel = _sides()
    assert one_sided(StepContext._fields, filler, kernel) == []
    assert list(AT) == list(range(len(StepContext._fields)))


def test_a_field_on_one_side_only_is_caught() -> None:
    """The check above fails for a field added to the declaration only, or read or filled
    without being declared (the sources edited as a change would edit them)."""
    filler, kernel = _sides()
    declared = StepContext._fields
    assert one_sided((*declared, "extra"), filler, kernel) == [
        "not filled: extra", "not read by the kernel: extra"]  # fmt: skip
    more_filled = filler.replace("lo=self.row_range[0],", "lo=self.row_range[0], extra=1,")
    assert one_sided((*declared, "extra"), more_filled, kernel) == ["not read by the kernel: extra"]
    more_read = kernel.replace("ctx[AT.lo]", "ctx[AT.lo] + ctx[AT.extra]", 1)
    assert one_sided((*declared, "extra"), filler, more_read) == ["not filled: extra"]
    assert one_sided(declared, filler, more_read) == ["read, not declared: extra"]


def test_a_reordered_declaration_is_a_new_layout() -> None:
    """The kernel refuses a context whose first word is another declaration's fingerprint
    (what a numba cache compiled before a reorder would see), and the stager recompiles it."""
    ctx = np.zeros(len(StepContext._fields), np.int64)
    ctx[AT.layout_id] = LAYOUT_ID ^ 1
    assert stager.stage_step(np.zeros(3, np.int64), ctx) == _layout.STALE_LAYOUT
    with pytest.raises(KernelError, match="even after recompiling"):
        stager._restaged(np.zeros(3, np.int64), ctx)


@pytest.mark.parametrize("has_scale_2", [0, 8])
def test_slot_offsets_python_and_numba_agree(has_scale_2: int, rng: np.random.Generator) -> None:
    for n in [0, 1, 3, 4, 5, *rng.integers(0, 1 << 21, 50).tolist()]:
        s2_at = -(-4 * n // 16) * 16
        rec_at = -(-(s2_at + (4 * n if has_scale_2 else 0)) // 16) * 16
        assert slot_offsets(n, has_scale_2) == (s2_at, rec_at)
        assert stager._slot_offsets(n, has_scale_2) == (s2_at, rec_at)


def test_rows_that_fit_keeps_first_places_inside_the_range(rng: np.random.Generator) -> None:
    lo, hi, record_bytes = 100, 900, 48
    for _ in range(20):
        ids = rng.integers(-5, 1000, int(rng.integers(0, 3000))).astype(np.int64)
        cache_bytes = int(rng.integers(-10, 700)) * record_bytes + int(rng.integers(0, 48))
        want, seen = [], set()
        for i, r in enumerate(ids.tolist()):
            if lo <= r < hi and r not in seen:
                seen.add(r)
                want.append(i)
        want = want[: max(0, cache_bytes) // record_bytes]
        got = rows_that_fit(ids, (lo, hi), cache_bytes, record_bytes)
        assert got.dtype == np.int64 and got.tolist() == want

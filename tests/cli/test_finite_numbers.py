"""Rule (issue 42): every float flag of every command refuses nan and inf, through one type
(``FiniteRange``): ``nan`` passes every bound check, so a timeout of nan waited forever and a
threshold of nan failed everything. Found by walking the click tree, not listed by hand."""

from __future__ import annotations

import click
import pytest

from flashnext.cli._common import FiniteRange

from .inputs import leaf_commands
from .runner import run_in_process


def _float_options() -> list[tuple[str, click.Option]]:
    return [
        (name, p)
        for name, cmd in sorted(leaf_commands().items())
        for p in cmd.params
        if isinstance(p, click.Option) and isinstance(p.type, click.types.FloatParamType)
    ]


def test_every_float_flag_is_finite():
    found = _float_options()
    # the three, at least: a walk that finds nothing would prove nothing
    names = {(cmd, p.opts[0]) for cmd, p in found}
    assert {("validate", "--ready-timeout"), ("ple quantize", "--max-row-error"),
            ("validate ab", "--min-top1")} <= names, names  # fmt: skip
    plain = [(cmd, p.opts[0]) for cmd, p in found if not isinstance(p.type, FiniteRange)]
    assert not plain, f"float flags read without FiniteRange: {plain}"


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "NaN", "1e400"])
def test_nan_and_inf_are_usage_errors(capsys, value):
    for cmd, option in _float_options():
        flag = option.opts[0]
        code, out, err = run_in_process([*cmd.split(), f"{flag}={value}"], capsys)
        last = err.strip().splitlines()[-1] if err.strip() else ""
        assert code == 2 and out == "", (cmd, flag, code, out, err)
        assert flag in last and "not a finite number" in last, (cmd, flag, err)

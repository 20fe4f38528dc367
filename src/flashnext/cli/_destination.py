"""Every writing command's destination check, as a click usage error (exit 2, before work).

The rule itself is :func:`flashnext.store.destination.destination_problem`; this only turns its
answer into the one ``error:`` line naming the flag.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import click

from flashnext.cli._common import output_dir_problem

if TYPE_CHECKING:
    from flashnext.store.destination import Expect


def check_output(
    dst: str | os.PathLike[str] | None,
    inputs: Iterable[str | os.PathLike[str] | None] = (),
    *,
    hint: str,
    expect: Expect = "dir",
    owns: Callable[[Path], bool] | None = None,
    writes: Iterable[str] = (),
    holds: Callable[[Path], bool] | None = None,
) -> None:
    """Refuse ``dst`` (given with flag ``hint``) when the destination rule does; None passes.

    Raises:
        click.BadParameter: what is wrong with ``dst``, naming it.
    """
    if dst is None:
        return
    # Here, not at the top: validate and record load no numpy until they write something.
    from flashnext.store.destination import destination_problem

    given = [p for p in inputs if p is not None]
    problem = destination_problem(
        dst, given, expect=expect, owns=owns, writes=writes, holds=holds
    )
    if not problem:  # where it will be created: the nearest existing directory is writable
        path = Path(os.fsdecode(dst))
        problem = output_dir_problem(path if expect == "dir" else path.parent)
    if problem:
        raise click.BadParameter(problem, param_hint=hint)

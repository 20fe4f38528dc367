"""Byte sizes for the planner's flags; the parsing itself is :mod:`flashnext.sizes`'."""

from __future__ import annotations

from flashnext.plan.model import PlanError
from flashnext.sizes import SIZE_HINT, byte_count, gib

__all__ = ["gib", "parse_size"]


def parse_size(text: str, what: str = "size") -> int:
    """Bytes in ``text``: decimal units (kB, MB, GB, TB) or binary ones (KiB, MiB, GiB, TiB).

    Raises:
        PlanError: not a number followed by a known unit (names ``what`` in the message).
    """
    n = byte_count(text)
    if n is None:
        raise PlanError(f"{what} {text!r}: expected {SIZE_HINT}")
    return n

"""Byte sizes for the planner's flags; the parsing itself is :mod:`flashnext.sizes`'."""

from __future__ import annotations

from flashnext.plan.model import PlanError
from flashnext.sizes import SizeError, byte_count, gib

__all__ = ["gib", "parse_size"]


def parse_size(text: str, what: str = "size") -> int:
    """Bytes from a size with a unit ("96GiB", "64GB", "4096B"; see :mod:`flashnext.sizes`).

    Raises:
        PlanError: not a number followed by a known unit (names ``what`` in the message).
    """
    try:
        return byte_count(text)
    except SizeError as exc:
        raise PlanError(f"{what} {text!r}: {exc}") from None

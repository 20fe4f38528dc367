"""Byte sizes as people write them: "96GiB", "64GB", "512MiB", "1.5 GiB", "8000000000B".

A unit is required: a bare "96" could be GiB, GB or bytes, and read as bytes it plans nonsense.
"""

from __future__ import annotations

import re

from flashnext.plan.model import PlanError

_UNITS = {
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str, what: str = "size") -> int:
    """Bytes in ``text``: decimal units (kB, MB, GB, TB) or binary ones (KiB, MiB, GiB, TiB).

    Raises:
        PlanError: not a number followed by a known unit (names ``what`` in the message).
    """
    m = _SIZE.match(text)
    unit = m.group(2).lower() if m else ""
    if m and not unit:
        raise PlanError(
            f"{what} {text!r}: a number without a unit; write {m.group(1)}GiB, {m.group(1)}GB "
            f"or, for a count of bytes, {m.group(1)}B"
        )
    if not m or unit not in _UNITS:
        raise PlanError(
            f"{what} {text!r}: expected a number with a unit such as 96GiB, 64GB or 512MiB"
        )
    return int(float(m.group(1)) * _UNITS[unit])


def gib(n: float) -> str:
    """``n`` bytes as GiB with two decimals ("6.85 GiB"); small sizes in MiB or KiB."""
    if abs(n) >= 2**30 / 100:
        return f"{n / 2**30:.2f} GiB"
    if abs(n) >= 2**20 / 10:
        return f"{n / 2**20:.2f} MiB"
    return f"{n / 2**10:.2f} KiB"

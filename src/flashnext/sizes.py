"""Byte sizes as people write them: "96GiB", "64GB", "512MiB", "1.5 GiB", "8000000000B".

The one size parser: the planner's flags, ``check``'s memory flags and the plugin's
``FLASHNEXT_PLE_DEVICE_CACHE`` all read sizes here, and each caller raises its own area's error
naming its flag or switch. A unit is required: a bare "96" could be GiB, GB or bytes, and read
as bytes it plans nonsense. ``0`` is the one number without a unit (zero in any unit; a cache
of ``0`` is off).
"""

from __future__ import annotations

import re

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
#: What a size looks like, for error messages.
SIZE_HINT = "a number with a unit such as 96GiB, 64GB or 512MiB"


class SizeError(ValueError):
    """Not a size; the message says why, without naming the flag (the caller adds that)."""


def byte_count(text: str) -> int:
    """Bytes in ``text``: a number with a decimal (kB..TB) or binary (KiB..TiB) unit, or ``0``.

    Raises:
        SizeError: malformed, or a non-zero number without a unit.
    """
    m = _SIZE.match(text)
    unit = m.group(2).lower() if m else ""
    if m and not unit:
        if float(m.group(1)) == 0:
            return 0
        n = m.group(1)
        raise SizeError(
            f"a number without a unit; write {n}GiB, {n}GB or, for a count of bytes, {n}B"
        )
    if not m or unit not in _UNITS:
        raise SizeError(f"expected {SIZE_HINT}")
    return int(float(m.group(1)) * _UNITS[unit])


def gib(n: float) -> str:
    """``n`` bytes as GiB with two decimals ("6.85 GiB"); small sizes in MiB or KiB."""
    if abs(n) >= 2**30 / 100:
        return f"{n / 2**30:.2f} GiB"
    if abs(n) >= 2**20 / 10:
        return f"{n / 2**20:.2f} MiB"
    return f"{n / 2**10:.2f} KiB"


def size_text(n: float) -> str:
    """``n`` bytes with one decimal, in the largest binary unit that does not round it to 0.0
    ("29.8 GiB", "0.7 GiB", "3.1 KiB", "12 B"): a small table never reads as "0.0 GiB"."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale / 10:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"

"""Byte sizes as people write them: "96GiB", "64GB", "512MiB", "1.5 GiB", "8000000000".

A root module so that every layer (the planner's flags, the plugin's ``FLASHNEXT_PLE_CACHE``)
reads a size the same way; each caller raises its own area's error naming its flag or switch.
"""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
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


def byte_count(text: str) -> int | None:
    """Bytes in ``text`` (decimal kB..TB or binary KiB..TiB units), or None when malformed."""
    m = _SIZE.match(text)
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _UNITS:
        return None
    return int(float(m.group(1)) * _UNITS[unit])


def gib(n: float) -> str:
    """``n`` bytes as GiB with two decimals ("6.85 GiB"); small sizes in MiB or KiB."""
    if abs(n) >= 2**30 / 100:
        return f"{n / 2**30:.2f} GiB"
    if abs(n) >= 2**20 / 10:
        return f"{n / 2**20:.2f} MiB"
    return f"{n / 2**10:.2f} KiB"

"""Byte sizes as people write them: ``96GiB``, ``64GB``, ``512M``, ``1.5 TiB``, ``1000``."""

from __future__ import annotations

import re

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2,
    "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}  # fmt: skip


def parse_bytes(text: str) -> int:
    """Bytes in ``text``: a number and an optional SI (GB) or binary (GiB) unit.

    Raises:
        ValueError: naming the text and the accepted forms.
    """
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(f"{text!r} is not a size (expected e.g. 96GiB, 64GB, 512MiB or bytes)")
    return int(float(m.group(1)) * _UNITS[unit])


def format_gib(n: float) -> str:
    """``n`` bytes as GiB with two decimals (vLLM's unit in its memory messages)."""
    return f"{n / 1024**3:.2f} GiB"

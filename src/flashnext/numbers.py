"""Numbers as users write them on a command line or in a switch: the one parser per kind.

- :func:`finite_float`: a float that means something. ``nan`` compares false with every bound,
  so a range check lets it through and a timeout of ``nan`` waits forever; ``inf`` is never a
  useful limit either. Every float a command reads goes through here (the CLI's
  ``FiniteRange``, ``check``'s reading of vLLM flags).
- :func:`human_int`: an integer as vLLM reads its ``human_readable_int`` flags
  (``25.6k`` = 25,600, ``1K`` = 1,024, no decimals with a binary suffix).
- :func:`model_len`: ``--max-model-len`` as vLLM reads it (an integer as above, or ``auto`` /
  ``-1`` for the longest that fits), shared by ``check`` and ``plan``.

Each raises :class:`NumberError` with a message that names the value but not the flag; the
caller adds its flag or switch.
"""

from __future__ import annotations

import math
import re

_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_HUMAN = re.compile(r"(\d+(?:\.\d+)?)([kKmMgGtT])")
#: The words vLLM reads as "the longest context that fits".
AUTO_MODEL_LEN = ("auto", "-1")


class NumberError(ValueError):
    """Not a number of the kind asked for; the message names the value, not the flag."""


def finite_float(value: object) -> float:
    """``value`` (text or a number) as a finite float.

    Raises:
        NumberError: not a number, or nan / inf / -inf.
    """
    try:
        number = float(str(value).strip()) if not isinstance(value, int | float) else float(value)
    except ValueError:
        raise NumberError(f"{value!r} is not a number") from None
    if not math.isfinite(number):
        raise NumberError(f"{value!r} is not a finite number (nan and inf mean no limit here)")
    return number


def human_int(value: str, human: bool = True) -> int:
    """An integer, with vLLM's ``human_readable_int`` suffixes when ``human``.

    Raises:
        NumberError: anything else.
    """
    text = value.strip()
    m = _HUMAN.fullmatch(text) if human else None
    try:
        if m and m.group(2) in _DECIMAL:
            return int(float(m.group(1)) * _DECIMAL[m.group(2)])
        if m:
            return int(m.group(1)) * _BINARY[m.group(2)]
        return int(text)
    except ValueError:
        suffix = " (1k = 1,000, 1K = 1,024)" if human else ""
        raise NumberError(f"{value!r}: expected an integer{suffix}") from None


def model_len(value: str) -> int | None:
    """``--max-model-len`` as vLLM reads it: a positive integer (``2048``, ``128k``, ``32K``), or
    None for ``auto`` / ``-1`` (vLLM then picks the longest that fits in memory).

    Raises:
        NumberError: anything else, 0 and negative numbers included.
    """
    if value.strip().lower() in AUTO_MODEL_LEN:
        return None
    try:
        number = human_int(value)
    except NumberError:
        number = 0
    if number < 1:
        raise NumberError(
            f"{value!r}: expected a positive integer (2048, 128k, 32K), or -1/auto for the "
            "longest that fits, as vLLM reads it"
        )
    return number

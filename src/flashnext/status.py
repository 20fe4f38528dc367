"""The one set of statuses of checks and stages, and how each is shown.

``pass | warn | fail | skip | interrupted`` is what ``flashnext validate`` (stages, report.json,
report.md, report.png, the summary, ``validate compare``) and ``flashnext check`` (rows, the
record, the table) write. :data:`STYLES` holds every status's display style, so a new status
cannot be written without one (the PNG of an interrupted run once crashed on a second colour
map that lacked ``interrupted``).

Older versions wrote ``skipped`` (validate) and ``ok`` (check): :func:`read_status` reads them
as today's words; nothing writes them any more.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, cast

Status = Literal["pass", "warn", "fail", "skip", "interrupted"]
STATUSES: tuple[Status, ...] = ("pass", "warn", "fail", "skip", "interrupted")

#: Words older reports and records wrote, and the status each means now.
OLD_WORDS: dict[str, Status] = {"skipped": "skip", "ok": "pass"}


@dataclass(frozen=True)
class Style:
    """How a status is shown: a rich colour (terminal, Markdown-free text), a plain-text symbol,
    and a matplotlib colour (report.png's stage spans)."""

    colour: str
    symbol: str
    plot: str


STYLES: dict[Status, Style] = {
    "pass": Style("green", "✓", "tab:green"),
    "warn": Style("yellow", "!", "tab:orange"),
    "fail": Style("red", "✗", "tab:red"),
    "skip": Style("dim", "-", "tab:gray"),
    "interrupted": Style("magenta", "‖", "tab:purple"),
}


def read_status(word: object) -> Status:
    """The status a stored word means: today's words as they are, old ones (``skipped``,
    ``ok``) translated.

    Raises:
        ValueError: not a status word, old or new (the message lists the expected ones).
    """
    if isinstance(word, str):
        if word in STYLES:
            return cast(Status, word)
        if word in OLD_WORDS:
            return OLD_WORDS[word]
    raise ValueError(f"status {word!r}: expected one of {', '.join(STATUSES)}")


def label(status: Status) -> str:
    """``status`` with its symbol in front (``✓ pass``), for terminal tables: the symbol
    still tells the status apart where colour is lost (a log, a pipe)."""
    return f"{STYLES[status].symbol} {status}"

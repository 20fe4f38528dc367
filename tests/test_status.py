"""The one set of statuses (flashnext.status): every status has its style, old words are read."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from flashnext.status import OLD_WORDS, STATUSES, STYLES, label, read_status

SRC = Path(__file__).resolve().parent.parent / "src" / "flashnext"


def test_every_status_has_one_style_and_distinct_symbols() -> None:
    assert STATUSES == ("pass", "warn", "fail", "skip", "interrupted")
    assert set(STYLES) == set(STATUSES)
    assert len({s.symbol for s in STYLES.values()}) == len(STATUSES)
    assert len({s.plot for s in STYLES.values()}) == len(STATUSES)
    assert label("fail") == "✗ fail" and label("interrupted").endswith(" interrupted")


def test_old_words_are_read_and_unknown_ones_refused() -> None:
    assert {w: read_status(w) for w in OLD_WORDS} == {"skipped": "skip", "ok": "pass"}
    assert [read_status(s) for s in STATUSES] == list(STATUSES)
    for bad in ("passed", "", "PASS", None, 3, ["pass"]):
        with pytest.raises(
            ValueError, match=r"expected one of pass, warn, fail, skip, interrupted"
        ):
            read_status(bad)


def test_no_second_status_map_in_src() -> None:
    """The PNG crash of an interrupted run came from a second status-colour map that lacked a
    status: no module but status.py maps status words to display styles."""
    pattern = re.compile(r"\{\s*\"(pass|ok)\"\s*:\s*\"(tab:)?(green|red)")
    found = [
        f"{p.relative_to(SRC)}"
        for p in SRC.rglob("*.py")
        if p.name != "status.py" and pattern.search(p.read_text())
    ]
    assert not found, found

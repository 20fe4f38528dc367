"""Issue 42: sizes are said in the unit that shows them (never "0.0 GiB")."""

from __future__ import annotations

import pytest

from flashnext.sizes import byte_count, size_text


@pytest.mark.parametrize(
    ("n", "said"),
    [(0, "0 B"), (12, "12 B"), (102, "102 B"), (103, "0.1 KiB"), (3200, "3.1 KiB"),
     (2**20 // 10 + 1, "0.1 MiB"), (5 * 2**20, "5.0 MiB"), (2**30 // 10 + 1, "0.1 GiB"),
     (int(0.7 * 2**30), "0.7 GiB"), (int(29.8 * 2**30), "29.8 GiB"), (95 * 2**40, "97280.0 GiB")],
)  # fmt: skip
def test_size_text_picks_the_unit_that_shows_the_size(n: int, said: str) -> None:
    assert size_text(n) == said


def test_size_text_reads_back_within_its_rounding(rng) -> None:
    for n in rng.integers(1, 2**42, size=200):
        text = size_text(int(n))
        value, unit = text.split()
        back = byte_count(f"{value}{unit}")
        step = byte_count(f"0.1{unit}") if unit != "B" else 1
        assert abs(back - int(n)) <= step / 2 + 1, (n, text)
        assert not text.startswith("0.0 ")

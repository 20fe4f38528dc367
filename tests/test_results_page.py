"""BENCHMARKS.md is a results page, and the commands it quotes parse (issue 43).

- its first screen is the headline table: every row links to a section anchor that exists,
  quotes a ``bench/`` command (or says which committed test prints the figure instead) and dates
  the run;
- each section has a stable anchor (``<a id="...">``) and no session diary in its headings;
- every ``bench/NAME.py ARGS`` quoted on the page parses with that script's own argparse parser
  (types, choices, required arguments, unknown options), not just names existing options;
- the README's links into BENCHMARKS.md land on anchors that exist.

Parsing runs each script's ``main()`` in this process and stops it where ``parse_args`` returns
(``_Parsed``), so no benchmark runs and nothing needs a GPU.
"""

from __future__ import annotations

import argparse
import re
import runpy
import sys
from pathlib import Path
from typing import Any

import pytest

from .test_docs_commands import COMMAND_END, code_spans

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "BENCHMARKS.md"
HEADLINE_COLUMNS = ["result", "path", "format, size", "figure", "baseline in the same run (ratio)",
                    "command", "machine", "date"]  # fmt: skip
# A headline figure not made by a bench/ script must name the committed test that prints it.
NOT_BENCH = "no bench/ script"


def page() -> str:
    return PAGE.read_text()


def anchors(text: str) -> list[str]:
    return re.findall(r'<a id="([a-z0-9-]+)"></a>', text)


def headline_rows(text: str) -> list[list[str]]:
    """The cells of the page's first table (header and separator left out)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    table = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        table.append([c.strip() for c in line.strip("|").split(" | ")])
    assert table[0] == HEADLINE_COLUMNS, table[0]
    return table[2:]


def test_first_screen_is_the_headline_table() -> None:
    text = page()
    first_table = next(i for i, line in enumerate(text.splitlines()) if line.startswith("|"))
    assert first_table < 12, f"the headline table starts at line {first_table + 1}"
    rows = headline_rows(text)
    assert len(rows) >= 8
    known = set(anchors(text))
    for row in rows:
        assert len(row) == len(HEADLINE_COLUMNS), row
        result, command, date = row[0], row[5], row[7]
        link = re.fullmatch(r"\[[^\]]+\]\(#([a-z0-9-]+)\)", result)
        assert link and link.group(1) in known, f"{result}: no such anchor"
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", date), f"{result}: date {date!r}"
        assert re.search(r"bench/[a-z]\w*\.py", command) or NOT_BENCH in command, (
            f"{result}: command {command!r} is neither a bench/ script nor a named test"
        )


def test_sections_have_unique_anchors_and_no_diary() -> None:
    text = page()
    found = anchors(text)
    assert len(found) == len(set(found)), sorted(a for a in found if found.count(a) > 1)
    sections = re.findall(r"^## .*$", text, flags=re.M)
    assert len(found) >= len(sections) >= 10
    for line in text.splitlines():
        if line.startswith("## "):
            assert text.split(line)[0].rstrip().endswith("</a>"), f"{line}: no anchor above it"
        if line.startswith("#"):
            assert not re.search(r"\b(session|pass)\b", line, re.I), f"diary heading: {line}"
    assert "git log -p BENCHMARKS.md" in text


def test_readme_links_land_on_anchors() -> None:
    links = re.findall(r"BENCHMARKS\.md#([A-Za-z0-9-]+)", (ROOT / "README.md").read_text())
    assert links, "README links to no BENCHMARKS.md section"
    missing = sorted(set(links) - set(anchors(page())))
    assert not missing, f"README links to missing anchors: {missing}"


class _Parsed(Exception):
    """Raised from ``parse_args`` so that ``main()`` stops before any benchmark runs."""


def quoted_commands() -> list[tuple[str, list[str]]]:
    """(script, arguments) for every distinct ``... bench/NAME.py ...`` quoted on the page."""
    calls: dict[str, tuple[str, list[str]]] = {}
    for span in code_spans(page()):
        for line in span.splitlines():
            words = line.split()
            for i, word in enumerate(words):
                m = re.fullmatch(r"(?:\S*/)?bench/([a-z]\w*\.py)", word)
                if m and i > 0:  # run by something; a bare name in a heading is not a call
                    tail = []
                    for w in words[i + 1 :]:
                        if w in COMMAND_END or w.startswith("#"):
                            break
                        tail.append(w)
                    calls[" ".join([m.group(1), *tail])] = (m.group(1), tail)
    return sorted(calls.values())


@pytest.mark.parametrize(
    "script, args", quoted_commands(), ids=lambda v: " ".join(v) if isinstance(v, list) else v
)
def test_quoted_command_parses(script: str, args: list[str], monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    def stop(parser: argparse.ArgumentParser, *a: Any, **kw: Any) -> argparse.Namespace:
        raise _Parsed(original(parser, *a, **kw))

    original = argparse.ArgumentParser.parse_args
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", stop)
    monkeypatch.setattr(sys, "argv", [str(ROOT / "bench" / script), *args])
    monkeypatch.setattr(sys, "path", [str(ROOT / "bench"), *sys.path])  # scripts extend it
    with pytest.raises(_Parsed) as parsed:
        try:
            runpy.run_path(str(ROOT / "bench" / script), run_name="__main__")
        except SystemExit as exc:  # argparse's error exit: say which command
            pytest.fail(f"bench/{script} {' '.join(args)}: refused by its parser ({exc.code})")
    assert isinstance(parsed.value.args[0], argparse.Namespace)


def test_the_parse_check_catches_a_bad_value(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(pytest.fail.Exception, match="refused by its parser"):
        test_quoted_command_parses("lookup.py", ["--repeats", "ten"], monkeypatch)

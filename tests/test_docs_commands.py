"""README.md and docs/ name only commands and options that exist.

Every ``flashnext ...`` in a code block or inline code span is resolved against the real click
tree (the same objects ``flashnext --help`` prints): each word must be a command of its group
until the first non-command word, and every ``--option`` after it must belong to that command.
"""

from __future__ import annotations

import re
from pathlib import Path

import click
import pytest

from flashnext.cli import cli

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Where one shell command ends and the next (not ours) begins.
COMMAND_END = {"|", "&&", "||", ";", ">", "2>&1", "--"}
# Documented ahead of landing on another branch; drop the entry once the command exists.
PENDING: set[str] = set()  # "flashnext GROUP CMD" documented ahead of its merge


def code_spans(text: str) -> list[str]:
    """Fenced blocks (backslash continuations joined) and inline code spans."""
    fenced = re.findall(r"```[^\n]*\n(.*?)```", text, flags=re.S)
    rest = re.sub(r"```.*?```", "", text, flags=re.S)
    return [b.replace("\\\n", " ") for b in fenced] + re.findall(r"`([^`\n]+)`", rest)


def invocations(span: str) -> list[list[str]]:
    """The words after each ``flashnext`` (the program, not ``flashnext[extra]``) in ``span``."""
    found = []
    for line in span.splitlines():
        words = line.split()
        for i, word in enumerate(words):
            follows = words[i + 1] if i + 1 < len(words) else ""
            # prose such as "flashnext plugin: ..." or "flashnext = module:fn" is not a call
            if follows and not re.fullmatch(r"-.*|[a-z][a-z0-9-]*", follows):
                continue
            if word.strip("'\"") == "flashnext" and (i == 0 or words[i - 1] not in ("pip", "-e")):
                tail = []
                for w in words[i + 1 :]:
                    if w in COMMAND_END:
                        break
                    tail.append(w.strip("'\""))
                found.append(tail)
    return found


def problems(words: list[str]) -> list[str]:
    """What in ``flashnext WORDS`` names no command or option (empty when all exist)."""
    ctx = click.Context(cli, info_name="flashnext")
    command: click.Command = cli
    path = ["flashnext"]
    rest = list(words)
    while rest and isinstance(command, click.Group) and not rest[0].startswith("-"):
        sub = command.get_command(ctx, rest[0])
        if sub is None:
            pending = " ".join([*path, rest[0]]) in PENDING
            return [] if pending else [f"`{' '.join(path)}` has no command {rest[0]!r}"]
        command, path = sub, [*path, rest.pop(0)]
    known = {"--help"} | {o for p in command.params for o in (*p.opts, *p.secondary_opts)}
    if command is cli:
        known.add("--version")
    lenient = command.context_settings.get("ignore_unknown_options", False)
    return [
        f"`{' '.join(path)}` has no option {option}"
        for option in (w.split("=", 1)[0] for w in rest if w.startswith("--"))
        if option not in known and not lenient
    ]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_docs_name_existing_commands_and_options(doc: Path) -> None:
    calls = [w for span in code_spans(doc.read_text()) for w in invocations(span)]
    found = sorted({p for words in calls for p in problems(words)})
    assert not found, f"{doc.name}: " + "; ".join(found)


def test_the_check_finds_a_wrong_name() -> None:
    assert problems(["ple", "quantise"]) == ["`flashnext ple` has no command 'quantise'"]
    assert problems(["ple", "info", "--jsn"]) == ["`flashnext ple info` has no option --jsn"]
    assert problems(["ple", "info", "--json", "DIR"]) == []
    assert invocations("pip install 'flashnext[nvml]' && flashnext demo --out x | head") == [
        ["demo", "--out", "x"]
    ]

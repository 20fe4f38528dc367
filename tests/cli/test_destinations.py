"""Issue 22 rule 1: every writing command refuses the same hostile destinations, and loses nothing.

Each writing command runs through the real CLI entry point (``flashnext.cli.main``) against one
table of destinations: the working directory, its ancestors, an input, a directory holding an
input, a path inside an input, symbolic and hard links to an input, a file where a directory
belongs (and the reverse), a dangling link, a file the command did not write. Every case must
end in one ``error:`` line naming the destination, exit 2 (a bad flag value, before any work),
and leave every byte under the test's directory as it was.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from flashnext.store.destination import destination_problem

from .inputs import ProfileInputs, build_profile_inputs
from .runner import run_in_process

DEAD_URL = "http://127.0.0.1:9"  # discard port: nothing listens; never reached when refused


@dataclass
class World:
    """The inputs of every command, nested one level below the working directory."""

    cwd: Path
    data: Path  # holds every input
    sidecar: Path
    text: Path
    tokenizer: Path
    record: Path
    prompts: Path


@pytest.fixture(scope="module")
def profile_inputs(tmp_path_factory: pytest.TempPathFactory) -> ProfileInputs:
    return build_profile_inputs(tmp_path_factory.mktemp("dest") / "in")


@pytest.fixture
def world(tmp_path: Path, profile_inputs: ProfileInputs, monkeypatch) -> World:
    import shutil

    cwd = tmp_path / "work"
    data = cwd / "data"
    data.mkdir(parents=True)
    shutil.copytree(profile_inputs.sidecar, data / "sidecar")
    shutil.copy(profile_inputs.text, data / "text.md")
    shutil.copy(profile_inputs.tokenizer, data / "tokenizer.json")
    (data / "r.json").write_text('{"kind": "flashnext.deploy.record"}\n')
    (data / "prompts.jsonl").write_text('{"id": "p1", "prompt": "Hello"}\n')
    (cwd / "notes.txt").write_text("mine\n")
    (cwd / "afile").write_text("a file\n")
    (cwd / "adir").mkdir()
    monkeypatch.chdir(cwd)
    return World(
        cwd,
        data,
        data / "sidecar",
        data / "text.md",
        data / "tokenizer.json",
        data / "r.json",
        data / "prompts.jsonl",
    )


@dataclass(frozen=True)
class Command:
    argv: Callable[[World, str], list[object]]
    expect: str  # "dir" | "file"
    input: Callable[[World], Path] | None  # the input a destination must stay clear of


COMMANDS = {
    "ple quantize": Command(
        lambda w, d: ["ple", "quantize", w.sidecar, d, "--format", "fp8"],
        "dir",
        lambda w: w.sidecar,
    ),
    "ple profile": Command(
        lambda w, d: [
            "ple",
            "profile",
            w.sidecar,
            "--text",
            w.text,
            "--tokenizer",
            w.tokenizer,
            "--output",
            d,
        ],
        "file",
        lambda w: w.sidecar,
    ),
    "ple slice": Command(
        lambda w, d: ["ple", "slice", w.sidecar, d, "--tp", "1", "--ranks", "0"],
        "dir",
        lambda w: w.sidecar,
    ),
    "demo": Command(lambda w, d: ["demo", "--base", "1000", "--out", d], "dir", None),
    "record capture": Command(
        lambda w, d: ["record", "capture", "--url", DEAD_URL, "--model", w.sidecar, "--output", d],
        "file",
        lambda w: w.sidecar,
    ),
    "record restore --output": Command(
        lambda w, d: ["record", "restore", w.record, "--output", d], "file", lambda w: w.record
    ),
    "checkpoint override": Command(
        lambda w, d: ["checkpoint", "override", w.sidecar, "--layer-type", "a=b", "--out", d],
        "dir",
        lambda w: w.sidecar,
    ),
    "validate": Command(lambda w, d: ["validate", "--url", DEAD_URL, "--out", d], "dir", None),
    "validate ab": Command(
        lambda w, d: [
            "validate",
            "ab",
            "--baseline",
            DEAD_URL,
            "--candidate",
            DEAD_URL,
            "--prompts",
            w.prompts,
            "--out",
            d,
        ],
        "dir",
        lambda w: w.prompts,
    ),
}


def _link(w: World, name: str, target: Path) -> str:
    (w.cwd / name).symlink_to(target)
    return name


def _inside(w: World, cmd: Command) -> str | None:
    assert cmd.input is not None
    src = cmd.input(w)
    if not src.is_dir():
        return None  # nothing lies inside a file
    return str(src / ("shard_0.safetensors" if cmd.expect == "file" else "sub"))


def _hard_link(w: World, cmd: Command) -> str | None:
    assert cmd.input is not None
    src = cmd.input(w)
    if src.is_dir():
        return None
    os.link(src, w.cwd / "hard")
    return "hard"


# name -> (destination for a world and a command, or None where the case does not apply)
CASES: dict[str, Callable[[World, Command], str | None]] = {
    "dot": lambda w, c: ".",
    "dotdot": lambda w, c: "..",
    "ancestor of cwd": lambda w, c: str(w.cwd.parent.parent),
    "root": lambda w, c: "/",
    "cwd spelled with a trailing dot": lambda w, c: str(w.cwd / "adir" / ".."),
    "the input": lambda w, c: str(c.input(w)) if c.input else None,
    "the input, relative": lambda w, c: os.path.relpath(c.input(w)) if c.input else None,
    "holds the input": lambda w, c: "data" if c.input else None,
    "inside the input": lambda w, c: _inside(w, c) if c.input else None,
    "symlink to the input": lambda w, c: _link(w, "link", c.input(w)) if c.input else None,
    "symlink to the input's parent": lambda w, c: _link(w, "up", w.data) if c.input else None,
    "hard link to the input": lambda w, c: _hard_link(w, c) if c.input else None,
    "file where a directory belongs": lambda w, c: "afile" if c.expect == "dir" else "adir",
    "dangling symlink": lambda w, c: _link(w, "dangling", w.cwd / "nowhere"),
    "a file it did not write": lambda w, c: "notes.txt" if c.expect == "file" else None,
    "a directory holding a file it did not write": lambda w, c: _holding(w, "notes.txt"),
    "a directory holding, under a name it writes, a file it did not write": lambda w, c: (
        _holding(w, OWN_NAME[c.argv(w, "x")[0] + " " + str(c.argv(w, "x")[1])])
    ),
}

#: A name each directory writer writes (issue 42: a report directory is a destination too).
OWN_NAME = {"ple quantize": "META.json", "ple slice": "META.json", "demo --base": "ple_bf16",
            "checkpoint override": "config.json", "validate --url": "report.json",
            "validate ab": "ab.json"}  # fmt: skip


def _holding(w: World, name: str) -> str:
    """A directory ``held`` holding one file ``name`` of the user's."""
    (w.cwd / "held").mkdir()
    (w.cwd / "held" / name).write_text("the user's own\n")
    return "held"


def _snapshot(root: Path) -> dict[str, object]:
    """Every file's bytes and every link's target under ``root`` (links not followed)."""
    found: dict[str, object] = {}
    for top, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(top) / name
            key = str(path.relative_to(root))
            if path.is_symlink():
                found[key] = ("link", os.readlink(path))
            elif path.is_file():
                found[key] = path.read_bytes()
            else:
                found[key] = "dir"
    return found


#: Cases that need an input of one kind; the others apply to every command.
NEEDS = {
    "the input": {"dir", "file"},
    "the input, relative": {"dir", "file"},
    "holds the input": {"dir", "file"},
    "inside the input": {"dir"},
    "symlink to the input": {"dir", "file"},
    "symlink to the input's parent": {"dir", "file"},
    "hard link to the input": {"file"},
}
INPUT_KIND = {"record restore --output": "file", "validate ab": "file", "demo": None,
              "validate": None}  # fmt: skip
PAIRS = [
    (command, case)
    for command, cmd in COMMANDS.items()
    for case in CASES
    if case not in NEEDS or INPUT_KIND.get(command, "dir") in NEEDS[case]
    if case != "a file it did not write" or cmd.expect == "file"
    if not case.startswith("a directory holding") or cmd.expect == "dir"
]


@pytest.mark.parametrize(("command", "case"), PAIRS)
def test_every_writing_command_refuses_every_hostile_destination(
    world, tmp_path, capsys, command, case
):
    cmd = COMMANDS[command]
    dst = CASES[case](world, cmd)
    assert dst is not None
    before = _snapshot(tmp_path)
    code, _, err = run_in_process(cmd.argv(world, dst), capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    # ple quantize and ple slice judge what a directory holds under the lock, knowing the source
    # and the settings (their own unfinished table resumes): a refusal of the inputs, exit 1
    judged_later = command in ("ple quantize", "ple slice") and case.startswith("a directory holding")
    assert code == (1 if judged_later else 2), (code, err[-2000:])
    assert lines and lines[-1].startswith("error: ") and dst in lines[-1], err
    assert _snapshot(tmp_path) == before, "a refused command changed files"


def test_a_new_destination_beside_the_inputs_is_accepted(world, capsys):
    """The table's negative control: the same commands write into a fresh path."""
    code, _, err = run_in_process(COMMANDS["ple quantize"].argv(world, "out/fp8"), capsys)
    assert code == 0, err
    code, _, err = run_in_process(COMMANDS["ple profile"].argv(world, "out/p.safetensors"), capsys)
    assert code == 0, err
    # a profile may replace its own earlier profile, never another file
    code, _, err = run_in_process(COMMANDS["ple profile"].argv(world, "out/p.safetensors"), capsys)
    assert code == 0, err
    code, _, err = run_in_process(COMMANDS["record restore --output"].argv(world, "r.sh"), capsys)
    assert code != 2, err  # the destination passed; the (fake) record itself is refused
    assert "r.sh" not in os.listdir(world.cwd)


def test_rule_is_pure_and_names_the_input(tmp_path):
    src = tmp_path / "a" / "in"
    src.mkdir(parents=True)
    (src / "f").write_text("x")
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    assert destination_problem(tmp_path / "out", [src], cwd=cwd) is None
    assert "contains the input" in destination_problem(tmp_path / "a", [src], cwd=cwd)
    assert "lies inside the input" in destination_problem(src / "x", [src], cwd=cwd)
    assert "is the input" in destination_problem(src / "f", [src / "f"], expect="file", cwd=cwd)
    assert "working directory" in destination_problem(cwd, [], cwd=cwd)
    owned = destination_problem(src / "f", [], expect="file", owns=lambda p: True, cwd=cwd)
    assert owned is None
    assert "was not written by this command" in destination_problem(
        src, [], writes=["f"], owns=lambda p: False, cwd=cwd
    )
    assert sorted(os.listdir(src)) == ["f"] and os.listdir(cwd) == []

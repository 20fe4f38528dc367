"""Issue 42: a report directory is a destination too (``validate --out``, ``validate ab --out``).

Real runs against a port nothing listens on (each writes its report in about a second). A
directory may hold only files a flashnext report wrote and that are unchanged since; anything
else is refused before the run (exit 2, one line naming it); ``--force`` replaces the report's
own names and never another file.
"""

from __future__ import annotations

import json
from pathlib import Path

from devtools.vllm_cpu import free_port

from ..cli.runner import assert_one_line_error, run

DEAD = "http://127.0.0.1:9"


def _validate(out: Path, *flags: str):
    return run("validate", "--url", DEAD, "--ready-timeout", "0.5", "--no-png", "--out", out,
               *flags)  # fmt: skip


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in d.iterdir() if not p.name.startswith(".")}


def test_its_own_report_is_replaced_an_edited_one_is_not(tmp_path: Path) -> None:
    out = tmp_path / "r"
    assert _validate(out).returncode == 1  # the server is down: the report says so
    assert _validate(out, "--ready-timeout", "0.6").returncode == 1  # its own: replaced
    assert json.loads((out / "report.json").read_text())["config"]["ready_timeout_s"] == 0.6
    (out / "report.md").write_text("my notes on the run\n")  # the user edits it
    before = _files(out)
    p = _validate(out)
    assert_one_line_error(p, str(out), "(or changed since): report.md", "--force", code=2)
    assert _files(out) == before


def test_force_replaces_the_report_names_and_never_another_file(tmp_path: Path) -> None:
    out = tmp_path / "r"
    out.mkdir()
    (out / "report.json").write_text('{"mine": true}\n')
    assert_one_line_error(_validate(out), "report.json", code=2)
    assert (out / "report.json").read_text() == '{"mine": true}\n'
    assert _validate(out, "--force").returncode == 1
    assert json.loads((out / "report.json").read_text())["kind"] == "flashnext.validate.report"
    (out / "notes.txt").write_text("keep me\n")
    before = _files(out)
    p = _validate(out, "--force")
    assert_one_line_error(p, "notes.txt", "--force replaces only report.json, report.md", code=2)
    assert _files(out) == before


def test_validate_and_ab_share_a_directory_and_ab_is_held_to_the_rule(tmp_path: Path) -> None:
    out = tmp_path / "r"
    assert _validate(out).returncode == 1
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "p1", "prompt": "Hello"}\n')
    other = f"http://127.0.0.1:{free_port()}"
    ab = ["validate", "ab", "--baseline", DEAD, "--candidate", other, "--prompts", prompts,
          "--timeout", "1", "--no-png", "--out", out]  # fmt: skip
    p = run(*ab)
    assert p.returncode == 1 and (out / "ab.json").is_file(), p.stderr[-2000:]
    assert {"report.json", "report.md", "ab.json", "ab.md"} <= set(_files(out))
    (out / "ab.md").write_text("edited\n")
    before = _files(out)
    assert_one_line_error(run(*ab), "ab.md", code=2)
    assert _files(out) == before
    # record-only: its one file is held to the rule too
    (out / "baseline-answers.jsonl").write_text("{}\n")
    p = run("validate", "ab", "--baseline", DEAD, "--prompts", prompts, "--timeout", "1",
            "--out", out, "--force")  # fmt: skip
    assert_one_line_error(p, "ab.md", code=2)  # --force never replaces another command's edit

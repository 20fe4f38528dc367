"""Every report survives a full disk and an odd ``--out`` (issue 22, rule 2).

A full disk is real: a small tmpfs mounted for the test and filled to its last block (root
only; elsewhere the test says why it cannot run). The runs are real ``flashnext validate`` and
``validate ab`` subprocesses against the suite's shared vLLM server, so the run itself passes
and only the writing fails.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from devtools.vllm_cpu import VllmServer, free_port
from flashnext.records import check_record

from ..cli.runner import assert_one_line_error, run

PNG = b"\x89PNG\r\n\x1a\n"
#: A path component that is not UTF-8 (Linux paths are bytes): Python carries it as surrogates.
UNDECODABLE = os.fsdecode(b"r\xff\xfeport")


@pytest.fixture
def full_dir(tmp_path: Path) -> Iterator[Path]:
    """An empty directory on a file system with no free block left (a 256 KiB tmpfs, filled)."""
    if os.geteuid() != 0:
        pytest.skip("a real full disk needs root to mount a small tmpfs")
    mnt = tmp_path / "full"
    mnt.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        (mnt / "out").mkdir()
        with open(mnt / "filler", "wb", buffering=0) as fh, pytest.raises(OSError) as full:
            while True:
                fh.write(b"\0" * 4096)
        assert full.value.errno == errno.ENOSPC
        assert os.statvfs(mnt).f_bavail == 0
        yield mnt / "out"
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_validate_on_a_full_disk_prints_the_record_and_names_each_file(
    vllm_server: VllmServer, full_dir: Path
) -> None:
    p = run("validate", "--url", vllm_server.url, "--stages", "ready", "--out", full_dir, "--json")
    assert "Traceback" not in p.stderr
    report = check_record(json.loads(p.stdout), kind="flashnext.validate.report")
    assert report["passed"] is True  # the run passed: only the writing failed
    assert p.returncode == 1, p.stderr
    errors = [line for line in p.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [
        f"error: {full_dir / name}: cannot write (No space left on device)"
        for name in ("report.json", "report.md", "report.png")
    ]
    assert list(full_dir.iterdir()) == []  # no temp file left holding space

    p = run("validate", "--url", vllm_server.url, "--stages", "ready", "--out", full_dir)
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert "PASSED" in p.stdout and "│ ready │ ✓ pass" in p.stdout  # the summary table
    assert f"error: {full_dir / 'report.json'}: cannot write (No space left" in p.stderr


def test_ab_on_a_full_disk_prints_the_report_and_names_each_file(
    vllm_server: VllmServer, full_dir: Path, tmp_path: Path
) -> None:
    prompts = tmp_path / "one.jsonl"
    prompts.write_text(json.dumps({"id": "one", "prompt": "The river rose and"}) + "\n")
    url = vllm_server.url
    args = ["validate", "ab", "--baseline", url, "--candidate", url, "--prompts", prompts]
    p = run(*args, "--max-tokens", "4", "--out", full_dir)
    assert "Traceback" not in p.stderr
    assert p.stdout.startswith("# flashnext validate ab: IDENTICAL"), p.stdout[-2000:]
    assert p.returncode == 1, p.stderr
    errors = [line for line in p.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [
        f"error: {full_dir / name}: cannot write (No space left on device)"
        for name in ("ab.json", "ab.md", "ab.png", "baseline-answers.jsonl")
    ]
    p = run(*args, "--max-tokens", "4", "--out", full_dir, "--json")
    assert p.returncode == 1 and "Traceback" not in p.stderr
    record = check_record(json.loads(p.stdout), kind="flashnext.validate.ab")
    assert record["verdict"]["status"] == "identical"
    assert list(full_dir.iterdir()) == []


def test_an_undecodable_out_path_works(vllm_server: VllmServer, tmp_path: Path) -> None:
    out = tmp_path / UNDECODABLE
    p = run("validate", "--url", vllm_server.url, "--stages", "ready", "--out", out, "--json")
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-2000:]
    names = sorted(os.listdir(os.fsencode(out)))
    assert names == [b".flashnext-files.json", b"report.json", b"report.md", b"report.png"]
    assert json.loads((out / "report.json").read_text()) == json.loads(p.stdout)
    md = (out / "report.md").read_bytes().decode("utf-8")  # valid UTF-8, the path escaped
    assert "r\\udcff\\udcfeport" in md
    assert (out / "report.png").read_bytes()[:8] == PNG

    prompts = tmp_path / "one.jsonl"
    prompts.write_text(json.dumps({"id": "one", "prompt": "The river rose and"}) + "\n")
    url = vllm_server.url
    ab_out = tmp_path / f"ab-{UNDECODABLE}"
    p = run("validate", "ab", "--baseline", url, "--candidate", url, "--prompts", prompts,
            "--max-tokens", "4", "--out", ab_out)  # fmt: skip
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert sorted(os.listdir(os.fsencode(ab_out))) == [
        b".flashnext-files.json", b"ab.json", b"ab.md", b"ab.png", b"baseline-answers.jsonl"
    ]  # fmt: skip
    md = (ab_out / "ab.md").read_bytes().decode("utf-8")
    assert md.startswith("# flashnext validate ab: IDENTICAL") and "ab-r\\udcff\\udcfeport" in md
    assert p.stdout.rstrip("\n") == md.rstrip("\n")  # stdout is the same valid UTF-8


def test_ab_out_checked_before_the_run(tmp_path: Path) -> None:
    """A report name taken by a directory is refused at once, not after every prompt ran."""
    (tmp_path / "D" / "ab.md").mkdir(parents=True)
    url = f"http://127.0.0.1:{free_port()}"
    p = run("validate", "ab", "--baseline", url, "--candidate", url, "--out", tmp_path / "D")
    assert_one_line_error(p, f"--out {tmp_path / 'D'}: ab.md there is a directory")
    assert p.stdout == ""  # no run, so no report
    (tmp_path / "E" / "ab.png").mkdir(parents=True)  # the plot is written by default...
    p = run("validate", "ab", "--baseline", url, "--candidate", url, "--out", tmp_path / "E")
    assert_one_line_error(p, "ab.png there is a directory")
    # ...and with --no-png a directory flashnext did not write is still not its to write in
    p = run("validate", "ab", "--baseline", url, "--candidate", url, "--out", tmp_path / "E",
            "--no-png")  # fmt: skip
    assert_one_line_error(p, "did not write (or changed since): ab.png", code=2)
    assert p.stdout == "" and os.listdir(tmp_path / "E") == ["ab.png"]

"""Rule: errors name the user's input, and a list with an empty item is a typo, not a shorter
list. Also: `ple preflight` speaks in the command line's flags, never in library arguments."""

from __future__ import annotations

import re

import numpy as np
import pytest

from flashnext.store.destination import write_sidecar

from .inputs import closed_port
from .runner import run_in_process


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory):
    path = tmp_path_factory.mktemp("ids") / "bf16"
    rows = np.random.default_rng(7).standard_normal((300, 160), dtype=np.float32)
    write_sidecar(path, "bf16", rows, 100)
    return path


@pytest.mark.parametrize("ids, position", [("1,,2", 2), ("1,", 2), (",1", 1), ("", 1),
                                           ("0,5,,", 3), (" , ", 1)])  # fmt: skip
def test_ids_with_an_empty_item(sidecar, capsys, ids, position):
    code, out, err = run_in_process(["ple", "lookup", str(sidecar), "--ids", ids], capsys)
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert f"found an empty item at position {position} of {ids!r}" in err


@pytest.mark.parametrize("ids", ["1 2", "a", "1.5", "0x10"])
def test_ids_not_integers(sidecar, capsys, ids):
    code, _, err = run_in_process(["ple", "lookup", str(sidecar), "--ids", ids], capsys)
    assert code == 2 and f"found {ids!r} at position 1" in err, err


def test_ids_that_are_fine(sidecar, capsys):
    code, out, err = run_in_process(["ple", "lookup", str(sidecar), "--ids", " 3 , -1,299"], capsys)
    assert code == 0 and "row 3" in out and "row 299" in out, err


@pytest.mark.parametrize("stages", ["ready,,short", "ready,", ",ready", ""])
def test_stages_with_an_empty_item(tmp_path, capsys, stages):
    url = f"http://127.0.0.1:{closed_port()}"
    argv = ["validate", "--url", url, "--stages", stages, "--out", str(tmp_path / "r")]
    code, _, err = run_in_process(argv, capsys)
    assert code == 2 and err.startswith(f"error: --stages {stages!r}: unknown stage(s)"), err
    assert "(an empty item)" in err and not (tmp_path / "r").exists()


@pytest.mark.parametrize("gpu", ["sm120,,96GiB", "sm120,96GiB,", ",sm120"])
def test_gpu_with_an_empty_item(tmp_path, capsys, gpu):
    code, _, err = run_in_process(["check", "--model", str(tmp_path), "--gpu", gpu], capsys)
    assert code == 2 and f"--gpu {gpu!r}: empty item at position" in err, err


def _host(tmp_path, meminfo: str):
    (tmp_path / "proc" / "sys" / "vm").mkdir(parents=True)
    (tmp_path / "proc" / "meminfo").write_text(meminfo)
    (tmp_path / "proc" / "sys" / "vm" / "overcommit_memory").write_text("0\n")
    return tmp_path


LIBRARY_WORDS = re.compile(r"preflight=False|residency=|row_range|hot_rows\b|open_table")


def test_preflight_refusal_speaks_flags(sidecar, tmp_path, capsys):
    host = _host(tmp_path / "small", "MemTotal: 4096 kB\nMemAvailable: 1024 kB\n")
    for residency in ("resident", "mmap"):
        argv = ["ple", "preflight", str(sidecar), "--residency", residency, "--host-root", host]
        argv += ["--hot-tier", "200"] if residency == "mmap" else []
        code, out, err = run_in_process([str(a) for a in argv], capsys)
        assert code == 1, out + err
        assert not LIBRARY_WORDS.search(out + err), out + err
    assert "--residency mmap" in out + err


def test_preflight_without_meminfo_line_speaks_flags(sidecar, tmp_path, capsys):
    host = _host(tmp_path / "old", "MemTotal: 4096 kB\n")
    argv = ["ple", "preflight", str(sidecar), "--host-root", str(host)]
    code, out, err = run_in_process(argv, capsys)
    assert code == 1 and "no MemAvailable line" in err and err.count("\n") == 1, err
    assert not LIBRARY_WORDS.search(out + err), err

"""One meaning per option, in every command (issue 21 section 3), read from the click tree, and
the documented old spellings: same effect, one deprecation line, both spellings refused."""

from __future__ import annotations

import json

import click
import pytest

from .inputs import build_profile_inputs, closed_port, leaf_commands
from .runner import run_in_process


def _options(flag: str) -> list[tuple[str, click.Option]]:
    return [
        (name, p)
        for name, cmd in leaf_commands().items()
        for p in cmd.params
        if isinstance(p, click.Option) and flag in p.opts and not p.hidden
    ]


def test_out_is_a_directory_and_output_a_file():
    outs, outputs = _options("--out"), _options("--output")
    assert outs and outputs
    for name, p in outs:
        assert isinstance(p.type, click.Path) and not p.type.file_okay, f"{name} --out"
    for name, p in outputs:
        assert isinstance(p.type, click.Path) and not p.type.dir_okay, f"{name} --output"
    assert {"record capture", "ple profile"} <= {n for n, _ in outputs}


def test_model_is_a_path_and_served_model_a_name():
    models = _options("--model")
    assert {"check", "plan", "explain", "record capture"} <= {n for n, _ in models}
    for name, p in models:
        assert isinstance(p.type, click.Path), f"{name} --model is not a checkpoint path"
    assert [n for n, _ in _options("--served-model")] == ["validate"]
    # a name a server serves is a *served* model wherever it appears
    flags = {
        flag
        for cmd in leaf_commands().values()
        for p in cmd.params
        if isinstance(p, click.Option) and not p.hidden
        for flag in p.opts
    }
    names = sorted(
        f for f in flags if f.endswith("-model") and f not in ("--model", "--served-model")
    )
    assert names == ["--baseline-served-model", "--candidate-served-model"], names


def test_workers_are_processes_and_threads_threads():
    for name, p in _options("--workers"):
        assert "thread" not in (p.help or "").lower(), f"{name} --workers counts threads"
        assert "process" in (p.help or "").lower(), f"{name} --workers: say it counts processes"
    threads = _options("--threads")
    assert threads and all("thread" in (p.help or "").lower() for _, p in threads)


def _deprecated_once(err: str, old: str, new: str) -> None:
    lines = [line for line in err.splitlines() if "deprecated" in line]
    assert lines == [f"warning: {old} is deprecated here; it is now spelled {new}"], err


def test_validate_model_is_served_model(tmp_path, capsys):
    url = f"http://127.0.0.1:{closed_port()}"
    base = ["validate", "--url", url, "--ready-timeout", "0.2", "--no-png", "--json"]
    code, out, err = run_in_process([*base, "--model", "m-old", "--out", tmp_path / "a"], capsys)
    assert code == 1 and json.loads(out)["config"]["model"] == "m-old"
    _deprecated_once(err, "--model", "--served-model")
    code, out, err = run_in_process(
        [*base, "--served-model", "m-new", "--out", tmp_path / "b"], capsys
    )
    assert code == 1 and json.loads(out)["config"]["model"] == "m-new"
    assert "deprecated" not in err
    both = [*base, "--model", "a", "--served-model", "b", "--out", tmp_path / "c"]
    code, out, err = run_in_process(both, capsys)
    assert code == 2 and "give --served-model only (--model is its old spelling)" in err
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("side", ["baseline", "candidate"])
def test_validate_ab_model_is_served_model(tmp_path, capsys, side):
    url = f"http://127.0.0.1:{closed_port()}"
    base = ["validate", "ab", "--baseline", url, "--candidate", url, "--timeout", "0.2",
            "--no-png", "--json"]  # fmt: skip
    old, new = f"--{side}-model", f"--{side}-served-model"
    code, out, err = run_in_process([*base, old, "m", "--out", tmp_path / "a"], capsys)
    assert code == 1 and json.loads(out)["kind"] == "flashnext.validate.ab", err
    _deprecated_once(err, old, new)
    code, out, err = run_in_process([*base, new, "m", "--out", tmp_path / "b"], capsys)
    assert code == 1 and "deprecated" not in err
    code, out, err = run_in_process([*base, old, "a", new, "b", "--out", tmp_path / "c"], capsys)
    assert code == 2 and f"give {new} only ({old} is its old spelling)" in err
    assert not (tmp_path / "c").exists()


def test_checkpoint_verify_workers_is_threads(cli_inputs, capsys):
    base = ["checkpoint", "verify", cli_inputs.checkpoint, "--hash", "--json"]
    code, old, err = run_in_process([*base, "--workers", "2"], capsys)
    assert code == 0, err
    _deprecated_once(err, "--workers", "--threads")
    code, new, err = run_in_process([*base, "--threads", "2"], capsys)
    assert code == 0 and "deprecated" not in err
    drop = ("environment", "seconds")
    assert {k: v for k, v in json.loads(old).items() if k not in drop} == {
        k: v for k, v in json.loads(new).items() if k not in drop
    }


@pytest.mark.parametrize("spelling", ["--out", "--output"])
def test_profile_output_file(tmp_path, capsys, spelling):
    inputs = build_profile_inputs(tmp_path / "in")
    target = tmp_path / "hot.safetensors"
    code, _, err = run_in_process([*inputs.argv(), spelling, target], capsys)
    assert code == 0 and target.is_file(), err
    if spelling == "--out":
        _deprecated_once(err, "--out", "--output")
    else:
        assert "deprecated" not in err

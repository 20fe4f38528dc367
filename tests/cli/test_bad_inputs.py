"""Bad input through every command: one ``error:`` line on stderr, a non-zero exit, no traceback.

The commands are discovered from the click tree; ``BAD_INPUTS`` must give every command every
case, as arguments or as the reason the case does not apply to it. Cases:

- ``missing``: a path that does not exist;
- ``wrong-kind``: a file where a directory is expected (or a directory where a file is);
- ``unreadable``: an input the user may not read (config.json, a shard, a report) or an output
  directory they may not write; run in a subprocess that file modes apply to even as root;
- ``out-of-range``: a flag value outside its range (click types: exit 2).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from .inputs import Inputs, leaf_commands, profile_inputs
from .runner import run, run_in_process

CASES = ("missing", "wrong-kind", "unreadable", "out-of-range")
LAYER_TYPE = ["--layer-type", "qwen_sparse_attention=full_attention"]
URL = ["--url", "http://127.0.0.1:1", "--ready-timeout", "0.5", "--no-png"]

Args = Callable[[Inputs], list[object]]


def _unreadable_config(i: Inputs) -> Path:
    """A copy of the checkpoint (weights symlinked) whose config.json has mode 000."""
    dst = i.fresh("ck-unreadable")
    dst.mkdir()
    for entry in i.checkpoint.iterdir():
        if entry.name != "config.json":
            (dst / entry.name).symlink_to(entry)
    shutil.copy(i.checkpoint / "config.json", dst / "config.json")
    os.chmod(dst / "config.json", 0)
    return dst


def _unreadable_shard(i: Inputs) -> Path:
    dst = i.fresh("sidecar-unreadable")
    shutil.copytree(i.sidecar, dst)
    os.chmod(dst / "shard_1.safetensors", 0)
    return dst


def _unreadable_file(i: Inputs) -> Path:
    dst = i.fresh("report-unreadable")
    shutil.copy(i.report, dst)
    os.chmod(dst, 0)
    return dst


def _unwritable_dir(i: Inputs) -> Path:
    parent = i.fresh("read-only")
    parent.mkdir(mode=0o555)
    return parent / "out"


# command -> case -> arguments, or a string: why the case does not apply to the command
BAD_INPUTS: dict[str, dict[str, Args | str]] = {
    "checkpoint verify": {
        "missing": lambda i: [i.fresh("nothing")],
        "wrong-kind": lambda i: [i.a_file],
        "unreadable": lambda i: [_unreadable_config(i)],
        "out-of-range": lambda i: [i.checkpoint, "--threads", "0"],
    },
    "checkpoint ple": {
        "missing": lambda i: [i.fresh("nothing")],
        "wrong-kind": lambda i: [i.a_file],
        "unreadable": lambda i: [_unreadable_config(i)],
        "out-of-range": lambda i: [i.checkpoint, "--tp", "0"],
    },
    "checkpoint override": {
        "missing": lambda i: [i.fresh("nothing"), *LAYER_TYPE, "--hf-overrides"],
        "wrong-kind": lambda i: [i.checkpoint, *LAYER_TYPE, "--out", i.a_file / "sub"],
        "unreadable": lambda i: [_unreadable_config(i), *LAYER_TYPE, "--hf-overrides"],
        "out-of-range": lambda i: [i.checkpoint, "--layer-type", "=x", "--hf-overrides"],
    },
    "demo": {
        "missing": "demo reads no input; --out is created when missing",
        "wrong-kind": lambda i: ["--out", i.a_file],
        "unreadable": lambda i: ["--out", _unwritable_dir(i)],
        "out-of-range": lambda i: ["--base", "5"],
    },
    "ple info": {
        "missing": lambda i: [i.fresh("nothing")],
        "wrong-kind": lambda i: [i.a_file],
        "unreadable": lambda i: [_unreadable_shard(i)],
        "out-of-range": "ple info has no flag with a range",
    },
    "ple lookup": {
        "missing": lambda i: [i.fresh("nothing"), "--ids", "0"],
        "wrong-kind": lambda i: [i.a_file, "--ids", "0"],
        "unreadable": lambda i: [_unreadable_shard(i), "--ids", "0,150"],
        "out-of-range": lambda i: [i.sidecar, "--ids", "0,99999999999999999999"],
    },
    "ple preflight": {
        "missing": lambda i: [i.fresh("nothing")],
        "wrong-kind": lambda i: [i.a_file],
        "unreadable": lambda i: [_unreadable_shard(i)],
        "out-of-range": lambda i: [i.sidecar, "--hot-tier", "-1"],
    },
    "ple profile": {
        "missing": lambda i: [i.fresh("nothing"), "--text", profile_inputs(i).text],
        "wrong-kind": lambda i: [profile_inputs(i).sidecar, "--text", i.root],
        "unreadable": lambda i: [profile_inputs(i).sidecar, "--text", _unreadable_file(i)],
        "out-of-range": lambda i: [i.sidecar, "--text", i.a_file, "--rows", "0"],
    },
    "ple warm": {
        "missing": lambda i: [i.fresh("nothing")],
        "wrong-kind": lambda i: [i.a_file],
        "unreadable": lambda i: [_unreadable_shard(i)],
        "out-of-range": "ple warm has no flag with a range",
    },
    "ple slice": {
        "missing": lambda i: [i.fresh("nothing"), i.fresh("dst"), "--tp", "2", "--ranks", "0"],
        "wrong-kind": lambda i: [i.sidecar, i.a_file, "--tp", "2", "--ranks", "0"],
        "unreadable": lambda i: [_unreadable_shard(i), i.fresh("dst"), "--tp", "2", "--ranks", "0"],
        "out-of-range": lambda i: [i.sidecar, i.fresh("dst"), "--tp", "2", "--ranks", "0,2"],
    },
    "ple quantize": {
        "missing": lambda i: [i.fresh("nothing"), i.fresh("dst"), "--format", "int4"],
        "wrong-kind": lambda i: [i.sidecar, i.a_file / "dst", "--format", "int4"],
        "unreadable": lambda i: [_unreadable_config(i), i.fresh("dst"), "--format", "int4"],
        "out-of-range": lambda i: [i.sidecar, i.fresh("dst"), "--format", "int4", "--workers", "0"],
    },
    "validate": {
        "missing": "validate reads no input path; --out is created when missing",
        "wrong-kind": lambda i: [*URL, "--out", i.a_file],
        "unreadable": lambda i: [*URL, "--out", _unwritable_dir(i)],
        "out-of-range": lambda i: [*URL, "--out", i.fresh("report"), "--rounds", "0"],
    },
    "validate compare": {
        "missing": lambda i: [i.fresh("nothing.json"), i.report],
        "wrong-kind": lambda i: [i.root, i.report],
        "unreadable": lambda i: [_unreadable_file(i), i.report],
        "out-of-range": "validate compare has no flag with a range",
    },
}

PLAN_ARGS = ["--gpu-memory", "8GiB"]
AB = ["--baseline", "http://127.0.0.1:1", "--candidate", "http://127.0.0.1:1", "--no-png"]


def _unreadable_index(i: Inputs) -> Path:
    dst = i.fresh("index-unreadable")
    dst.mkdir()
    shutil.copy(i.checkpoint / "model.safetensors.index.json", dst)
    os.chmod(dst / "model.safetensors.index.json", 0)
    return dst


BAD_INPUTS.update(
    {
        "check": {
            "missing": lambda i: ["--model", i.fresh("nothing")],
            "wrong-kind": lambda i: ["--model", i.a_file],
            "unreadable": lambda i: ["--model", _unreadable_config(i)],
            "out-of-range": lambda i: ["--model", i.checkpoint, "--host-memory", "lots"],
        },
        "checkpoint plan": {
            "missing": lambda i: [i.fresh("nothing")],
            "wrong-kind": lambda i: [i.a_file],
            "unreadable": lambda i: [_unreadable_index(i)],
            "out-of-range": "checkpoint plan has no flag with a range",
        },
        "explain": {
            "missing": lambda i: [i.fresh("nothing.log")],
            "wrong-kind": lambda i: [i.root],
            "unreadable": lambda i: [_unreadable_file(i)],
            "out-of-range": lambda i: [i.report, "--tp", "0"],
        },
        "plan": {
            "missing": lambda i: ["--model", i.fresh("nothing"), *PLAN_ARGS],
            "wrong-kind": lambda i: ["--model", i.a_file, *PLAN_ARGS],
            "unreadable": lambda i: ["--model", _unreadable_config(i), *PLAN_ARGS],
            "out-of-range": lambda i: ["--model", i.checkpoint, *PLAN_ARGS, "--tp", "0"],
        },
        "record capture": {
            "missing": lambda i: ["--url", "http://127.0.0.1:1"],
            "wrong-kind": lambda i: ["--url", "http://127.0.0.1:1", "--log", i.root],
            "unreadable": "capture reads a live server; an unreadable /proc entry needs "
            "another user's process (covered by the ProcessError tests)",
            "out-of-range": lambda i: ["--url", "http://127.0.0.1:1", "--pid", "0"],
        },
        "record diff": {
            "missing": lambda i: [i.fresh("nothing.json"), i.fresh("nothing.json")],
            "wrong-kind": lambda i: [i.report, i.report],
            "unreadable": lambda i: [_unreadable_file(i), _unreadable_file(i)],
            "out-of-range": "record diff has no flag with a range",
        },
        "record restore": {
            "missing": lambda i: [i.fresh("nothing.json")],
            "wrong-kind": lambda i: [i.report],
            "unreadable": lambda i: [_unreadable_file(i)],
            "out-of-range": "record restore has no flag with a range",
        },
        "validate ab": {
            "missing": lambda i: [
                *AB,
                "--prompts",
                i.fresh("nothing.jsonl"),
                "--out",
                i.fresh("ab"),
            ],
            "wrong-kind": lambda i: [*AB, "--out", i.a_file],
            "unreadable": lambda i: [*AB, "--prompts", _unreadable_file(i), "--out", i.fresh("ab")],
            "out-of-range": lambda i: [*AB, "--max-tokens", "0", "--out", i.fresh("ab")],
        },
    }
)

COMMANDS = sorted(leaf_commands())
ITEMS = [
    (command, case)
    for command in COMMANDS
    for case in CASES
    if not isinstance(BAD_INPUTS.get(command, {}).get(case), str)
]


def test_every_command_has_every_case():
    for command in COMMANDS:
        table = BAD_INPUTS.get(command)
        assert table is not None, f"add `{command}` to BAD_INPUTS"
        assert set(table) == set(CASES), f"{command}: give every case {CASES}"
        for case, value in table.items():
            assert not isinstance(value, str) or len(value) > 10, (command, case)


@pytest.mark.parametrize(("command", "case"), ITEMS)
def test_bad_input_is_one_line(command, case, cli_inputs, capsys):
    args = BAD_INPUTS[command][case]
    assert callable(args), f"add `{command}` / {case} to BAD_INPUTS"
    argv = [*command.split(), *map(str, args(cli_inputs))]
    if case == "unreadable":
        proc = run(*argv, unprivileged=True)
        code, out, err = proc.returncode, proc.stdout, proc.stderr
    else:
        code, out, err = run_in_process(argv, capsys)
    shown = f"flashnext {' '.join(argv)}\nexit {code}\nstdout:\n{out}\nstderr:\n{err}"
    assert code != 0, shown
    assert "Traceback" not in out + err, shown
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), shown
    if case == "out-of-range":
        assert code == 2 or command == "checkpoint override", shown  # click's usage error


def test_unreadable_really_is_unreadable(cli_inputs):
    """The privilege drop works: the subprocess cannot read a mode-000 file even as root."""
    target = _unreadable_file(cli_inputs)
    proc = run("validate", "compare", target, target, unprivileged=True)
    assert proc.returncode == 2 and f"Path '{target}' is not readable" in proc.stderr, proc.stderr


def _bad_flag_values(model: Path) -> dict[str, list[object]]:
    log = Path(__file__).parent.parent / "plan" / "fixtures" / "vllm-cpu-tiny-qwen2-startup.log"
    closed = "http://127.0.0.1:9"
    plan = ["plan", "--model", model, "--gpu-memory", "96GiB"]
    return {
        "plan --kv-cache-dtype": [*plan, "--kv-cache-dtype", "bogus"],
        "plan --mamba-ssm-cache-dtype": [*plan, "--mamba-ssm-cache-dtype", "f8"],
        "plan --weights-format": [*plan, "--weights-format", "bogus"],
        "plan --gpu-memory 0": ["plan", "--model", model, "--gpu-memory", "0"],
        "plan --gpu-memory unitless": ["plan", "--model", model, "--gpu-memory", "96"],
        "plan --max-model-len": [*plan, "--max-model-len", "12q"],
        "plan cache + device": [*plan, "--ple-device-cache", "1GiB", "--ple-placement", "device"],
        "explain --gpu-memory": ["explain", log, "--gpu-memory", "5"],
        "check --gpu": ["check", "--model", model, "--gpu", "bogus"],
        "check --host-memory": ["check", "--model", model, "--gpu", "sm120", "--host-memory", "5"],
        "check -- --max-model-len": ["check", "--model", model, "--gpu", "sm120", "--",
                                     "--max-model-len", "0"],
        "check -- --max-num-seqs": ["check", "--model", model, "--gpu", "sm120", "--",
                                    "--max-num-seqs", "x"],
        "validate --stages": ["validate", "--url", closed, "--stages", "bogus"],
        "validate --url": ["validate", "--url", "notaurl"],
        "validate --ready-timeout": ["validate", "--url", closed, "--ready-timeout", "nan"],
        "record capture --url": ["record", "capture", "--url", "ftp://x"],
        "validate ab --min-top1": ["validate", "ab", "--baseline", closed, "--min-top1", "2"],
    }  # fmt: skip


def test_bad_flag_values_exit_2_before_any_work(capsys, tmp_path):
    """README's exit-code table: a bad flag value is a usage error, exit 2, one line naming
    the flag, whichever layer checks it (click's types or the library's own parser)."""
    model = Path(__file__).parent.parent / "plan" / "fixtures" / "qwen4exp-published.config.json"
    wrong = {}
    for name, argv in _bad_flag_values(model).items():
        code, _, err = run_in_process(argv, capsys)
        flag = name.split()[1] if name.split()[1].startswith("--") else "--"
        if code != 2 or err.count("\n") != 1 or not err.startswith("error: ") or flag not in err:
            wrong[name] = (code, err[-200:])
    assert not wrong, "\n".join(f"{k}: {v}" for k, v in wrong.items())

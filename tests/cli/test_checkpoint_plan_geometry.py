"""Rule: no silent wrong answer. `checkpoint plan --sidecar` says "ok" only for a sidecar the
plugin would serve: the whole geometry (rows, width, head sizes, offsets, multipliers) of the
layer the sidecar was made for, compared with the plugin's own check, not the row count alone."""

from __future__ import annotations

import copy

import pytest

from flashnext.ple.geometry import PLEGeometry
from flashnext.store.destination import write_sidecar

from ..checkpoint.builder import build_checkpoint
from ..checkpoint.test_download_plan import split_ple_into_own_file
from .runner import run_in_process


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("plan-geometry")
    built = build_checkpoint(root / "ckpt", parts=4, hf_metadata=False)
    split_ple_into_own_file(built)
    return built


def _sidecar(tmp_path, rng, config, name, geometry=True, rows_delta=0):
    geo = PLEGeometry.from_config(config, layer_ordinal=0)
    rows = rng.standard_normal((geo.num_rows + rows_delta, geo.width)).astype("float32")
    path = tmp_path / name
    write_sidecar(
        path, "int4", rows, geo.shard_rows(), geometry=geo.to_dict() if geometry else None
    )
    return path


def _changed(config, **text):
    out = copy.deepcopy(config)
    target = out.get("text_config", out)
    target.update(text)
    return out


def _plan(capsys, ckpt, sidecar):
    """(exit code, stdout, stderr with its lines joined: rich wraps at the console's width,
    where paths of any length fall)."""
    argv = ["checkpoint", "plan", ckpt.root, "--repo", "org/model", "--sidecar", sidecar]
    code, out, err = run_in_process([str(a) for a in argv], capsys)
    return code, out, " ".join(err.split())


def test_own_geometry_is_ok(ckpt, tmp_path, rng, capsys):
    code, _, err = _plan(capsys, ckpt, _sidecar(tmp_path, rng, ckpt.config, "good"))
    assert code == 0, err
    assert "ok: " in err and "its geometry matches config.json" in err


@pytest.mark.parametrize(
    "change, field",
    [
        ({"vocab_size": 1001}, "multipliers"),  # same rows, other hashing
        ({"seed": 4321}, "multipliers"),
        ({"heads_per_ngram": 4}, "rows x"),  # other heads: other width
    ],
)
def test_other_geometry_with_any_row_count_is_refused(ckpt, tmp_path, rng, capsys, change, field):
    other = _changed(ckpt.config, **change)
    code, _, err = _plan(capsys, ckpt, _sidecar(tmp_path, rng, other, "other"))
    assert code == 1, err
    assert "MISMATCH: " in err and field in err and "ok: " not in err


def test_row_count_without_recorded_geometry(ckpt, tmp_path, rng, capsys):
    fine = _sidecar(tmp_path, rng, ckpt.config, "bare", geometry=False)
    code, _, err = _plan(capsys, ckpt, fine)
    assert code == 0 and "ok: " in err and "its row count (its META.json records no" in err, err
    short = _sidecar(tmp_path, rng, ckpt.config, "short", geometry=False, rows_delta=-128)
    code, _, err = _plan(capsys, ckpt, short)
    assert code == 1 and "MISMATCH: " in err, err

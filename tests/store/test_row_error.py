"""Issue 22 rule 4 (quantize): per-row error, so a table-wide RMSE cannot hide destroyed rows.

The quantizer's per-row numbers are checked against a float64 reference computed here from the
written table and the source rows; the outlier table (one 1e5 among ~0.05 values) is refused
for nvfp4 through the CLI, in the summary and in ``--json``.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from flashnext.checkpoint.sources import SidecarSource
from flashnext.host import open_table
from flashnext.store import write_sidecar
from flashnext.store.quantize import quantize_table
from flashnext.store.row_error import BINS_PER_DECADE, RowErrors, summarize
from tests.cli.runner import run_in_process

FORMATS = ("bf16", "fp8", "int4", "nvfp4")


def _outlier_table(rng, rows=2000, width=160) -> tuple[np.ndarray, int]:
    x = (rng.standard_normal((rows, width)) * 0.05).astype(np.float32)
    where = int(rng.integers(rows))
    x[where, int(rng.integers(width))] = 1e5
    return x, where


def _reference(source: np.ndarray, restored: np.ndarray) -> tuple[np.ndarray, int]:
    """float64 relative error per non-zero source row, and rows zeroed from non-zero ones."""
    x = source.astype(np.float64)
    ref = np.linalg.norm(x, axis=1)
    err = np.linalg.norm(restored.astype(np.float64) - x, axis=1)
    live = ref > 0
    zeroed = int((live & ~restored.any(axis=1)).sum())
    return err[live] / ref[live], zeroed


@pytest.mark.parametrize("fmt", FORMATS)
def test_per_row_error_matches_a_float64_reference(tmp_path, rng, fmt):
    x, _ = _outlier_table(rng)
    x[int(rng.integers(len(x)))] = 0.0  # a zero source row is not an error, nor "zeroed"
    write_sidecar(tmp_path / "src", "bf16", x, 500)
    source_rows = open_table(tmp_path / "src", "resident").lookup(np.arange(len(x)))
    result = quantize_table(SidecarSource(tmp_path / "src"), tmp_path / fmt, fmt, 500)
    restored = open_table(tmp_path / fmt, "resident").lookup(np.arange(len(x)))
    rel, zeroed = _reference(source_rows, restored)
    found = result.row_error
    assert found["rows"] == rel.size and found["measured_shards"] == found["shards"] == 4
    assert found["zeroed_rows"] == zeroed
    assert math.isclose(found["worst"], rel.max(), rel_tol=1e-9, abs_tol=1e-12)
    if rel.max() > 0:
        worst_row = found["worst_row"]
        live = np.flatnonzero(np.linalg.norm(source_rows, axis=1) > 0)
        assert rel[np.searchsorted(live, worst_row)] == pytest.approx(rel.max(), rel=1e-9)
    exact = np.sort(rel)[math.ceil(rel.size * 0.999) - 1]
    step = 10 ** (1 / BINS_PER_DECADE)  # the histogram's resolution
    assert exact * (1 - 1e-9) <= found["p99_9"] <= exact * step * (1 + 1e-9)
    assert found["ok"] == (found["worst"] <= 0.5)


def test_nvfp4_outlier_zeroes_rows_and_is_refused_in_the_summary(tmp_path, rng, capsys):
    x, where = _outlier_table(rng)
    write_sidecar(tmp_path / "src", "bf16", x, 500)
    argv = ["ple", "quantize", tmp_path / "src", tmp_path / "n", "--format", "nvfp4"]
    code, out, _ = run_in_process([*argv, "--json"], capsys)
    record = json.loads(out)
    found = record["row_error"]
    assert code == 1 and record["kind"] == "flashnext.ple.quantize" and found["ok"] is False
    # nearly every other row of the outlier's shard falls below nvfp4's smallest block scale
    assert 450 <= found["zeroed_rows"] <= 499 and found["worst"] == 1.0
    assert where // 500 == found["worst_row"] // 500
    assert record["rel_rmse"] < 1e-3  # what the global number alone would have said
    code, out, err = run_in_process(argv, capsys)  # resumed: the verdict comes from META.json
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 1 and lines[-1].startswith("error: ") and "--max-row-error 0.5" in lines[-1]
    zeroed = f"{found['zeroed_rows']:,}"
    assert f"{zeroed} rows quantized to all-zero" in lines[-1], lines[-1]
    assert "row error" in out and f"{zeroed} rows zeroed" in out
    # the table stays on disk; `ple info` says the same and exits 1 (checksums and values ok)
    code, out, err = run_in_process(["ple", "info", tmp_path / "n", "--json"], capsys)
    info = json.loads(out)
    assert code == 1 and info["checksums"] == "ok" and info["values"] == "ok", err
    assert info["row_error"]["zeroed_rows"] == found["zeroed_rows"]
    assert info["problems"] == [
        f"row {found['worst_row']:,} has relative error 1, above the --max-row-error 0.5 this "
        f"table was made with; {zeroed} rows quantized to all-zero from non-zero rows: it does "
        "not hold the source's rows (re-create it in another format)"
    ]
    code, out, _ = run_in_process(["ple", "info", tmp_path / "n"], capsys)
    assert code == 1 and f"{zeroed} rows zeroed: above 0.5" in " ".join(out.split())


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "int4"])
def test_formats_that_hold_the_outlier_table_pass(tmp_path, rng, capsys, fmt):
    x, _ = _outlier_table(rng)
    write_sidecar(tmp_path / "src", "bf16", x, 500)
    argv = ["ple", "quantize", tmp_path / "src", tmp_path / fmt, "--format", fmt, "--json"]
    code, out, err = run_in_process(argv, capsys)
    record = json.loads(out)["row_error"]
    assert code == 0, err
    assert record["ok"] and record["zeroed_rows"] == 0 and record["worst"] < 0.5


def test_threshold_is_the_users_and_resume_keeps_the_verdict(tmp_path, rng, capsys):
    x, _ = _outlier_table(rng)
    write_sidecar(tmp_path / "src", "bf16", x, 500)
    base = ["ple", "quantize", tmp_path / "src", tmp_path / "n", "--format", "nvfp4", "--json"]
    code, out, _ = run_in_process([*base, "--max-row-error", "1"], capsys)
    assert code == 0 and json.loads(out)["row_error"]["max_row_error"] == 1.0
    # `ple info` judges the table by the threshold it was made with
    code, out, _ = run_in_process(["ple", "info", tmp_path / "n", "--json"], capsys)
    assert code == 0 and json.loads(out)["row_error"]["max_row_error"] == 1.0
    # a rerun keeps every shard and judges them again from META.json
    code, out, _ = run_in_process(base, capsys)
    record = json.loads(out)
    assert code == 1 and record["shards_kept"] == 4 and record["row_error"]["worst"] == 1.0


def test_histogram_merge_equals_one_accumulator(rng):
    x = rng.standard_normal((3000, 16)).astype(np.float32)
    noisy = x + rng.standard_normal(x.shape).astype(np.float32) * rng.uniform(0, 0.3, (3000, 1))
    whole, parts = RowErrors(), []
    whole.add(x, noisy, 0)
    for lo in range(0, 3000, 700):
        part = RowErrors()
        part.add(x[lo : lo + 700], noisy[lo : lo + 700], lo)
        parts.append(part.to_record())
    merged, one = summarize(parts), summarize([whole.to_record()])
    assert merged["shards"] == 5 and one["shards"] == 1
    for key in ("worst", "worst_row", "p99_9", "zeroed_rows", "rows", "ok"):
        assert merged[key] == one[key], key

"""`flashnext ple quantize CKPT_DIR ...`: rows straight from a checkpoint in any layout and
format, checked against float64 references; NaN/inf rows refused by row id; SIGKILL + resume
gives the same bytes as an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import ml_dtypes
import numpy as np
import pytest

from flashnext.checkpoint import open_table_source
from flashnext.errors import FormatError, SidecarError
from flashnext.host.table import open_table
from flashnext.store.quantize import STATE_NAME, quantize_table
from flashnext.store.sidecar import META_NAME

from ..cli.runner import popen, run, run_in_process
from .builder import build_checkpoint, rewrite

# rel. RMSE bounds for Gaussian-like rows: bf16 keeps 8 bits, e4m3 3 mantissa bits, 4-bit
# formats ~3 effective bits. Loose enough to never flake, tight enough to catch a wrong scale.
BOUNDS = {"bf16": 4e-3, "fp8": 0.05, "int4": 0.12, "nvfp4": 0.16}


def _rel_rmse(ref: np.ndarray, got: np.ndarray) -> float:
    diff = got.astype(np.float64) - ref
    return float(np.sqrt((diff * diff).sum() / (ref * ref).sum()))


@pytest.mark.parametrize(
    ("src_fmt", "layout", "prefix"),
    [("bf16", "shards", "long"), ("fp8", "whole", "short"), ("nvfp4", "empty-shard", "vl")],
)
def test_quantize_from_checkpoint(tmp_path, capsys, src_fmt, layout, prefix):
    built = build_checkpoint(
        tmp_path / "ck", fmt=src_fmt, layout=layout, prefix=prefix, base=600, ple_layer_ids=(2, 4)
    )
    ref = built.refs[4]
    for fmt in ("bf16", "fp8", "int4", "nvfp4"):
        dst = tmp_path / f"out-{fmt}"
        code, out, _ = run_in_process(
            [
                "ple",
                "quantize",
                str(built.root),
                str(dst),
                "--format",
                fmt,
                "--layer",
                "1",
                "--json",
            ],
            capsys,
        )
        assert code == 0
        summary = json.loads(out)
        with open_table(dst, "mmap") as table:
            assert table.format == fmt and table.num_rows == ref.shape[0]
            got = table.lookup(np.arange(table.num_rows, dtype=np.int64))
        err = _rel_rmse(ref, got)
        assert err < BOUNDS[fmt], (src_fmt, fmt, err)
        if fmt == src_fmt:
            # a lossless copy: the checkpoint's own rows (the float64 value rounded once)
            assert summary["conversion"] == "copy" and summary["rel_rmse"] == 0.0
            np.testing.assert_array_equal(got, ref.astype(np.float32))
        else:
            # the reported rel. RMSE is the one we measure against the float64 source
            assert summary["conversion"] == "quantize"
            assert summary["rel_rmse"] == pytest.approx(err, rel=1e-3, abs=1e-9)
        assert summary["source"]["kind"] == "checkpoint" and summary["source"]["layer_id"] == 4
        meta = json.loads((dst / META_NAME).read_text())
        # output shards follow the checkpoint's split_ngram_parts
        assert meta["num_shards"] == 4 and meta["geometry"]["layer_ordinal"] == 1


def test_parallel_workers_same_bytes(tmp_path):
    built = build_checkpoint(tmp_path / "ck", fmt="nvfp4", layout="shards", base=600)
    src = open_table_source(built.root)
    one = quantize_table(src, tmp_path / "w1", "int4", 1024, workers=1)
    two = quantize_table(src, tmp_path / "w2", "int4", 1024, workers=2)
    assert one.sidecar.num_rows == two.sidecar.num_rows and len(one.sidecar.shards) > 4
    for p in sorted((tmp_path / "w1").iterdir()):
        assert p.read_bytes() == (tmp_path / "w2" / p.name).read_bytes(), p.name


def _poison(built, base, shard, local_row, col, value, kind="weight"):
    name = f"{base}.shard_{shard}.{kind}"
    arr = built.tensors[name].copy()
    arr[local_row, col] = value
    built.tensors[name] = arr
    rewrite(built)


BASE = "model.language_model.layers.1.ple.ple_embedding.ngram_embedding"


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_rows_are_named(tmp_path, bad, rng):
    built = build_checkpoint(tmp_path / "ck", fmt="bf16", base=600)
    S = open_table_source(built.root).rows_per_shard
    local = int(rng.integers(0, S))
    _poison(built, BASE, 2, local, 17, ml_dtypes.bfloat16(bad))
    src = open_table_source(built.root)
    with pytest.raises(FormatError, match=rf"source row {2 * S + local} column 17 is -?(nan|inf)"):
        quantize_table(src, tmp_path / "out", "fp8", S)
    assert not (tmp_path / "out" / META_NAME).exists()


def test_non_finite_nvfp4_block_scale_is_named(tmp_path):
    """A NaN e4m3 block scale (0x7F) poisons 16 columns of one row."""
    built = build_checkpoint(tmp_path / "ck", fmt="nvfp4", base=600)
    S = open_table_source(built.root).rows_per_shard
    nan_e4m3 = np.array(0x7F, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
    _poison(built, BASE, 1, 5, 3, nan_e4m3, kind="weight_scale")
    with pytest.raises(FormatError, match=rf"source row {S + 5} column 48 is nan"):
        quantize_table(open_table_source(built.root), tmp_path / "out", "int4", S)


def test_sigkill_then_resume_is_byte_identical(tmp_path, capsys):
    built = build_checkpoint(tmp_path / "ck", fmt="bf16", layout="whole", base=2000)
    args = ["ple", "quantize", str(built.root)]
    opts = ["--format", "nvfp4", "--rows-per-shard", "2048", "--workers", "2", "--json"]

    # the uninterrupted run
    code, out, _ = run_in_process([*args, str(tmp_path / "clean"), *opts], capsys)
    assert code == 0
    num_shards = json.loads(out)["num_shards"]
    assert num_shards >= 16

    # a run killed (with its worker processes) once at least one shard is recorded as done
    dst = tmp_path / "killed"
    proc = popen(*args, dst, *opts, text=False, start_new_session=True)
    state = dst / STATE_NAME
    deadline = time.monotonic() + 120  # the first shard; a loaded machine is slow
    done = 0
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                done = len(json.loads(state.read_text())["shards"])
            except (OSError, ValueError, KeyError):
                done = 0
            if done >= 1:
                break
            time.sleep(0.005)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()[-2000:]
    # killed mid-run: some shards recorded, not all, no META.json
    recorded = len(json.loads(state.read_text())["shards"])
    assert 1 <= recorded < num_shards and not (dst / META_NAME).exists()

    # the same command again resumes and finishes
    rerun = run(*args, dst, *opts, timeout=60)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    summary = json.loads(rerun.stdout)
    assert summary["shards_kept"] >= recorded and summary["shards_written"] >= 1
    assert summary["shards_kept"] + summary["shards_written"] == num_shards

    clean = sorted(p.name for p in (tmp_path / "clean").iterdir())
    assert sorted(p.name for p in dst.iterdir()) == clean  # no temp files or state left
    for name in clean:
        assert (dst / name).read_bytes() == (tmp_path / "clean" / name).read_bytes(), name


def test_rerun_keeps_shards_unless_the_checkpoint_changed(tmp_path):
    built = build_checkpoint(tmp_path / "ck", fmt="bf16", base=400)
    first = quantize_table(open_table_source(built.root), tmp_path / "out", "fp8", 1024)
    again = quantize_table(open_table_source(built.root), tmp_path / "out", "fp8", 1024)
    assert first.shards_written == again.shards_kept > 1 and again.shards_written == 0
    # a re-downloaded table file (new mtime): nothing from the old run may be trusted, and
    # the finished output is not overwritten without --force
    f = built.path_of(f"{BASE}.shard_0.weight")
    st = f.stat()
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    with pytest.raises(SidecarError, match=rf"source changed since \({f.name}\).*--force"):
        quantize_table(open_table_source(built.root), tmp_path / "out", "fp8", 1024)
    redo = quantize_table(open_table_source(built.root), tmp_path / "out", "fp8", 1024, force=True)
    assert redo.shards_kept == 0 and redo.shards_written == first.shards_written


_MEASURE = """
import sys
from flashnext.checkpoint import open_table_source
from flashnext.store.quantize import quantize_table

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024

from flashnext.store.quantize_kernels import compiled_matches_reference, load_kernels

src = open_table_source(sys.argv[1])
src.read_rows(0, 4096)  # warm up numpy/ml_dtypes allocations
compiled_matches_reference()
load_kernels()  # code, not data
base = status("VmRSS:")
quantize_table(src, sys.argv[2], "bf16", src.rows_per_shard, block_rows=4096)
print(base, status("VmHWM:"))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux /proc for VmHWM")
def test_memory_is_bounded_by_block_not_table(tmp_path):
    """Peak RSS grows by about a block and an output shard, never by the table."""
    built = build_checkpoint(tmp_path / "ck", fmt="bf16", base=20000, parts=16, files=2)
    table_f32 = built.refs[2].shape[0] * 160 * 4  # ~205 MB as float32
    run = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(built.root), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    base, peak = (int(v) for v in run.stdout.split())
    # one 4096-row block with its float64 error terms (~20 MB) + one output shard (~6.5 MB)
    assert peak - base < table_f32 // 4, (base, peak, table_f32)

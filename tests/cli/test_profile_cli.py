"""`flashnext ple profile`, `ple preflight`, `ple warm` and `ple lookup --warm` on real files.

The profile is checked against a plain-Python hash of the same tokens (FACTS.md's formula,
written out here independently of flashnext.ple.hashing).
"""

from __future__ import annotations

import json
import re
import shutil
from collections import Counter

import numpy as np
import pytest

from flashnext.host import open_table
from flashnext.host.preflight import GIB
from flashnext.store.profile import load_profile

from ..host.test_preflight_fixtures import _limited
from .inputs import ProfileInputs, build_profile_inputs
from .runner import run_in_process


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> ProfileInputs:
    return build_profile_inputs(tmp_path_factory.mktemp("profile") / "in")


def _reference_counts(geo: dict, tokens: list[int]) -> Counter:
    """Row id counts of one fresh request, hashed with Python ints (no numpy)."""
    eos, n_max = geo["eos_token_id"], geo["ngram_size"]
    counts: Counter = Counter()
    for t in range(len(tokens)):
        window, cut = [tokens[t]], False
        for i in range(1, n_max):
            v = tokens[t - i] if t - i >= 0 else eos
            v = eos if cut else v
            cut = cut or v == eos
            window.append(v)
        for h in range(geo["num_heads"]):
            mixed = 0
            for i in range(h // geo["heads_per_ngram"] + 2):
                mixed ^= window[i] * geo["multipliers"][i]
            counts[geo["offsets"][h] + mixed % geo["sizes"][h]] += 1
    return counts


def test_profile_matches_a_plain_python_hash(inputs, tmp_path, capsys):
    import tokenizers

    out = tmp_path / "p" / "hot.safetensors"
    argv = inputs.argv()
    code, stdout, err = run_in_process([*argv, "--output", out, "--json"], capsys)
    assert code == 0, err
    summary = json.loads(stdout)
    profile = load_profile(out)
    geo = json.loads((inputs.sidecar / "META.json").read_text())["geometry"]
    tok = tokenizers.Tokenizer.from_file(str(inputs.tokenizer))
    tokens = tok.encode(inputs.text.read_text(), add_special_tokens=False).ids
    ref = _reference_counts(geo, tokens)
    expected = sorted(ref.items(), key=lambda kv: (-kv[1], kv[0]))
    assert profile.row_ids.tolist() == [k for k, _ in expected]
    assert profile.counts.tolist() == [v for _, v in expected]
    assert profile.total_lookups == len(tokens) * geo["num_heads"] == summary["total_lookups"]
    corpus = profile.meta["corpus"]
    assert corpus[0]["tokens"] == len(tokens) and len(corpus[0]["sha256"]) == 64
    assert profile.meta["tokenizer"]["kind"] == "file" and summary["coverage_of_lookups"] == 1.0


def test_rows_default_path_and_its_consumers(inputs, tmp_path, capsys):
    sidecar = tmp_path / "sidecar"
    shutil.copytree(inputs.sidecar, sidecar)
    argv = ["ple", "profile", sidecar, "--text", inputs.text, "--tokenizer", inputs.tokenizer]
    code, stdout, err = run_in_process([*argv, "--rows", "50"], capsys)
    assert code == 0, err
    assert "rows kept" in stdout and "50 of" in stdout and "hashing text" in err
    profile = load_profile(sidecar)  # sidecar.profile.safetensors beside the directory
    assert len(profile) == 50 and np.all(np.diff(profile.counts) <= 0)
    with open_table(sidecar, hot_tier=profile) as table:
        assert table.hot_tier_rows == 50
    assert not (sidecar / "profile.safetensors").exists()  # never inside an input
    for hot in ("50", str(tmp_path / "sidecar.profile.safetensors")):
        code, stdout, err = run_in_process(["ple", "preflight", sidecar, "--hot-tier", hot], capsys)
        assert code == 0 and "50 rows, 5.0 KB" in stdout, stdout + err


def test_tokenizer_from_the_local_hub_cache_and_offline_failure(
    inputs, tmp_path, monkeypatch, capsys
):
    snap = tmp_path / "hub" / "models--org--tiny" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    shutil.copy(inputs.tokenizer, snap / "tokenizer.json")
    (tmp_path / "hub" / "models--org--tiny" / "refs").mkdir()
    (tmp_path / "hub" / "models--org--tiny" / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    base = ["ple", "profile", inputs.sidecar, "--text", inputs.text, "--output", tmp_path / "o"]
    code, stdout, err = run_in_process([*base, "--tokenizer", "org/tiny", "--json"], capsys)
    assert code == 0, err
    assert json.loads(stdout)["tokenizer"] == {
        "kind": "hub-cache",
        "path": str(snap / "tokenizer.json"),
        "vocab_size": 400,
    }
    code, _, err = run_in_process([*base, "--tokenizer", "org/absent"], capsys)
    assert code == 1 and err.count("\n") == 1
    assert (
        err.startswith("error: --tokenizer org/absent: not a tokenizer.json")
        and "nothing is downloaded" in err
    )


def test_default_demo_tokenizer_refuses_another_vocabulary(inputs, tmp_path, capsys):
    argv = ["ple", "profile", inputs.sidecar, "--text", inputs.text, "--output", tmp_path / "o"]
    code, _, err = run_in_process(argv, capsys)
    assert code == 1 and "the demo tokenizer (vocab 8192, EOS 0) does not match" in err, err


@pytest.mark.parametrize("reclaimable, code", [(int(0.2 * GIB), 1), (6 * GIB, 0)])
def test_preflight_command_on_a_captured_host(inputs, tmp_path, capsys, reclaimable, code):
    host = _limited(tmp_path, "v2", reclaimable)  # limit 8 GiB, usage 7.5 GiB
    argv = ["ple", "preflight", inputs.sidecar, "--residency", "resident", "--host-root", host]
    got, stdout, err = run_in_process(argv, capsys)
    assert got == code, stdout + err
    if code:
        assert "verdict           refused" in stdout
        refusal = " ".join(err.split())  # the refusal goes to stderr, the table to stdout
        # a small table in the unit that shows it (issue 42), never "0.0 GiB"
        said = r"needs \d+\.\d [KM]iB plus 2\.0 GiB headroom, but only 0\.7 GiB is available"
        assert re.search(said, refusal), refusal
    got, stdout, _ = run_in_process([*argv, "--json"], capsys)
    record = json.loads(stdout)
    assert record["ok"] is (code == 0) and record["memory"]["cgroup"]["version"] == "v2"


def test_warm_reads_every_row_byte_and_lookup_warm_matches(inputs, capsys):
    code, stdout, err = run_in_process(["ple", "warm", inputs.sidecar, "--json"], capsys)
    assert code == 0, err
    with open_table(inputs.sidecar) as table:
        expected = sum(length for _, _, length in table.file_ranges())
    assert json.loads(stdout)["bytes"] == expected > 0
    ids = ["ple", "lookup", inputs.sidecar, "--ids", "0,17,-1", "--json"]
    cold = json.loads(run_in_process(ids, capsys)[1])["rows"]
    code, stdout, err = run_in_process([*ids, "--warm"], capsys)
    assert code == 0 and json.loads(stdout)["rows"] == cold


def test_default_tokenizer_is_the_demo_bpe_for_a_demo_table(inputs, tmp_path, capsys):
    from flashnext.ple.geometry import PLEGeometry
    from flashnext.store import write_sidecar
    from flashnext.synthetic import flash_next_config

    config = flash_next_config(8192, 0, ngram_vocab_size_base=100, split_ngram_parts=2)
    geo = PLEGeometry.from_config(config)  # flashnext demo's vocabulary and EOS, fewer rows
    rows = np.zeros((geo.num_rows, geo.width), np.float32)
    write_sidecar(tmp_path / "demo", "int4", rows, geo.shard_rows(), geometry=geo.to_dict())
    argv = ["ple", "profile", tmp_path / "demo", "--text", inputs.text, "--json"]
    code, stdout, err = run_in_process(argv, capsys)
    assert code == 0, err
    assert json.loads(stdout)["tokenizer"] == {"kind": "demo", "vocab_size": 8192}
    assert load_profile(tmp_path / "demo").total_lookups > 0


def test_warm_fills_the_page_cache_after_eviction(inputs, tmp_path, capsys):
    import os

    from flashnext.host.preflight import page_cache_bytes

    sidecar = tmp_path / "sidecar"
    shutil.copytree(inputs.sidecar, sidecar)
    shards = sorted(sidecar.glob("shard_*.safetensors"))
    for path in shards:
        with open(path, "rb") as fh:
            os.fsync(fh.fileno())
            os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    if sum(page_cache_bytes(p) for p in shards):
        pytest.skip(f"{tmp_path}: this file system keeps its pages (tmpfs?); nothing to evict")
    code, stdout, err = run_in_process(["ple", "warm", sidecar, "--json"], capsys)
    assert code == 0, err
    record = json.loads(stdout)
    assert record["cached_before_bytes"] < record["file_bytes"]  # opening read the headers only
    assert (
        record["cached_after_bytes"]
        == record["file_bytes"]
        == sum(p.stat().st_size for p in shards)
    )

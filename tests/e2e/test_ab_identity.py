"""Plugin off vs a bf16 sidecar of the model's own table (environment and --additional-config):
identical answers through ``flashnext validate ab``; and the negative controls: another table of
the same geometry makes the A/B fail, another geometry stops the server at start."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from devtools.e2e.servers import ServerPool, log_text

from .conftest import IDENTITY_TOKENS, summary, validate_ab, wave

PLUGIN_LINE = "flashnext plugin: ple_sidecar: model.layers.0.ple.ple_embedding.ngram_embedding <- "


@pytest.fixture(scope="module")
def servers(pool: ServerPool) -> Iterator[ServerPool]:
    yield from wave(pool, "identity", "formats")


def _assert_identical(code: int, record: dict) -> None:
    s = record["summary"]
    assert code == 0, json.dumps(record["verdict"])
    assert record["verdict"]["status"] == "identical", json.dumps(record["verdict"])
    assert s["errors"] == 0 and s["identical"] == s["prompts"] == 3
    assert s["tf_positions"] > 0, "nothing was teacher-forced: KL 0 would mean nothing"
    assert s["kl"]["max"] == 0.0 and s["top1_agreement"] == 1.0


@pytest.mark.parametrize("candidate", ["bf16_env", "bf16_cfg"])
def test_bf16_sidecar_of_the_own_table_answers_identically(
    servers: ServerPool,
    sidecars: dict[str, Path],
    ab_records: dict[str, dict],
    candidate: str,
    tmp_path: Path,
) -> None:
    off, on = servers.healthy("off"), servers.healthy(candidate)
    code, record = validate_ab(off, on, tmp_path / "ab", IDENTITY_TOKENS)
    ab_records[candidate] = record
    print(f"\nE2E-AB {candidate} {json.dumps(summary(record))}")
    _assert_identical(code, record)
    # The rows really came from the sidecar: the plugin says so in the serving process.
    assert PLUGIN_LINE + str(sidecars["bf16"]) + " (bf16" in log_text(on)
    assert "flashnext plugin" not in log_text(off)


def test_another_table_of_the_same_geometry_fails_the_ab(
    servers: ServerPool, sidecars: dict[str, Path], ab_records: dict[str, dict], tmp_path: Path
) -> None:
    off, other = servers.healthy("off"), servers.healthy("other_table")
    assert PLUGIN_LINE + str(sidecars["other"]) in log_text(other)
    code, record = validate_ab(off, other, tmp_path / "ab")
    ab_records["other_table"] = record
    print(f"\nE2E-AB other_table {json.dumps(summary(record))}")
    assert code == 1, json.dumps(record["verdict"])
    assert record["verdict"]["status"] == "fail"
    assert record["summary"]["kl"]["mean"] > 0.01


def test_another_geometry_stops_the_server_at_start_naming_both(
    servers: ServerPool, sidecars: dict[str, Path]
) -> None:
    code, log = servers.exited("other_geometry")
    assert code != 0
    ours = json.loads((sidecars["geometry"] / "META.json").read_text())["num_rows"]
    model = json.loads((sidecars["bf16"] / "META.json").read_text())["num_rows"]
    assert ours != model
    lines = [
        line
        for line in log.splitlines()
        if "PluginError" in line and str(sidecars["geometry"]) in line
    ]
    assert lines, log[-3000:]
    assert f"{ours} rows" in lines[-1] and f"{model} rows" in lines[-1], lines[-1]

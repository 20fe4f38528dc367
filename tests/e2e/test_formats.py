"""What each sidecar format does to the tiny model's answers: int4, nvfp4 and fp8 sidecars of its
own table vs plugin off, through ``flashnext validate ab`` (greedy first difference and token
agreement; teacher-forced top-1 and KL) against plugin off's recorded answers. nvfp4's sidecar
comes through ``--additional-config``, the others' through ``FLASHNEXT_PLE_SIDECAR``. The numbers
are BENCHMARKS.md's per-format table; the test prints them as its rows (``pytest -s``)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from devtools.e2e.servers import ServerPool, log_text

from .conftest import summary, validate_ab, validate_abs, wave
from .test_ab_identity import PLUGIN_LINE


@pytest.fixture(scope="module")
def servers(pool: ServerPool) -> Iterator[ServerPool]:
    yield from wave(pool, "formats", "loader")


@pytest.fixture(scope="module")
def format_abs(
    request: pytest.FixtureRequest,
    servers: ServerPool,
    off_answers: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, tuple[int, dict]]:
    """The selected formats' A/Bs against plugin off's answers, side by side."""
    formats = {
        item.callspec.params["fmt"]
        for item in request.session.items
        if getattr(item, "module", None) is request.module and hasattr(item, "callspec")
    }
    candidates = {f: servers.healthy(f) for f in sorted(formats)}
    return validate_abs(off_answers, candidates, tmp_path_factory.mktemp("formats-ab"))


def _control_kl(
    servers: ServerPool, ab_records: dict[str, dict], off_answers: Path, tmp_path: Path
) -> float:
    """Mean KL of the wrong-table control (run here when the identity module did not run)."""
    if "other_table" not in ab_records:
        other = servers.healthy("other_table")
        _, ab_records["other_table"] = validate_ab(off_answers, other, tmp_path / "control")
    return float(ab_records["other_table"]["summary"]["kl"]["mean"])


@pytest.mark.parametrize("fmt", ["int4", "nvfp4", "fp8"])
def test_quantized_sidecar_ab_is_recorded_and_closer_than_a_wrong_table(
    servers: ServerPool,
    sidecars: dict[str, Path],
    ab_records: dict[str, dict],
    format_abs: dict[str, tuple[int, dict]],
    off_answers: Path,
    fmt: str,
    tmp_path: Path,
) -> None:
    assert PLUGIN_LINE + str(sidecars[fmt]) + f" ({fmt}" in log_text(servers.healthy(fmt))
    code, record = format_abs[fmt]
    ab_records[fmt] = record
    row = summary(record)
    print(f"\nE2E-AB {fmt} {json.dumps(row)}")
    assert code in (0, 1) and record["summary"]["errors"] == 0, json.dumps(record["verdict"])
    assert record["summary"]["tf_positions"] > 0
    # Quantization noise moves the distributions less than serving another table does.
    assert row["mean_kl"] < _control_kl(servers, ab_records, off_answers, tmp_path)

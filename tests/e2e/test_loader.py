"""The loader fix, served: the tiny model's own table as the empty shard index
``ngram_embedding.shard_.weight`` (stock vLLM refuses it with its own error, shown inside real
vLLM by tests/integrations/test_loader_vllm.py, with no server to boot; with
``FLASHNEXT_PLE_LOADER_FIX=1`` the answers are identical to the numbered-shard checkpoint's,
plugin off's recorded answers), and an FP8 table with one global ``weight_scale`` (loads and
answers with the fix)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from devtools.e2e.servers import ServerPool, log_text

from .conftest import summary, validate_abs, wave
from .test_ab_identity import assert_identical

#: The plugin's line saying it installed the loader fix.
LOADER_LINE = re.compile(r"flashnext plugin: .*loader fix installed", re.IGNORECASE)


@pytest.fixture(scope="module")
def servers(pool: ServerPool) -> Iterator[ServerPool]:
    yield from wave(pool, "loader", "override")


@pytest.fixture(scope="module")
def loader_abs(
    request: pytest.FixtureRequest,
    servers: ServerPool,
    off_answers: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, tuple[int, dict]]:
    """The selected tests' A/Bs against plugin off's answers, side by side."""
    tests = {
        "test_loader_fix_serves_the_empty_shard_table_identically": "fix_empty_shard",
        "test_loader_fix_loads_an_fp8_table_with_a_global_weight_scale": "fix_fp8",
    }
    wanted = sorted({tests[i.name] for i in request.session.items if i.name in tests})
    candidates = {n: servers.healthy(n) for n in wanted}
    return validate_abs(off_answers, candidates, tmp_path_factory.mktemp("loader-ab"))


def test_loader_fix_serves_the_empty_shard_table_identically(
    servers: ServerPool, loader_abs: dict[str, tuple[int, dict]]
) -> None:
    fixed = servers.healthy("fix_empty_shard")
    assert LOADER_LINE.search(log_text(fixed)), log_text(fixed)[-3000:]
    assert_identical(*loader_abs["fix_empty_shard"])


def test_loader_fix_loads_an_fp8_table_with_a_global_weight_scale(
    servers: ServerPool, ab_records: dict[str, dict], loader_abs: dict[str, tuple[int, dict]]
) -> None:
    fp8 = servers.healthy("fix_fp8")
    assert LOADER_LINE.search(log_text(fp8)), log_text(fp8)[-3000:]
    code, record = loader_abs["fix_fp8"]
    ab_records["fix_fp8"] = record
    print(f"\nE2E-AB fp8-global-scale-checkpoint {json.dumps(summary(record))}")
    assert code in (0, 1) and record["summary"]["errors"] == 0, json.dumps(record["verdict"])
    # e4m3 rows with one scale are close to the bf16 table, not another table.
    assert record["summary"]["top1_agreement"] > 0.5

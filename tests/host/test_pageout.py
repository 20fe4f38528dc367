"""Which agents page out a table's page cache on their own (flashnext.host.pageout), read from a
DAMON sysfs tree captured on the development VM (tests/host/fixtures/preflight/damon_pageout),
and what `ple preflight` says about them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from flashnext.host.pageout import page_cache_pageout
from flashnext.host.preflight import host_memory, preflight_table
from flashnext.store.destination import write_sidecar

from ..cli.runner import run_in_process
from ..seeding import seeded_rng

FIXTURES = Path(__file__).parent / "fixtures" / "preflight"
SCHEME = "sys/kernel/mm/damon/admin/kdamonds/0/contexts/0/schemes/0"


@pytest.fixture
def host(tmp_path: Path) -> Path:
    root = tmp_path / "host"
    shutil.copytree(FIXTURES / "no_cgroup", root)
    shutil.copytree(FIXTURES / "damon_pageout", root, dirs_exist_ok=True)
    return root


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory, request) -> Path:
    path = tmp_path_factory.mktemp("pageout") / "int4"
    rows = seeded_rng(request.node.nodeid).standard_normal((300, 160), dtype=np.float32)
    write_sidecar(path, "int4", rows, 100)
    return path


def _write(root: Path, rel: str, text: str) -> None:
    (root / rel).write_text(text + "\n")


def test_the_captured_scheme_pages_out_unmapped_page_cache_after_60_s(host):
    (agent,) = page_cache_pageout(host)
    assert agent.source == "DAMON (kdamond 0, scheme 0)"
    assert agent.min_age_s == 60.0  # 12 aggregations of 5 s
    assert agent.bytes_per_s == 128 * 2**20  # 128 MiB per 1,000 ms
    assert agent.unmapped_only  # "not anon", then "allow unmapped": mapped pages are spared
    assert agent.describe() == (
        "DAMON (kdamond 0, scheme 0) pages out page cache that no process maps unread for 60 s, "
        "up to 128 MiB/s"
    )


@pytest.mark.parametrize(
    ("rel", "text"),
    [
        ("sys/kernel/mm/damon/admin/kdamonds/0/state", "off"),
        (f"{SCHEME}/action", "stat"),
        ("sys/kernel/mm/damon/admin/kdamonds/0/contexts/0/operations", "vaddr"),
        (f"{SCHEME}/ops_filters/0/allow", "Y"),  # "anon only": page cache never
    ],
    ids=["kdamond-off", "not-pageout", "virtual-space", "anon-only"],
)
def test_schemes_that_leave_page_cache_alone_are_not_named(host, rel, text):
    _write(host, rel, text)
    if rel.endswith("ops_filters/0/allow"):  # the one filter "allow anon": file pages rejected
        shutil.rmtree(host / SCHEME / "ops_filters/1")
    assert page_cache_pageout(host) == ()


def test_a_scheme_without_filters_takes_mapped_pages_too(host):
    shutil.rmtree(host / SCHEME / "ops_filters")
    (agent,) = page_cache_pageout(host)
    assert not agent.unmapped_only


def test_the_reclaim_module_counts_and_no_damon_at_all_is_nothing(tmp_path, host):
    params = host / "sys/module/damon_reclaim/parameters"
    params.mkdir(parents=True)
    for name, value in (("enabled", "Y"), ("min_age", "120000000"), ("quota_sz", "134217728"),
                        ("quota_reset_interval_ms", "1000")):  # fmt: skip
        _write(params, name, value)
    agents = page_cache_pageout(host)
    assert [a.min_age_s for a in agents] == [60.0, 120.0] and not agents[1].unmapped_only
    bare = tmp_path / "bare"
    shutil.copytree(FIXTURES / "no_cgroup", bare)
    assert page_cache_pageout(bare) == () and host_memory(bare).pageout == ()


def test_preflight_warns_a_memory_mapped_table_and_not_a_resident_one(host, tmp_path):
    memory = host_memory(host)
    mapped = preflight_table(1 << 30, "mmap", "/ples (int4)", memory=memory)
    assert mapped.ok
    assert any("warm /ples (int4) (flashnext ple warm) less than 60 s before" in w
               for w in mapped.warnings), mapped.warnings  # fmt: skip
    assert preflight_table(1 << 30, "resident", "/ples (int4)", memory=memory).warnings == ()
    assert mapped.to_dict()["memory"]["pageout"][0]["min_age_s"] == 60.0


def test_ple_preflight_prints_the_pageout_warning(host, sidecar, capsys):
    argv = ["ple", "preflight", str(sidecar), "--host-root", str(host)]
    code, stdout, err = run_in_process(argv, capsys)
    assert code == 0, err
    assert "pages out page cache that no process maps unread for 60 s" in " ".join(err.split())
    code, stdout, err = run_in_process([*argv, "--json"], capsys)
    assert code == 0 and json.loads(stdout)["memory"]["pageout"][0]["unmapped_only"] is True

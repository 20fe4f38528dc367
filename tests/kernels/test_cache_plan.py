"""The device cache's plan without a GPU: size settings, the profile, rows, bytes, hit rate."""

from __future__ import annotations

import numpy as np
import pytest

from flashnext.errors import PluginError
from flashnext.kernels.cache_plan import find_profile, parse_cache_size, plan_cache
from flashnext.ple.profile import HotRowProfile, write_profile


@pytest.mark.parametrize(
    ("text", "size"),
    [("0", 0), ("2GiB", 2 << 30), ("512MiB", 512 << 20), ("1.5GB", 1_500_000_000),
     ("4096", 4096), (" 3 gib ", 3 << 30), (123, 123)],
)
def test_sizes(text, size):
    assert parse_cache_size(text) == size


@pytest.mark.parametrize("text", ["2 GiBs", "-1", "lots", "", "1e9", True, -5])
def test_bad_sizes_name_the_switch(text):
    with pytest.raises(PluginError, match=r"^FLASHNEXT_PLE_CACHE=.*(expected a size|0 \(off\))"):
        parse_cache_size(text)


@pytest.fixture
def profile(rng):
    ids = rng.permutation(10_000)[:3_000].astype(np.int64)
    counts = np.sort(rng.integers(1, 1000, size=ids.size))[::-1].astype(np.int64)
    return HotRowProfile(ids, counts, int(counts.sum()) + 5_000)  # some lookups unprofiled


def test_plan_follows_the_set_hot_rows_rule(profile, tmp_path):
    write_profile(tmp_path, profile)  # the sidecar's own hot_rows.safetensors
    lo, hi = 2_000, 7_000
    plan = plan_cache(tmp_path, 100 * 1000 + 99, 100, (lo, hi), "staged")
    inside = (profile.row_ids >= lo) & (profile.row_ids < hi)
    kept = profile.counts[inside][:1000]
    assert plan.rows == 1000 and plan.device_bytes == 100 * 1000
    assert plan.expected_hit_rate == pytest.approx(kept.sum() / profile.counts[inside].sum())
    assert plan.profile == tmp_path / "hot_rows.safetensors"
    assert "expected hit rate" in plan.describe()
    pinned = plan_cache(tmp_path, 10**9, 100, (lo, hi), "pinned", profile=profile)
    assert pinned.rows == int(inside.sum())  # the whole profile fits
    assert pinned.device_bytes == 100 * pinned.rows + 4 * (hi - lo)  # + the device slot map
    assert pinned.expected_hit_rate == pytest.approx(1.0)
    nvfp4 = plan_cache(tmp_path, 900, 90, (0, 10_000), "staged", scale_2=True)
    assert nvfp4.rows == 10 and nvfp4.device_bytes == 10 * 90 + 4 * 10


def test_off_and_refusals(profile, tmp_path):
    assert plan_cache(tmp_path, 0, 100, (0, 10), "device").describe() == "no device cache"
    with pytest.raises(PluginError, match=r"needs a hot-row profile: .*hot_rows\.safetensors"):
        find_profile(tmp_path, None)
    with pytest.raises(PluginError, match="not 'device'"):
        plan_cache(tmp_path, 1 << 20, 100, (0, 10), "device", profile=profile)

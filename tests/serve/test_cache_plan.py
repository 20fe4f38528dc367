"""The device cache's plan without a GPU: the size setting, and the GPU bytes of the rows kept.

The profile lookup, the hit rate and the per-layer plan are tested in tests/serve/test_serving.py
(with real sidecars and profiles); here, the parts no other test pins down.
"""

from __future__ import annotations

import numpy as np
import pytest

from flashnext.errors import PluginError
from flashnext.serve.cache_plan import SLOT_MAP_BYTES, parse_cache_size, plan_cache
from flashnext.store.profile import RowProfile


@pytest.mark.parametrize(
    ("text", "size"),
    [("0", 0), ("2GiB", 2 << 30), ("512MiB", 512 << 20), ("1.5GB", 1_500_000_000),
     ("4096B", 4096), (" 3 gib ", 3 << 30), (0, 0)],
)  # fmt: skip
def test_sizes(text, size):
    assert parse_cache_size(text) == size


@pytest.mark.parametrize(
    "text", ["4096", "2 GiBs", "-1", "-1GiB", "lots", "", "1e9", True, -5, 1.5, 123]
)
def test_bad_sizes_name_the_switch(text):
    # A bare number other than 0 could be bytes or GiB: refused like every size flag.
    with pytest.raises(PluginError, match=r"^FLASHNEXT_PLE_DEVICE_CACHE=.*: expected a cache size"):
        parse_cache_size(text)


@pytest.fixture
def profile(rng):
    ids = rng.permutation(10_000)[:3_000].astype(np.int64)
    counts = np.sort(rng.integers(1, 1000, size=ids.size))[::-1].astype(np.int64)
    return RowProfile(ids, counts, int(counts.sum()))


def test_device_bytes_follow_the_placement(profile, tmp_path):
    lo, hi = 2_000, 7_000
    inside = (profile.row_ids >= lo) & (profile.row_ids < hi)
    staged = plan_cache(profile, None, 100 * 1000 + 99, 100, (lo, hi), 10_000, placement="staged")
    assert staged.rows == 1000 and staged.device_bytes == 100 * 1000  # slot map in host RAM
    pinned = plan_cache(profile, None, 10**9, 100, (lo, hi), 10_000, placement="pinned")
    assert pinned.rows == int(inside.sum())  # the whole profile's share fits
    assert pinned.device_bytes == 100 * pinned.rows + SLOT_MAP_BYTES * (hi - lo)
    assert pinned.expected_hit_rate == pytest.approx(1.0)
    nvfp4 = plan_cache(profile, None, 900, 90, (0, 10_000), 10_000, placement="staged",
                       scale_2=True)  # fmt: skip
    assert nvfp4.rows == 10 and nvfp4.device_bytes == 10 * 90 + 4 * 10  # + scale_2 per row

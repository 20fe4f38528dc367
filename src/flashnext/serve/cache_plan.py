"""The device cache in front of a pinned or staged table, planned without a GPU.

What the plugin's ``FLASHNEXT_PLE_DEVICE_CACHE=SIZE`` / ``FLASHNEXT_PLE_PROFILE=PATH`` switches mean, in
the one place the plugin (:mod:`flashnext.serve.serving`), ``flashnext plan`` and ``flashnext
check`` share (no torch, no vLLM, no GPU):

- :func:`parse_cache_size`: the size (``2GiB``, ``512MiB``, ``1.5GB``; ``0`` = off, the one
  number without a unit), read by :mod:`flashnext.sizes` like every size.
- :func:`profile_path`: which profile fills a layer's cache (the setting's file, its
  ``layer_L`` entry when it is a directory, else the sidecar's own: ``SIDECAR.profile.safetensors``
  beside it, where ``flashnext ple profile`` writes, or ``profile.safetensors`` inside it).
- :func:`plan_cache`: how many rows of a rank's range the cache holds (``GpuTable.set_device_cache``
  / ``StagedTable.set_device_cache``' rule), the GPU bytes they take and the hit rate the profile
  itself predicts (a truncated profile's unprofiled lookups count as misses).
- :func:`plan_layer_cache`: all of that for one served layer, refusing a profile made for
  another table (its geometry against the sidecar's META.json).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flashnext.errors import PluginError
from flashnext.kernels._layout import (  # the cache's layout, declared with the kernels'
    HIT_BLOCK,
    HIT_LINE_BYTES,
    MEMO_LINE_BYTES,
    MEMO_LINES,
    SLOT_MAP_BYTES,
    rows_that_fit,
)
from flashnext.sizes import SIZE_HINT, SizeError, byte_count, gib

if TYPE_CHECKING:
    from flashnext.store.profile import RowProfile
    from flashnext.store.sidecar import Sidecar

#: The 0-based decoder index in a layer's name (``model.layers.3.ple...`` -> 3).
LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def staged_cache_host_bytes(rows: int, ranks: int = 1) -> int:
    """Host RAM of the device caches in front of a staged table whose ``rows`` rows ``ranks``
    ranks serve, one cache each: the int32 slot maps and hit indexes (4.17 bytes per row) and a
    group memo per cache (64 MiB), committed, not reclaimable."""
    return (SLOT_MAP_BYTES * rows + HIT_LINE_BYTES * -(-rows // HIT_BLOCK)
            + ranks * MEMO_LINES * MEMO_LINE_BYTES)  # fmt: skip


#: Placements a device cache can stand in front of (``device`` is all on the GPU already).
CACHED_PLACEMENTS = ("pinned", "staged")


def parse_cache_size(value: object, where: str = "FLASHNEXT_PLE_DEVICE_CACHE") -> int:
    """Bytes from ``2GiB``, ``512MiB``, ``1.5GB``, or ``0`` (off; text or a JSON number).

    A size needs its unit, as every size flag does (:mod:`flashnext.sizes`): ``0`` is the one
    bare number, in text or as ``--additional-config``'s JSON number.

    Raises:
        PluginError: naming ``where`` and the value, when it is not a size.
    """
    if type(value) is int and value == 0:
        return 0
    if isinstance(value, str):
        try:
            return byte_count(value)
        except SizeError:
            pass
    raise PluginError(f"{where}={value!r}: expected a cache size, {SIZE_HINT}, or 0 for off")


def slot_map_on_device(placement: str) -> bool:
    """Whether the cache's slot map takes GPU memory (pinned) or host RAM (staged)."""
    return placement == "pinned"


@dataclass(frozen=True)
class CachePlan:
    """The device cache in front of one layer's pinned or staged rows.

    Attributes:
        cache_bytes: device bytes asked for cached records (``FLASHNEXT_PLE_DEVICE_CACHE``;
            0 = off).
        profile: the profile file that fills it, or None (no cache then).
        rows: rows of this rank's range that fit (the profile's order, ``cache_bytes //
            record_bytes`` at most).
        expected_hit_rate: the share of this rank's profiled lookups those rows serve (from
            the profile's own counts), or None with no cache.
        reason: why there is no cache, when there is none.
        device_bytes: GPU bytes the cache takes: records, plus the slot map in front of a
            pinned table, plus nvfp4 ``scale_2`` (4 bytes per cached row) of a staged one.
    """

    cache_bytes: int
    profile: Path | None
    rows: int = 0
    expected_hit_rate: float | None = None
    reason: str = ""
    device_bytes: int = 0

    def describe(self) -> str:
        """One phrase for the plugin's start line."""
        if self.expected_hit_rate is None:
            return f"no device cache ({self.reason})"
        return (
            f"device cache {gib(self.cache_bytes)} = {self.rows} rows from "
            f"{self.profile}, expected hit rate {100 * self.expected_hit_rate:.1f}%"
        )


def profile_path(sidecar_dir: Path, setting: Path | None, prefix: str) -> Path | None:
    """The profile for the layer ``prefix`` serves from ``sidecar_dir``.

    ``setting`` (``FLASHNEXT_PLE_PROFILE``) is a profile file, or a directory read like the
    sidecar root (``layer_{L}.profile.safetensors``, ``layer_{L}/profile.safetensors`` or
    ``profile.safetensors`` in it). None means the sidecar's own profile when it has one:
    ``SIDECAR.profile.safetensors`` beside it (where ``flashnext ple profile`` writes), else
    ``profile.safetensors`` inside it (``flashnext ple slice``); either also under its old
    name ``hot_rows.safetensors`` (:func:`~flashnext.store.profile.profile_files`).

    Raises:
        PluginError: ``setting`` is given but holds no profile for this layer.
    """
    from flashnext.store.profile import OLD_PROFILE_NAME, PROFILE_NAME, profile_files

    if setting is None:
        candidates = profile_files(sidecar_dir)
    elif setting.is_file():
        candidates = [setting]
    else:
        match = LAYER_INDEX.search(prefix)
        layer = [setting / f"layer_{match.group(1)}"] if match else []
        candidates = [p for d in layer for p in profile_files(d)]
        candidates += [setting / PROFILE_NAME, setting / OLD_PROFILE_NAME]
    found = next((p for p in candidates if p.is_file()), None)
    if found is None and setting is not None:
        raise PluginError(
            f"FLASHNEXT_PLE_PROFILE={setting}: no profile for {prefix} (expected a "
            f"profile file, or {PROFILE_NAME} in that directory, in its layer_L or beside it as "
            f"layer_L.{PROFILE_NAME}); build one with `flashnext ple profile SIDECAR --text "
            "FILES...`"
        )
    return found


def plan_cache(
    profile: RowProfile,
    path: Path | None,
    cache_bytes: int,
    record_bytes: int,
    row_range: tuple[int, int],
    num_rows: int,
    *,
    placement: str = "staged",
    scale_2: bool = False,
) -> CachePlan:
    """How many of ``profile``'s rows a cache of ``cache_bytes`` holds for ``row_range``, the
    GPU bytes they take, and the share of the rank's lookups they serve.

    The rows kept follow ``set_device_cache``' rule (profile order, rows inside the range,
    ``cache_bytes // record_bytes`` of them). The hit rate's denominator is the profiled lookups
    of this range: the profile's counts inside it, plus the lookups of rows the profile left
    out (``total_lookups`` less every count) in the range's share of the table's rows.

    Args:
        profile: the profile (row ids int64 ``[n]`` in priority order, counts ``[n]``).
        path: its file, for the description.
        cache_bytes, record_bytes: the cache size and one row's record bytes.
        row_range: this rank's rows ``[start, end)``; num_rows: the table's rows.
        placement: ``pinned`` (slot map on the GPU) or ``staged`` (slot map in host RAM).
        scale_2: the format keeps nvfp4 ``scale_2`` per cached row on the GPU (staged).
    """
    import numpy as np  # lazily: serving's import stays light

    ids = np.asarray(profile.row_ids, dtype=np.int64)
    counts = np.asarray(profile.counts, dtype=np.int64)
    lo, hi = row_range
    mine = counts[(ids >= lo) & (ids < hi)]
    kept = rows_that_fit(ids, row_range, cache_bytes, record_bytes).size
    unprofiled = max(0, int(profile.total_lookups) - int(counts.sum()))
    share = (hi - lo) / max(1, num_rows)
    lookups = int(mine.sum()) + unprofiled * share
    rate = float(mine[:kept].sum()) / lookups if lookups > 0 else 0.0
    device = kept * record_bytes
    if slot_map_on_device(placement):
        device += SLOT_MAP_BYTES * (hi - lo)
    elif scale_2:
        device += 4 * kept
    return CachePlan(cache_bytes, path, kept, rate, device_bytes=device)


def plan_layer_cache(
    sidecar: Sidecar,
    prefix: str,
    cache_bytes: int,
    setting: Path | None,
    row_range: tuple[int, int],
    placement: str,
) -> tuple[CachePlan, Any]:
    """The cache plan of one layer and the profile that fills it (None when there is no cache).

    Raises:
        PluginError: the profile asked for is missing or was made for another table.
        SidecarError: the profile file is not a valid profile.
    """
    from flashnext.kernels.records import record_layout
    from flashnext.store.profile import load_profile

    path = None
    if cache_bytes <= 0:
        reason = "FLASHNEXT_PLE_DEVICE_CACHE is 0"
    elif placement not in CACHED_PLACEMENTS:
        reason = f"the {placement} path has none"
    else:
        path = profile_path(sidecar.path, setting, prefix)
        reason = f"no FLASHNEXT_PLE_PROFILE and no profile beside or in {sidecar.path}"
    plan, profile = CachePlan(max(0, cache_bytes), None, reason=reason), None
    if path is not None:
        profile = load_profile(path)
        check_profile_table(profile, path, sidecar)
        record_bytes = record_layout(sidecar.codec, sidecar.width).record_bytes
        plan = plan_cache(profile, path, cache_bytes, record_bytes, row_range, sidecar.num_rows,
                          placement=placement, scale_2=sidecar.format == "nvfp4")  # fmt: skip
    return plan, profile


def check_profile_table(profile: RowProfile, path: Path, sidecar: Sidecar) -> None:
    """Refuse a profile made for another table than ``sidecar`` (geometry or row count).

    Raises:
        PluginError: naming the profile and the sidecar.
    """
    meta = profile.meta if isinstance(profile.meta, Mapping) else {}
    geometry = meta.get("geometry")
    # Through JSON as the profile's record was, so tuples and lists compare equal.
    ours = json.loads(json.dumps(sidecar.geometry.to_dict())) if sidecar.geometry else None
    rows = geometry.get("num_rows") if isinstance(geometry, dict) else None
    if ours is not None and isinstance(geometry, dict) and geometry != ours:
        raise PluginError(
            f"profile {path} was made for another PLE table than sidecar {sidecar.path} "
            "(their geometries differ: another layer or model); profile this sidecar with "
            "`flashnext ple profile`"
        )
    top = int(profile.row_ids.max()) if len(profile) else -1
    if top >= sidecar.num_rows or (rows is not None and rows != sidecar.num_rows):
        raise PluginError(
            f"profile {path} names rows up to {max(top, (rows or 0) - 1)}, but sidecar "
            f"{sidecar.path} has {sidecar.num_rows} rows; profile this sidecar"
        )

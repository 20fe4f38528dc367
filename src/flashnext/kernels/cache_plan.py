"""The device cache a server puts in front of a pinned or staged table, planned without a GPU.

What the plugin's ``FLASHNEXT_PLE_CACHE=SIZE`` / ``FLASHNEXT_PLE_PROFILE=PATH`` switches mean,
in one place that the plugin, ``flashnext plan`` and ``flashnext check`` can share (no torch, no
vLLM): :func:`parse_cache_size` reads the size (``0`` = off; ``2GiB``, ``512MiB``, ``1.5GB`` or
plain bytes), :func:`plan_cache` finds the profile (the given file, else the sidecar's
``hot_rows.safetensors``) and works out, with the size rule of ``GpuTable.set_hot_rows`` /
``StagedTable.set_hot_rows``, how many rows the cache holds for a rank's row range, the GPU bytes
it takes (records; plus the 4-byte-per-row slot map on the device for a pinned table, nvfp4
``scale_2`` for a staged one) and the hit rate the profile itself predicts for those rows.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from flashnext.errors import PluginError
from flashnext.ple.profile import PROFILE_NAME, HotRowProfile, load_profile

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}  # fmt: skip
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_cache_size(value: object, where: str = "FLASHNEXT_PLE_CACHE") -> int:
    """Bytes from ``0``, ``2GiB``, ``512MiB``, ``1.5GB`` or an integer byte count.

    Raises:
        PluginError: naming ``where`` and the value, when it is not a size.
    """
    if isinstance(value, bool):
        raise PluginError(f"{where}={value!r}: expected a size like 2GiB, 512MiB or 0 (off)")
    if isinstance(value, int):
        size = value
    else:
        m = _SIZE.match(str(value))
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise PluginError(f"{where}={value!r}: expected a size like 2GiB, 512MiB or 0 (off)")
        size = int(float(m.group(1)) * _UNITS[unit])
    if size < 0:
        raise PluginError(f"{where}={value!r}: a cache size is 0 (off) or more bytes")
    return size


@dataclass(frozen=True)
class CachePlan:
    """The cache for one rank's rows: ``rows`` from ``profile``, ``device_bytes`` of GPU
    memory, ``expected_hit_rate`` (0..1) the profile predicts for this rank's lookups."""

    cache_bytes: int
    profile: Path | None
    rows: int
    device_bytes: int
    expected_hit_rate: float

    def describe(self) -> str:
        """One phrase for the plugin's start line."""
        if self.rows == 0:
            return "no device cache"
        return (
            f"device cache {self.device_bytes / 2**30:.2f} GiB: {self.rows:,} hot rows from "
            f"{self.profile}, expected hit rate {self.expected_hit_rate:.1%} (the profile's own "
            "coverage)"
        )


def find_profile(sidecar: str | os.PathLike[str], profile: str | os.PathLike[str] | None) -> Path:
    """The profile file: ``profile`` if given, else ``hot_rows.safetensors`` in the sidecar.

    Raises:
        PluginError: neither exists (the fix is named).
    """
    path = Path(profile) if profile is not None else Path(sidecar) / PROFILE_NAME
    if path.is_file() or (path.is_dir() and (path / PROFILE_NAME).is_file()):
        return path
    raise PluginError(
        f"a device cache needs a hot-row profile: {path} does not exist; set "
        f"FLASHNEXT_PLE_PROFILE=PATH or build one with `flashnext ple profile {sidecar} --text FILE`"
    )


def plan_cache(
    sidecar: str | os.PathLike[str],
    cache_bytes: int,
    record_bytes: int,
    row_range: tuple[int, int],
    placement: str,
    profile: str | os.PathLike[str] | HotRowProfile | None = None,
    scale_2: bool = False,
) -> CachePlan:
    """Plan the cache for rows ``row_range`` of ``sidecar`` served ``placement``-style.

    Args:
        sidecar: the layer's sidecar directory (where the default profile lives).
        cache_bytes: the size setting in bytes (0 = off).
        record_bytes: bytes per row record of the sidecar's format.
        row_range: ``(start, end)`` rows this rank serves.
        placement: ``pinned`` (slot map on the GPU) or ``staged`` (slot map in host RAM).
        profile: a profile path, an opened profile, or None (the sidecar's own).
        scale_2: the format carries nvfp4 ``scale_2`` per staged row (4 bytes each).

    Raises:
        PluginError: a placement with no cache, or no profile to be found.
        SidecarError: the profile file is not a valid profile.
    """
    if cache_bytes <= 0:
        return CachePlan(0, None, 0, 0, 0.0)
    if placement not in ("pinned", "staged"):
        raise PluginError(
            f"a device cache serves the pinned and staged placements, not {placement!r}"
        )
    if isinstance(profile, HotRowProfile):
        path, prof = None, profile
    else:
        path = find_profile(sidecar, profile)
        prof = load_profile(path)
    lo, hi = row_range
    inside = (prof.row_ids >= lo) & (prof.row_ids < hi)
    counts = prof.counts[inside]
    rows = min(int(counts.size), cache_bytes // record_bytes)
    total = int(counts.sum(dtype=np.int64))
    hit = float(counts[:rows].sum(dtype=np.int64)) / total if total else 0.0
    device = rows * record_bytes
    device += 4 * (hi - lo) if placement == "pinned" else (4 * rows if scale_2 else 0)
    return CachePlan(cache_bytes, path, rows, device, hit)

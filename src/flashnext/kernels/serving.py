"""Serving policy for a sidecar's rows, without vLLM: which sidecar, whether it fits, where placed.

The vLLM plugin (:mod:`flashnext.integrations.vllm.ple_layer`) builds vLLM's layer around
:class:`SidecarRows`; ``flashnext plan`` and ``flashnext check`` can ask the same questions
(:func:`choose_placement`, :func:`check_geometry`) without a GPU. Nothing here imports torch,
triton, vLLM or numba when the module is imported: the table and the GPU kernels are imported
when :func:`open_rows` or :class:`SidecarRows` first need them.

Placement and residency words are :mod:`flashnext.placement`'s. A CPU device is not a placement:
there the rows are looked up on the host (:meth:`PLETable.lookup`), path ``"cpu"``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from flashnext.errors import PluginError
from flashnext.placement import PLACEMENT_SETTINGS, Placement, Residency

if TYPE_CHECKING:
    from flashnext.ple.geometry import PLEGeometry
    from flashnext.ple.sidecar import Sidecar
    from flashnext.ple.table import PLETable

#: The 0-based decoder index in a layer's name (``model.layers.3.ple...`` -> 3).
LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")
#: The serving path: a placement on a GPU, or ``cpu`` (host lookups on a CPU device).
ServingPath = Placement | Literal["cpu"]


# -- where the rows come from --------------------------------------------------------------
def sidecar_dir_for(root: Path, prefix: str) -> Path:
    """The sidecar of the layer named ``prefix``: ``root/layer_{L}`` or ``root`` itself.

    ``L`` is the 0-based decoder index in ``prefix`` (``model.layers.{L}.ple...``).

    Raises:
        PluginError: neither exists.
    """
    match = LAYER_INDEX.search(prefix)
    candidate = root / f"layer_{match.group(1)}" if match else None
    if candidate is not None and candidate.is_dir():
        return candidate
    if (root / "META.json").is_file() or (root / "shard_0.safetensors").is_file():
        return root
    wanted = f"{candidate} or " if candidate is not None else ""
    raise PluginError(
        f"FLASHNEXT_PLE_SIDECAR={root}: no sidecar for {prefix}: expected {wanted}a sidecar in "
        f"{root} itself (one sidecar per PLE layer, named layer_L by the 0-based decoder index "
        "of the checkpoint's tensor names)"
    )


def check_geometry(
    sidecar: Sidecar, prefix: str, num_rows: int, width: int, model: PLEGeometry | None
) -> None:
    """Refuse a sidecar whose rows, width or hashing geometry differ from the layer's.

    Args:
        sidecar: the opened sidecar.
        prefix: the layer's name, for messages.
        num_rows, width: the layer's table shape ``[num_rows, width]``.
        model: the layer's geometry from the model config, or None when unknown (then only
            the shape is compared; so too when the sidecar's META.json records no geometry).

    Raises:
        PluginError: naming the sidecar's and the model's values.
    """
    if (sidecar.num_rows, sidecar.width) != (num_rows, width):
        raise PluginError(
            f"sidecar {sidecar.path} holds {sidecar.num_rows} rows x {sidecar.width}, but the "
            f"model's {prefix} is {num_rows} rows x {width}: quantize this layer's table "
            "(flashnext ple quantize) for this model"
        )
    ours = sidecar.geometry
    if model is None or ours is None:
        return
    for name in ("num_heads", "width", "num_rows", "sizes", "offsets", "multipliers"):
        a, b = getattr(ours, name), getattr(model, name)
        if a != b:
            raise PluginError(
                f"sidecar {sidecar.path} was made for another PLE geometry than the model's "
                f"{prefix}: {name} is {a} in its META.json, {b} from the model config "
                f"(layer ordinal {model.layer_ordinal})"
            )


def layer_geometry(config: Mapping[str, Any] | None, prefix: str) -> PLEGeometry | None:
    """The geometry of the layer named ``prefix`` from a model's text config (a dict).

    Returns None when there is no config or ``prefix`` names no decoder layer.

    Raises:
        PluginError: the config does not describe a valid PLE geometry for this layer.
    """
    from flashnext.ple.geometry import PLEGeometry

    match = LAYER_INDEX.search(prefix)
    if config is None or match is None:
        return None
    try:
        return PLEGeometry.from_config(dict(config), layer_id=int(match.group(1)) + 1)
    except Exception as exc:  # GeometryError: say which layer
        raise PluginError(f"{prefix}: the model config's PLE geometry: {exc}") from exc


# -- where the rows are served from ----------------------------------------------------------
@dataclass(frozen=True)
class PlacementChoice:
    """Where a layer's rows are served from (a placement, or ``cpu``), and why."""

    placement: ServingPath
    reason: str


def choose_placement(
    setting: str, device: Any, table_bytes: int, device_free: int | None = None
) -> PlacementChoice:
    """Pick the serving path for ``table_bytes`` of records (this rank's rows).

    Args:
        setting: ``auto``, ``device``, ``pinned`` or ``staged`` (:data:`PLACEMENT_SETTINGS`).
        device: the device the model is built on: a torch device or its name (``cuda:0``,
            ``cpu``); only its name is read.
        table_bytes: bytes of this rank's per-row records.
        device_free: free GPU bytes, or None when unknown (``device`` is then not refused).

    ``auto``: pinned host memory (UVA) when the host preflight says it fits, else staged from a
    memory map; ``device`` (GPU memory) only when asked, since it takes GPU memory vLLM would
    give the KV cache. On a CPU device the table is looked up on the host (path ``cpu``).

    Raises:
        PluginError: an unknown setting, or ``device`` asked but ``device_free`` bytes cannot
            hold the table.
        PreflightError: ``pinned`` asked but host memory cannot hold it.
    """
    from flashnext.ple.preflight import DEFAULT_HEADROOM, PreflightError, check_fits

    if setting not in PLACEMENT_SETTINGS:
        raise PluginError(f"placement {setting!r}: expected one of {', '.join(PLACEMENT_SETTINGS)}")
    if str(device).split(":", 1)[0] == "cpu":
        return PlacementChoice("cpu", "a CPU device: PLETable.lookup on the host")
    what = f"{table_bytes / 2**30:.2f} GiB of PLE rows"
    if setting == "device":
        if device_free is not None and table_bytes + DEFAULT_HEADROOM > device_free:
            raise PluginError(
                f"FLASHNEXT_PLE_PLACEMENT=device: {what} plus 2 GiB headroom do not fit in the "
                f"{device_free / 2**30:.1f} GiB free on {device}; use pinned or staged"
            )
        return PlacementChoice("device", "asked for")
    if setting == "pinned":
        check_fits(table_bytes, f"pinned host memory for {what}")
        return PlacementChoice("pinned", "asked for")
    if setting == "staged":
        return PlacementChoice("staged", "asked for")
    try:
        check_fits(table_bytes, f"pinned host memory for {what}")
    except PreflightError as exc:
        return PlacementChoice("staged", f"auto: pinned does not fit ({exc})")
    return PlacementChoice("pinned", "auto: fits in host memory")


def host_residency(choice: PlacementChoice, setting: str) -> Residency:
    """How the host table behind ``choice`` holds its rows.

    ``resident`` only for a CPU device whose setting asked for the rows in memory (``device``
    or ``pinned``): the closest a host lookup comes to that. Everything else maps the shards
    (the GPU placements copy or stage from the map themselves).
    """
    return "resident" if choice.placement == "cpu" and setting in ("device", "pinned") else "mmap"


# -- the device cache of hot rows -------------------------------------------------------------
@dataclass(frozen=True)
class CachePlan:
    """The hot-row device cache in front of one layer's pinned or staged rows.

    Attributes:
        cache_bytes: device bytes asked for cached records (``FLASHNEXT_PLE_CACHE``; 0 = off).
        profile: the hot-row profile file that fills it, or None (no cache then).
        rows: rows of this rank's range that fit (the profile's order, ``cache_bytes //
            record_bytes`` at most).
        expected_hit_rate: the share of this rank's profiled lookups those rows serve (from
            the profile's own counts), or None with no cache.
        reason: why there is no cache, when there is none.
    """

    cache_bytes: int
    profile: Path | None
    rows: int = 0
    expected_hit_rate: float | None = None
    reason: str = ""

    def describe(self) -> str:
        """One phrase for the plugin's start line."""
        if self.expected_hit_rate is None:
            return f"no device cache ({self.reason})"
        return (
            f"device cache {self.cache_bytes / 2**30:.2f} GiB = {self.rows} hot rows from "
            f"{self.profile}, expected hit rate {100 * self.expected_hit_rate:.1f}%"
        )


def profile_path(sidecar_dir: Path, setting: Path | None, prefix: str) -> Path | None:
    """The hot-row profile for the layer ``prefix`` serves from ``sidecar_dir``.

    ``setting`` (``FLASHNEXT_PLE_PROFILE``) is a profile file, or a directory read like the
    sidecar root (``layer_{L}/hot_rows.safetensors``, ``layer_{L}.hot_rows.safetensors`` or
    ``hot_rows.safetensors`` in it). None means the sidecar's own profile when it has one:
    ``SIDECAR.hot_rows.safetensors`` beside it (where ``flashnext ple profile`` writes), else
    ``hot_rows.safetensors`` inside it (earlier versions, and ``flashnext ple slice``).

    Raises:
        PluginError: ``setting`` is given but holds no profile for this layer.
    """
    from flashnext.ple.profile import PROFILE_NAME, default_profile_path

    if setting is None:
        own = [default_profile_path(sidecar_dir), sidecar_dir / PROFILE_NAME]
        return next((p for p in own if p.is_file()), None)
    if setting.is_file():
        return setting
    match = LAYER_INDEX.search(prefix)
    layer = [setting / f"layer_{match.group(1)}"] if match else []
    candidates = [d / PROFILE_NAME for d in layer] + [default_profile_path(d) for d in layer]
    for candidate in [*candidates, setting / PROFILE_NAME]:
        if candidate.is_file():
            return candidate
    raise PluginError(
        f"FLASHNEXT_PLE_PROFILE={setting}: no hot-row profile for {prefix} (expected a profile "
        f"file, or {PROFILE_NAME} in that directory, in its layer_L or beside it as "
        f"layer_L.{PROFILE_NAME}); build one with `flashnext ple profile SIDECAR --text FILES...`"
    )


def plan_cache(
    profile: Any,
    path: Path,
    cache_bytes: int,
    record_bytes: int,
    row_range: tuple[int, int],
    num_rows: int,
) -> CachePlan:
    """How many of ``profile``'s rows a cache of ``cache_bytes`` holds for ``row_range``, and
    the share of the rank's lookups they serve.

    The rows kept follow ``GpuTable.set_hot_rows``'s rule (profile order, rows inside the range,
    ``cache_bytes // record_bytes`` of them). The hit rate's denominator is the profiled lookups
    of this range: the profile's counts inside it, plus the lookups of rows the profile left
    out (``total_lookups`` less every count) in the range's share of the table's rows.

    Args:
        profile: a :class:`~flashnext.ple.profile.HotRowProfile`.
        path: its file, for the description.
        cache_bytes, record_bytes: the cache size and one row's record bytes.
        row_range: this rank's rows; num_rows: the table's rows.
    """
    import numpy as np

    ids = np.asarray(profile.row_ids, dtype=np.int64)
    counts = np.asarray(profile.counts, dtype=np.int64)
    inside = (ids >= row_range[0]) & (ids < row_range[1])
    ids, counts = ids[inside], counts[inside]
    kept = min(ids.size, max(0, cache_bytes) // max(1, record_bytes))
    unprofiled = max(0, int(profile.total_lookups) - int(np.asarray(profile.counts).sum()))
    share = (row_range[1] - row_range[0]) / max(1, num_rows)
    lookups = int(counts.sum()) + unprofiled * share
    rate = float(counts[:kept].sum()) / lookups if lookups > 0 else 0.0
    return CachePlan(cache_bytes, path, kept, rate)


def plan_layer_cache(
    sidecar: Sidecar,
    prefix: str,
    cache_bytes: int,
    setting: Path | None,
    row_range: tuple[int, int],
    placement: ServingPath,
) -> tuple[CachePlan, Any]:
    """The cache plan of one layer and the profile that fills it (None when there is no cache).

    Raises:
        PluginError: the profile asked for is missing or was made for another table.
        SidecarError: the profile file is not a valid profile.
    """
    from flashnext.kernels.records import record_layout
    from flashnext.ple.profile import load_profile

    if cache_bytes <= 0:
        return CachePlan(0, None, reason="FLASHNEXT_PLE_CACHE is 0"), None
    if placement not in ("pinned", "staged"):
        return CachePlan(cache_bytes, None, reason=f"the {placement} path has none"), None
    path = profile_path(sidecar.path, setting, prefix)
    if path is None:
        why = f"no FLASHNEXT_PLE_PROFILE and no hot-row profile beside or in {sidecar.path}"
        return CachePlan(cache_bytes, None, reason=why), None
    profile = load_profile(path)
    _check_profile_table(profile, path, sidecar)
    record_bytes = record_layout(sidecar.codec, sidecar.width).record_bytes
    plan = plan_cache(profile, path, cache_bytes, record_bytes, row_range, sidecar.num_rows)
    return plan, profile


def _check_profile_table(profile: Any, path: Path, sidecar: Sidecar) -> None:
    geometry = profile.meta.get("geometry") if hasattr(profile.meta, "get") else None
    import json

    # Through JSON as the profile's record was, so tuples and lists compare equal.
    ours = json.loads(json.dumps(sidecar.geometry.to_dict())) if sidecar.geometry else None
    rows = geometry.get("num_rows") if isinstance(geometry, dict) else None
    if ours is not None and isinstance(geometry, dict) and geometry != ours:
        raise PluginError(
            f"hot-row profile {path} was made for another PLE table than sidecar {sidecar.path} "
            "(their geometries differ: another layer or model); profile this sidecar with "
            "`flashnext ple profile`"
        )
    top = int(profile.row_ids.max()) if len(profile) else -1
    if top >= sidecar.num_rows or (rows is not None and rows != sidecar.num_rows):
        raise PluginError(
            f"hot-row profile {path} names rows up to {max(top, (rows or 0) - 1)}, but sidecar "
            f"{sidecar.path} has {sidecar.num_rows} rows; profile this sidecar"
        )


def attach_cache(target: Any, profile: Any, cache_bytes: int) -> Any:
    """Fill the device cache of a pinned ``GpuTable`` or a ``StagedTable`` from ``profile``.

    Both take the same call, ``set_hot_rows(profile, cache_bytes)``: the one place the
    plugin's cache switch meets the kernels. Returns their ``CacheInfo``.

    Raises:
        PluginError: ``target`` has no device cache (a staged table of a flashnext built before
            the staged cache existed).
    """
    if not hasattr(target, "set_hot_rows"):
        raise PluginError(
            f"{type(target).__name__} has no device cache in this flashnext; set "
            "FLASHNEXT_PLE_CACHE=0 or use FLASHNEXT_PLE_PLACEMENT=pinned"
        )
    return target.set_hot_rows(profile, cache_bytes)


# -- the rows object the plugin calls ------------------------------------------------------
class SidecarRows:
    """This rank's rows of one sidecar, looked up into bf16 ``[N, heads * width]``.

    Args:
        table: the opened table (its ``row_range`` is this rank's rows).
        choice: the serving path (:func:`choose_placement`).
        device: the torch device the lookups run on.
        max_ids: the most ids one staged lookup takes (``staged`` sizes its buffers by it).
        cache: the hot-row cache (:func:`plan_layer_cache`) and its profile; pinned and staged
            only, ignored elsewhere.
    """

    def __init__(
        self,
        table: PLETable,
        choice: PlacementChoice,
        device: Any,
        max_ids: int,
        cache: tuple[CachePlan, Any] | None = None,
    ):
        self.table = table
        self.choice = choice
        self.device = device
        self.cache = cache[0] if cache else CachePlan(0, None, reason="not asked for")
        self._gpu: Any = None
        self._staged: Any = None
        if choice.placement in ("device", "pinned"):
            from flashnext.kernels import GpuTable

            self._gpu = GpuTable.from_table(
                table, choice.placement, row_range=table.row_range, device=device
            )
        elif choice.placement == "staged":
            from flashnext.kernels import StagedTable

            self._staged = StagedTable(table, max_ids=max(1, max_ids), device=device)
        target = self._gpu if choice.placement == "pinned" else self._staged
        if cache is not None and cache[1] is not None and target is not None:
            attach_cache(target, cache[1], cache[0].cache_bytes)

    def lookup(self, ids: Any, out: Any) -> None:
        """Fill ``out`` (torch bf16 ``[N, heads * width]``, contiguous) with the rows of ``ids``
        (torch int64 ``[N, heads]``, global row ids; rows outside this rank's range give 0)."""
        if self._gpu is not None:
            self._gpu.lookup(ids, out=out)
        elif self._staged is not None:
            batch = self._staged.stage(ids.cpu().numpy())
            self._staged.lookup(batch, out=out)
        else:
            self._host_lookup(ids, out)

    def _host_lookup(self, ids: Any, out: Any) -> None:
        import numpy as np

        from flashnext._extras import require
        from flashnext.ple.formats import BF16

        torch = require("torch", "vllm", "the vLLM plugin's PLE layer")
        host = np.empty((*ids.shape, self.table.width), dtype=BF16)
        self.table.lookup(ids.cpu().numpy(), out=host, dtype=BF16)
        out.copy_(torch.from_numpy(host.view(np.uint16)).view(torch.bfloat16).flatten(-2))


def open_rows(
    root: Path,
    prefix: str,
    shape: tuple[int, int],
    row_range: tuple[int, int],
    geometry: PLEGeometry | None,
    setting: str,
    device: Any,
    device_free: int | None,
    max_ids: int,
    cache_bytes: int = 0,
    profile: Path | None = None,
) -> tuple[SidecarRows, Sidecar]:
    """Find, check, place and open the sidecar rows the layer named ``prefix`` serves.

    Args:
        root: ``FLASHNEXT_PLE_SIDECAR`` (:func:`sidecar_dir_for`).
        prefix: the layer's name.
        shape: the layer's table ``(num_rows, width)``.
        row_range: this rank's rows ``[start, end)``.
        geometry: the layer's geometry from the model config, or None.
        setting: the placement setting (``auto`` ... ``staged``).
        device: the torch device the model is built on.
        device_free: free GPU bytes, or None.
        max_ids: the most ids one lookup takes.
        cache_bytes: the hot-row device cache (``FLASHNEXT_PLE_CACHE``; 0 = off).
        profile: ``FLASHNEXT_PLE_PROFILE`` (:func:`profile_path`), or None.

    Raises:
        PluginError: no sidecar for the layer, a geometry mismatch, a placement that cannot fit,
            or a cache profile that is missing or made for another table.
        SidecarError: the sidecar directory is not a valid sidecar.
        PreflightError: a pinned or resident copy does not fit in host memory.
    """
    from flashnext.kernels.records import record_layout
    from flashnext.ple.sidecar import open_sidecar
    from flashnext.ple.table import open_table

    sidecar = open_sidecar(sidecar_dir_for(root, prefix))
    check_geometry(sidecar, prefix, shape[0], shape[1], geometry)
    record_bytes = record_layout(sidecar.codec, sidecar.width).record_bytes
    table_bytes = (row_range[1] - row_range[0]) * record_bytes
    choice = choose_placement(setting, device, table_bytes, device_free)
    cache = plan_layer_cache(sidecar, prefix, cache_bytes, profile, row_range, choice.placement)
    table = open_table(sidecar, host_residency(choice, setting), row_range=row_range)
    return SidecarRows(table, choice, device, max_ids, cache), sidecar

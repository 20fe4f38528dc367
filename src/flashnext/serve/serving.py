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

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

from flashnext.errors import PluginError
from flashnext.kernels.rows import Rows
from flashnext.placement import PLACEMENT_SETTINGS, Placement, Residency
from flashnext.serve.cache_plan import LAYER_INDEX, CachePlan, plan_layer_cache
from flashnext.sizes import gib

if TYPE_CHECKING:
    from flashnext.host.preflight import HostMemory
    from flashnext.host.table import PLETable
    from flashnext.ple.geometry import PLEGeometry
    from flashnext.store.sidecar import Sidecar

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
    found = candidate if candidate is not None and candidate.is_dir() else None
    one = (root / "META.json").is_file() or (root / "shard_0.safetensors").is_file()
    if found is None and one:
        found = root
    if found is None:
        wanted = f"{candidate} or " if candidate is not None else ""
        raise PluginError(
            f"FLASHNEXT_PLE_SIDECAR={root}: no sidecar for {prefix}: expected {wanted}a sidecar "
            f"in {root} itself (one sidecar per PLE layer, named layer_L by the 0-based decoder "
            "index of the checkpoint's tensor names)"
        )
    return found


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
    compared = ("num_heads", "width", "num_rows", "sizes", "offsets", "multipliers")
    for name in compared if model is not None and ours is not None else ():
        a, b = getattr(ours, name), getattr(model, name)
        if model is not None and a != b:
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
    geometry = None
    if config is not None and match is not None:
        try:
            geometry = PLEGeometry.from_config(dict(config), layer_id=int(match.group(1)) + 1)
        except Exception as exc:  # GeometryError: say which layer
            raise PluginError(f"{prefix}: the model config's PLE geometry: {exc}") from exc
    return geometry


# -- where the rows are served from ----------------------------------------------------------
@dataclass(frozen=True)
class PlacementChoice:
    """Where a layer's rows are served from (a placement, or ``cpu``), and why."""

    placement: ServingPath
    reason: str


def choose_placement(
    setting: str,
    device: Any,
    table_bytes: int,
    device_free: int | None = None,
    memory: HostMemory | None = None,
) -> PlacementChoice:
    """Pick the serving path for ``table_bytes`` of records (this rank's rows): the plugin's own
    choice, which ``flashnext plan --ple-placement auto`` asks too.

    Args:
        setting: ``auto``, ``device``, ``pinned`` or ``staged`` (:data:`PLACEMENT_SETTINGS`).
        device: the device the model is built on: a torch device or its name (``cuda:0``,
            ``cpu``); only its name is read.
        table_bytes: bytes of this rank's per-row records.
        device_free: free GPU bytes, or None when unknown (``device`` is then not refused).
        memory: the host memory to judge ``pinned`` by (``flashnext plan``'s); None: this
            process's host, read now (the plugin's).

    ``auto``: pinned host memory (UVA) when the host preflight says it fits, else staged from a
    memory map; ``device`` (GPU memory) only when asked, since it takes GPU memory vLLM would
    give the KV cache. On a CPU device the table is looked up on the host (path ``cpu``).

    Raises:
        PluginError: an unknown setting, or ``device`` asked but ``device_free`` bytes cannot
            hold the table.
        PreflightError: ``pinned`` asked but host memory cannot hold it.
    """
    from flashnext.host.preflight import PreflightError, check_fits

    if setting not in PLACEMENT_SETTINGS:
        raise PluginError(f"placement {setting!r}: expected one of {', '.join(PLACEMENT_SETTINGS)}")
    pinned = f"pinned host memory for {gib(table_bytes)} of PLE rows"
    if str(device).split(":", 1)[0] == "cpu":
        choice = PlacementChoice("cpu", "a CPU device: PLETable.lookup on the host")
    elif setting == "auto":
        try:
            check_fits(table_bytes, pinned, memory=memory)
        except PreflightError as exc:
            choice = PlacementChoice("staged", f"auto: pinned does not fit ({exc})")
        else:
            choice = PlacementChoice("pinned", "auto: fits in host memory")
    else:
        _check_asked(setting, device, table_bytes, device_free, memory)
        choice = PlacementChoice(cast(Placement, setting), "asked for")
    return choice


def _check_asked(
    setting: str, device: Any, table_bytes: int, device_free: int | None, memory: HostMemory | None
) -> None:
    """Refuse a placement asked for by name that cannot hold ``table_bytes`` (see
    :func:`choose_placement`)."""
    from flashnext.host.preflight import DEFAULT_HEADROOM, check_fits

    what = f"{gib(table_bytes)} of PLE rows"
    if (
        setting == "device"
        and device_free is not None
        and table_bytes + DEFAULT_HEADROOM > device_free
    ):
        raise PluginError(
            f"FLASHNEXT_PLE_PLACEMENT=device: {what} plus 2 GiB headroom do not fit in the "
            f"{gib(device_free)} free on {device}; use pinned or staged"
        )
    if setting == "pinned":
        check_fits(table_bytes, f"pinned host memory for {what}", memory=memory)


def host_residency(choice: PlacementChoice, setting: str) -> Residency:
    """How the host table behind ``choice`` holds its rows.

    ``resident`` only for a CPU device whose setting asked for the rows in memory (``device``
    or ``pinned``): the closest a host lookup comes to that. Everything else maps the shards
    (the GPU placements copy or stage from the map themselves).
    """
    return "resident" if choice.placement == "cpu" and setting in ("device", "pinned") else "mmap"


# -- the device cache (planned by flashnext.serve.cache_plan) -----------------------------------
def attach_cache(target: Any, profile: Any, cache_bytes: int) -> Any:
    """Fill the device cache of a pinned ``GpuTable`` or a ``StagedTable`` from ``profile``.

    Both take the same call, ``set_device_cache(profile, cache_bytes)``: the one place the
    plugin's cache switch meets the kernels. Returns their ``CacheInfo``.

    Raises:
        PluginError: ``target`` has no device cache (a staged table of a flashnext built before
            the staged cache existed).
    """
    if not hasattr(target, "set_device_cache"):
        raise PluginError(
            f"{type(target).__name__} has no device cache in this flashnext; set "
            "FLASHNEXT_PLE_DEVICE_CACHE=0 or use FLASHNEXT_PLE_PLACEMENT=pinned"
        )
    return target.set_device_cache(profile, cache_bytes)


# -- the rows object the plugin calls ------------------------------------------------------
class SidecarRows:
    """This rank's rows of one sidecar, looked up into bf16 ``[N, heads * width]``.

    Args:
        table: the opened table (its ``row_range`` is this rank's rows).
        choice: the serving path (:func:`choose_placement`).
        device: the torch device the lookups run on.
        max_ids: the most ids one staged lookup takes (``staged`` sizes its buffers by it).
        cache: the device cache (:func:`plan_layer_cache`) and its profile; pinned and staged
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
        self.sidecar: Sidecar = table.sidecar
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
        self._rows: Rows | None = self._gpu if self._gpu is not None else self._staged

    def lookup(self, ids: Any, out: Any) -> None:
        """Fill ``out`` (torch bf16 ``[N, heads * width]``, contiguous) with the rows of ``ids``
        (torch int64 ``[N, heads]``, global row ids; rows outside this rank's range give 0)."""
        if self._rows is not None:
            self._rows.rows_into(ids, out)
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


@dataclass(frozen=True, kw_only=True)
class RowsRequest:
    """What one PLE layer asks of its sidecar: built once by the plugin from its settings and
    the layer vLLM is building, and read by :func:`open_rows` alone.

    Attributes:
        sidecar_root: ``FLASHNEXT_PLE_SIDECAR`` (:func:`sidecar_dir_for`).
        prefix: the layer's name (``model.layers.{L}.ple...``).
        shape: the layer's table ``(num_rows, width)``.
        row_range: this rank's rows ``[start, end)``.
        model_config: the model's text config (a dict), or None when unknown; the layer's
            hashing geometry is read from it (:func:`layer_geometry`).
        placement: the placement setting (``auto`` ... ``staged``).
        device: the device the model is built on (a torch device or its name).
        device_free: free GPU bytes, or None when unknown.
        max_ids: the most ids one lookup takes (``staged`` sizes its buffers by it).
        cache_bytes: the device cache (``FLASHNEXT_PLE_DEVICE_CACHE``; 0 = off).
        profile: ``FLASHNEXT_PLE_PROFILE`` (:func:`profile_path`), or None.
    """

    sidecar_root: Path
    prefix: str
    shape: tuple[int, int]
    row_range: tuple[int, int]
    model_config: Mapping[str, Any] | None = None
    placement: str = "auto"
    device: Any = "cpu"
    device_free: int | None = None
    max_ids: int = 1
    cache_bytes: int = 0
    profile: Path | None = None


def open_rows(request: RowsRequest) -> SidecarRows:
    """Find, check, place and open the sidecar rows one layer serves, in one pass: the sidecar
    (:func:`sidecar_dir_for`), its geometry against the layer's (:func:`check_geometry`), the
    serving path (:func:`choose_placement`), the device cache (:func:`plan_layer_cache`), and
    this rank's rows of the host table.

    Raises:
        PluginError: no sidecar for the layer, a geometry mismatch, a placement that cannot fit,
            or a cache profile that is missing or made for another table.
        SidecarError: the sidecar directory is not a valid sidecar.
        PreflightError: a pinned or resident copy does not fit in host memory.
    """
    from flashnext.host.table import open_table
    from flashnext.kernels.records import record_layout
    from flashnext.store.sidecar import open_sidecar

    r = request
    sidecar = open_sidecar(sidecar_dir_for(r.sidecar_root, r.prefix))
    check_geometry(sidecar, r.prefix, *r.shape, layer_geometry(r.model_config, r.prefix))
    record_bytes = record_layout(sidecar.codec, sidecar.width).record_bytes
    table_bytes = (r.row_range[1] - r.row_range[0]) * record_bytes
    choice = choose_placement(r.placement, r.device, table_bytes, r.device_free)
    cache = plan_layer_cache(sidecar, r.prefix, r.cache_bytes, r.profile, r.row_range,
                             choice.placement)  # fmt: skip
    table = open_table(sidecar, host_residency(choice, r.placement), row_range=r.row_range)
    return SidecarRows(table, choice, r.device, r.max_ids, cache)

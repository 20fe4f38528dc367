"""A sidecar's rows for one vLLM PLE layer: where they live, whether they fit, how they are read.

No vLLM import here (the GPU machine has none): :mod:`.ple_layer` builds vLLM's layer around
:class:`SidecarRows`, and the GPU check calls it with the tensors the layer passes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from flashnext._extras import require
from flashnext.errors import PluginError
from flashnext.ple.formats import BF16
from flashnext.ple.geometry import PLEGeometry
from flashnext.ple.preflight import DEFAULT_HEADROOM, PreflightError, check_fits
from flashnext.ple.sidecar import Sidecar
from flashnext.ple.table import PLETable

torch = require("torch", "vllm", "the vLLM plugin's PLE layer")
LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


# -- where the rows come from --------------------------------------------------------------
def sidecar_dir_for(root: Path, prefix: str) -> Path:
    """The sidecar of the layer named ``prefix``: ``root/layer_{L}`` or ``root`` itself.

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


def model_geometry(vllm_config: Any, prefix: str) -> PLEGeometry | None:
    """The layer's geometry from vLLM's model config, or None when vLLM has no model config.

    Raises:
        PluginError: the config does not describe a valid PLE geometry for this layer.
    """
    model_config = getattr(vllm_config, "model_config", None)
    hf = getattr(model_config, "hf_text_config", None)
    match = LAYER_INDEX.search(prefix)
    if hf is None or match is None:
        return None
    config = hf.to_dict() if hasattr(hf, "to_dict") else dict(vars(hf))
    try:
        return PLEGeometry.from_config(config, layer_id=int(match.group(1)) + 1)
    except Exception as exc:  # GeometryError: say which layer
        raise PluginError(f"{prefix}: the model config's PLE geometry: {exc}") from exc


@dataclass(frozen=True)
class PlacementChoice:
    """Where a layer's rows are served from, and why."""

    placement: str  # "cpu", "device", "pinned" or "staged"
    reason: str


def choose_placement(
    setting: str, device: Any, table_bytes: int, device_free: int | None = None
) -> PlacementChoice:
    """Pick the serving path for ``table_bytes`` of records (this rank's rows).

    ``auto``: pinned host memory (UVA) when the host preflight says it fits, else staged from a
    memory map; ``device`` (GPU memory) only when asked, since it takes GPU memory vLLM would
    give the KV cache. On a CPU device the table is looked up on the host.

    Raises:
        PluginError: ``device`` asked but ``device_free`` bytes cannot hold the table.
        PreflightError: ``pinned`` asked but host memory cannot hold it.
    """
    if device.type == "cpu":
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


class SidecarRows:
    """This rank's rows of one sidecar, looked up into bf16 ``[N, heads * width]``."""

    def __init__(self, table: PLETable, choice: PlacementChoice, device: Any, max_ids: int):
        self.table = table
        self.choice = choice
        self.device = device
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

    def lookup(self, ids: Any, out: Any) -> None:
        """Fill ``out`` (bf16 ``[N, heads * width]``, contiguous) with the rows of ``ids`` [N, heads]."""
        if self._gpu is not None:
            self._gpu.lookup(ids, out=out)
        elif self._staged is not None:
            batch = self._staged.stage(ids.cpu().numpy())
            self._staged.lookup(batch, out=out)
        else:
            host = np.empty((*ids.shape, self.table.width), dtype=BF16)
            self.table.lookup(ids.cpu().numpy(), out=host, dtype=BF16)
            out.copy_(torch.from_numpy(host.view(np.uint16)).view(torch.bfloat16).flatten(-2))

"""Which quantization format each kind of layer uses, from the checkpoint's tensor headers.

Kinds: ``moe`` (routed experts of the decoder), ``mtp_moe`` (experts of the MTP draft head),
``dense`` (other linear layers). Formats are read from tensor names and dtypes, the way the
quantizers that make these checkpoints store them:

- ``nvfp4``: ``*.weight`` uint8 (two e2m1 codes a byte) with a ``*.weight_scale`` float8_e4m3fn
- ``mxfp4``: ``*.weight`` uint8 with a ``*.weight_scale`` uint8 (e8m0 exponents)
- ``w4a16``: ``*.weight_packed`` int32 (compressed-tensors pack-quantized int4, bf16 activations)
- ``fp8``:   ``*.weight`` float8_e4m3fn
- ``bf16`` / ``fp16``: unquantized
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from flashnext.safetensors_file import TensorEntry

_LINEAR = re.compile(
    r"^(?P<base>.*\.(?:[a-z_]*proj|experts\.\d+\.[a-z_]+|w[123]))\.(?P<leaf>weight|weight_packed)$"
)


def _kind(base: str) -> str:
    if ".experts." not in base:
        return "dense"
    return "mtp_moe" if base.startswith("mtp.") or ".mtp." in base else "moe"


def _format(leaf: str, entry: TensorEntry, scale: TensorEntry | None) -> str:
    if leaf == "weight_packed":
        return "w4a16"
    dtype = entry.dtype_name
    if dtype == "U8":
        return "nvfp4" if scale is not None and scale.dtype_name == "F8_E4M3" else "mxfp4"
    return {"F8_E4M3": "fp8", "BF16": "bf16", "F16": "fp16", "F32": "fp32"}.get(dtype, dtype)


def layer_formats(tensors: Mapping[str, tuple[Path, TensorEntry]]) -> dict[str, dict[str, int]]:
    """Per layer kind, the formats found and how many linear weights use each.

    Args:
        tensors: name -> (file, header entry), as :func:`flashnext.checkpoint.tensor_map` gives.

    Returns:
        ``{"moe": {"nvfp4": 24576}, "dense": {"bf16": 190, "w4a16": 48}, ...}``.
    """
    out: dict[str, dict[str, int]] = {}
    for name, (_path, entry) in tensors.items():
        m = _LINEAR.match(name)
        if m is None:
            continue
        base, leaf = m.group("base"), m.group("leaf")
        scale = tensors.get(f"{base}.weight_scale")
        fmt = _format(leaf, entry, scale[1] if scale else None)
        kind = out.setdefault(_kind(base), {})
        kind[fmt] = kind.get(fmt, 0) + 1
    return out


def config_quant(config: Mapping[str, Any]) -> dict[str, Any]:
    """The checkpoint's ``quantization_config`` (top level or under ``text_config``), or {}."""
    for scope in (config, config.get("text_config") or {}):
        q = scope.get("quantization_config") if isinstance(scope, Mapping) else None
        if isinstance(q, Mapping):
            return dict(q)
    return {}

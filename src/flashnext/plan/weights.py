"""Weight bytes by kind: from a checkpoint's safetensors headers, or estimated from config.json.

Kinds, decided from tensor names (first match wins): ``ple_table`` (``ngram_embedding``),
``mtp`` (``mtp.``), ``vision`` (``visual.`` / ``vision``), ``experts`` (``.experts.``),
``embedding`` (``embed_tokens``), ``lm_head``, ``linear_attention`` (``linear_attn``),
``attention`` (``self_attn`` / ``.attn.``), ``other`` (norms, routers, shared experts, ...).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flashnext.checkpoint.ple_tensors import TABLE_MODULE
from flashnext.checkpoint.snapshot import tensor_map
from flashnext.plan.model import ModelShape, PlanError
from flashnext.ple.geometry import PLEGeometry, text_config

KINDS = (
    "ple_table",
    "mtp",
    "vision",
    "experts",
    "embedding",
    "lm_head",
    "linear_attention",
    "attention",
    "other",
)
_RULES = (
    ("ple_table", (TABLE_MODULE,)),
    ("mtp", ("mtp.",)),
    ("vision", ("visual.", "vision")),
    ("experts", (".experts.",)),
    ("embedding", ("embed_tokens",)),
    ("lm_head", ("lm_head",)),
    ("linear_attention", ("linear_attn",)),
    ("attention", ("self_attn", ".attn.")),
)
#: Bytes per parameter for --weights-format when only a config is given (scales included:
#: nvfp4 = 4-bit codes + one e4m3 scale per 16; fp8 = 1 byte + per-channel scales, ~0).
FORMAT_BYTES = {"bf16": 2.0, "fp8": 1.0, "nvfp4": 0.5 + 1 / 16, "int4": 0.5 + 2 / 16}


def tensor_kind(name: str) -> str:
    """The kind of a tensor name (see the module doc)."""
    if name.startswith("mtp.") or ".mtp." in name:
        return "mtp"
    for kind, needles in _RULES:
        if any(n in name for n in needles):
            return kind
    return "other"


@dataclass(frozen=True)
class Weights:
    """Bytes per kind and where the numbers came from ("headers" or "estimate")."""

    by_kind: dict[str, int]
    source: str
    notes: list[str] = field(default_factory=list)

    def total(self, exclude: tuple[str, ...] = ()) -> int:
        return sum(v for k, v in self.by_kind.items() if k not in exclude)


def from_headers(root: str | Path) -> Weights:
    """Sum the checkpoint's tensors by kind, reading safetensors headers only.

    Raises:
        CheckpointError: a weight file is missing or its header is invalid.
    """
    by_kind = dict.fromkeys(KINDS, 0)
    for name, (_path, entry) in tensor_map(root).items():
        by_kind[tensor_kind(name)] += entry.nbytes
    return Weights(by_kind, "headers")


def estimate(config: Mapping[str, Any], shape: ModelShape, weights_format: str) -> Weights:
    """Parameter counts from config.json times bytes per parameter (an estimate, said so).

    Experts take ``weights_format``; everything else is assumed BF16 (as in the mixed
    NVFP4/FP8 checkpoints, whose dense parts stay in higher precision). The PLE table is
    counted in BF16 from its geometry.

    Raises:
        PlanError: an unknown ``weights_format`` or a missing field.
    """
    if weights_format not in FORMAT_BYTES:
        raise PlanError(
            f"--weights-format {weights_format!r}: expected one of {sorted(FORMAT_BYTES)}"
        )
    cfg = text_config(config)
    h = shape.hidden_size
    vocab = int(cfg.get("vocab_size", 0))
    heads = int(cfg.get("num_attention_heads", 1))
    n_exp = int(cfg.get("num_experts", 0) or 0)
    moe_i = int(cfg.get("moe_intermediate_size", 0) or 0)
    shared_i = int(cfg.get("shared_expert_intermediate_size", 0) or 0)
    dense_i = int(cfg.get("intermediate_size", 0) or 0)
    hd, kvh = shape.head_dim, shape.num_kv_heads
    attn = h * hd * (2 * heads + 2 * kvh)  # q (+ output gate folded in q's 2x), k, v, o
    lin = 0
    if shape.gdn is not None:
        kh, vh, kd, vd, _k = shape.gdn
        lin = h * (2 * kh * kd + 2 * vh * vd) + vh * vd * h
    per_layer_ffn = 3 * h * (shared_i if n_exp else dense_i) + (h * n_exp)
    bf16 = 2.0
    ex = FORMAT_BYTES[weights_format]
    by_kind = dict.fromkeys(KINDS, 0)
    by_kind["experts"] = int(len(shape.layer_kinds) * n_exp * 3 * h * moe_i * ex)
    by_kind["attention"] = int(shape.num_attention * attn * bf16)
    by_kind["linear_attention"] = int(shape.num_linear * lin * bf16)
    by_kind["other"] = int(len(shape.layer_kinds) * per_layer_ffn * bf16)
    by_kind["embedding"] = int(vocab * h * bf16)
    by_kind["lm_head"] = 0 if cfg.get("tie_word_embeddings") else int(vocab * h * bf16)
    if shape.mtp_layers:
        layer = attn + 3 * h * shared_i + n_exp * 3 * h * moe_i
        by_kind["mtp"] = int(shape.mtp_layers * layer * bf16)  # drafts are unquantized
    for d, _lid in enumerate(shape.ple_layers):
        by_kind["ple_table"] += int(PLEGeometry.from_config(config, d).num_params * bf16)
    notes = [
        f"weights estimated from config.json: experts {weights_format} "
        f"({ex:g} B/param), all else BF16; MTP draft BF16; vision tower not counted",
    ]
    return Weights(by_kind, "estimate", notes)

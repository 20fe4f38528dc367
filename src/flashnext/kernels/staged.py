"""Staged lookups for a table that stays memory-mapped on the host (too little RAM to pin it).

Per step the host deduplicates the ids, gathers the stored rows (:meth:`PLETable.gather_raw`)
and packs them as records into a pinned staging buffer laid out as
``[inverse index int32 [n_ids] | scale_2 float32 [n_unique] | records [n_unique, R]]``; one
async H2D copy on a copy stream moves the used prefix, and the lookup kernel dequantizes with
the inverse index as row ids. ``buffers`` staging slots (2 = double-buffered) let the host gather
step N+1 while the GPU still reads step N: :meth:`StagedTable.stage` waits only for the lookup
that last used the slot it is about to overwrite.

This version runs outside CUDA graphs (the host must gather before the copy is enqueued); the
graph-resident variant (a stream wait on a host-written flag) is not built yet.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import numpy as np

from flashnext.errors import KernelError
from flashnext.kernels.records import pack_records, record_layout
from flashnext.kernels.table import _lookup, code_luts, torch
from flashnext.ple.table import PLETable

_ROWS_PER_WORKER = 2048  # rows per gather thread at least (fewer: threads fight over the GIL)


def _align(n: int, k: int = 16) -> int:
    return -(-n // k) * k


@dataclass(frozen=True)
class StagedBatch:
    """One step's staged rows: slot ``slot``, ``n_ids`` ids of shape ``shape``, ``n_unique`` rows.

    ``n_unique`` counts the rows gathered (every id when the step was not deduplicated).
    ``host_us`` says where the host's time went (waiting for the slot + dedup, gather + pack,
    enqueueing the copy), for benchmarks.
    """

    slot: int
    shape: tuple[int, int]
    n_ids: int
    n_unique: int
    host_us: dict[str, float] = field(default_factory=dict)


class StagedTable:
    """Lookups from a (memory-mapped) :class:`PLETable` through pinned staging buffers.

    Args:
        table: an opened table (any residency, any row range: other ids give zero rows).
        max_ids: the most ids one step may stage (``T * heads``).
        buffers: staging slots (2 = double-buffered).
        device: the CUDA device.
        prefault: touch every page of a memory-mapped table once now, so that steps pay no
            page-table faults (a 32 GB int4 table: 8M pages, a few seconds; the pages must
            already be in the page cache or this reads the file).
        workers: host threads gathering one step's rows (default: up to 8).
        dedup_max_ids: steps of at most this many ids (default: an 8K-token prefill) are
            deduplicated and sorted before the gather (fewer rows, and sorted rows gather 2x
            faster); larger steps gather every id in arrival order, because ``np.unique`` of
            1M ids (85 ms on the H200 host) costs more than reading the repeats.
    """

    def __init__(
        self,
        table: PLETable,
        max_ids: int,
        buffers: int = 2,
        device: Any = "cuda",
        prefault: bool = True,
        workers: int | None = None,
        dedup_max_ids: int = 131072,
    ):
        self.table = table
        self.layout = record_layout(table.codec, table.width)
        self.device = torch.device(device)
        self.max_ids = int(max_ids)
        self.dedup_max_ids = int(dedup_max_ids)
        self._slot_bytes = self._offsets(self.max_ids, self.max_ids)[-1]
        pin = self.device.type != "cpu"
        self._host = [
            torch.empty(self._slot_bytes, dtype=torch.uint8, pin_memory=pin) for _ in range(buffers)
        ]
        self._dev = [
            torch.empty(self._slot_bytes, dtype=torch.uint8, device=self.device)
            for _ in range(buffers)
        ]
        cuda = self.device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(self.device) if cuda else None
        self._copied = [torch.cuda.Event() if cuda else None for _ in range(buffers)]
        self._used = [torch.cuda.Event() if cuda else None for _ in range(buffers)]
        self._next = 0
        self._e2m1, self._e4m3 = code_luts(self.device)
        self._zero = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._s2_name = next((s.name for s in table.codec.specs if not s.per_row), None)
        # numpy's gathers release the GIL: threads split a step's rows (sorted, so each
        # thread reads its own stretch of shards).
        self._workers = workers or min(8, os.cpu_count() or 1)
        self._pool = ThreadPoolExecutor(self._workers, thread_name_prefix="flashnext-stage")
        if prefault:
            prefault_pages(table)

    def close(self) -> None:
        """Stop the gather threads (the buffers go with the object)."""
        self._pool.shutdown(wait=True)

    def _offsets(self, n_ids: int, n_unique: int) -> tuple[int, int, int]:
        """Byte offsets of scale_2 and records in a slot, and the used length."""
        s2_at = _align(4 * n_ids)
        rec_at = _align(s2_at + 4 * n_unique)
        return s2_at, rec_at, rec_at + n_unique * self.layout.record_bytes

    def stage(self, ids: Any) -> StagedBatch:
        """Gather the rows of int ids ``[T, heads]`` (numpy, on the host) and start their copy.

        Blocks only while the slot it reuses is still read by an earlier lookup. Ids outside
        the table's ``row_range`` (-1 included) give zero rows, as in :class:`GpuTable`.

        Raises:
            KernelError: more than ``max_ids`` ids, or not 2-D.
        """
        arr = np.asarray(ids)
        if arr.ndim != 2 or arr.size > self.max_ids:
            raise KernelError(
                f"staged ids must be [T, heads] with at most {self.max_ids} ids, found "
                f"{list(arr.shape)}"
            )
        t_start = time.perf_counter()
        slot = self._next
        self._next = (slot + 1) % len(self._host)
        used_event = self._used[slot]
        if used_event is not None:
            used_event.synchronize()
        flat = arr.reshape(-1).astype(np.int64, copy=False)
        # Like GpuTable: any id outside the table's rows is a zero row (gather_raw pads -1).
        lo, hi = self.table.row_range
        flat = np.where((flat >= lo) & (flat < hi), flat, -1)
        if flat.size <= self.dedup_max_ids:
            uniq, inverse = np.unique(flat, return_inverse=True)
        else:  # sorting a prefill's ids costs more than gathering its repeats
            uniq, inverse = flat, np.arange(flat.size)
        s2_at, rec_at, used = self._offsets(arr.size, uniq.size)
        host = self._host[slot].numpy()
        host[: 4 * arr.size].view(np.int32)[:] = inverse
        recs = host[rec_at : rec_at + uniq.size * self.layout.record_bytes]
        recs = recs.reshape(uniq.size, self.layout.record_bytes)
        s2 = host[s2_at : s2_at + 4 * uniq.size].view(np.float32)
        bounds = np.linspace(0, uniq.size, self._chunks(uniq.size) + 1).astype(np.int64)
        parts = [(int(a), int(b)) for a, b in pairwise(bounds) if b > a]
        t_gather = time.perf_counter()
        if len(parts) == 1:
            self._gather(uniq, recs, s2, *parts[0])
        else:
            list(self._pool.map(lambda ab: self._gather(uniq, recs, s2, *ab), parts))
        t_copy = time.perf_counter()
        self._copy(slot, used)
        t_end = time.perf_counter()
        return StagedBatch(
            slot,
            (int(arr.shape[0]), int(arr.shape[1])),
            int(arr.size),
            int(uniq.size),
            {
                "wait_dedup_us": (t_gather - t_start) * 1e6,
                "gather_pack_us": (t_copy - t_gather) * 1e6,
                "copy_enqueue_us": (t_end - t_copy) * 1e6,
            },
        )

    def _chunks(self, n: int) -> int:
        return max(1, min(self._workers, n // _ROWS_PER_WORKER))

    def _gather(self, uniq: np.ndarray, recs: np.ndarray, s2: np.ndarray, a: int, b: int) -> None:
        """Gather rows ``uniq[a:b]`` into records ``recs[a:b]`` (one worker thread's share)."""
        raw = self.table.gather_raw(uniq[a:b])
        if self._s2_name is not None:
            s2[a:b] = raw[self._s2_name]
        pack_records(self.layout, raw, out=recs[a:b])

    def _copy(self, slot: int, used: int) -> None:
        if self._copy_stream is None:
            self._dev[slot][:used].copy_(self._host[slot][:used])
            return
        copied = self._copied[slot]
        with torch.cuda.stream(self._copy_stream):
            self._dev[slot][:used].copy_(self._host[slot][:used], non_blocking=True)
            if copied is not None:
                copied.record(self._copy_stream)

    def lookup(self, batch: StagedBatch, out: Any = None) -> Any:
        """bf16 ``[T, heads * width]`` for a staged batch, on the current stream.

        Raises:
            KernelError: ``out`` has the wrong shape or dtype.
        """
        t, heads = batch.shape
        shape = (t, heads * self.layout.width)
        if out is None:
            out = torch.empty(shape, dtype=torch.bfloat16, device=self.device)
        elif tuple(out.shape) != shape or out.dtype != torch.bfloat16:
            raise KernelError(f"out is {out.dtype} {list(out.shape)}, expected bfloat16 {shape}")
        dev = self._dev[batch.slot]
        s2_at, rec_at, _ = self._offsets(batch.n_ids, batch.n_unique)
        if self._copied[batch.slot] is not None:
            torch.cuda.current_stream(self.device).wait_event(self._copied[batch.slot])
        n_rec = max(1, batch.n_unique)
        _lookup.launch_lookup(
            dev[: 4 * batch.n_ids].view(torch.int32),
            out,
            dev[rec_at : rec_at + n_rec * self.layout.record_bytes],
            fmt=self.layout.codec.name,
            width=self.layout.width,
            record_bytes=self.layout.record_bytes,
            scale_offset=self.layout.fields[-1].offset,
            row_start=0,
            row_end=batch.n_unique,
            e2m1=self._e2m1,
            e4m3=self._e4m3,
            s2=dev[s2_at : s2_at + 4 * n_rec].view(torch.float32),
            s2_mode=_lookup.S2_PER_ROW if self._s2_name is not None else _lookup.S2_NONE,
            shard_starts=self._zero,
        )
        used_event = self._used[batch.slot]
        if used_event is not None:
            used_event.record(torch.cuda.current_stream(self.device))
        return out


def prefault_pages(table: PLETable, page: int = 4096) -> None:
    """Read one byte of every page of the table's stored tensors (maps them into this process)."""
    for seg in table.stored().segments:
        for arr in seg.tensors.values():
            flat = np.asarray(arr).reshape(-1).view(np.uint8)
            int(flat[::page].sum(dtype=np.uint64))

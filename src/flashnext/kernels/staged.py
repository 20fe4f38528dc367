"""Staged lookups for a table that stays memory-mapped on the host (too little RAM to pin it).

Per step the host deduplicates the ids (one sort) and gathers the unique rows' stored bytes as
records straight into a pinned staging slot (numba, :mod:`flashnext.kernels._staging`; the
gather split over up to ``workers`` threads, 64+ rows each), laid out as
``[inverse int32 [n_ids] | scale_2 float32 [n_ids] (nvfp4) | records [n_unique, R]]``; one async
H2D copy of the used prefix goes on the current stream, and the lookup kernel dequantizes with
the inverse index as row ids (-1 = a zero row). ``buffers`` slots (2 = double-buffered) let the
host gather step N+1 while the GPU still runs step N: :meth:`StagedTable.stage` waits only for
the copy that last read the slot it is about to overwrite.

A device cache of hot rows (:meth:`StagedTable.set_hot_rows`, the profile format and size rule of
``GpuTable.set_hot_rows``) sits in front: the host looks each id up in a slot map (int32 per
served row, host RAM, not pinned); a hit is written into the inverse index as ``-(slot + 2)``
and never gathered, so only the misses are deduplicated, gathered and copied, and the one kernel
reads hits from the cache and misses from the staged slot.

:class:`StagedTable` runs outside CUDA graphs (the copy's size is known only after the gather);
:mod:`flashnext.kernels.graph_staged` is the variant that lives inside one.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from flashnext.errors import KernelError
from flashnext.kernels import _staging
from flashnext.kernels.records import RecordLayout, record_layout
from flashnext.kernels.table import CacheInfo, _lookup, code_luts, hot_row_ids, torch
from flashnext.ple.table import PLETable, StoredTable

#: Unique rows per gather thread at least (fewer: handing work out costs more than it saves).
CHUNK_ROWS = 64


def _align(n: int, k: int = 16) -> int:
    return -(-n // k) * k


@dataclass(frozen=True)
class StagedBatch:
    """One step's staged rows: slot ``slot``, ``n_ids`` ids of shape ``shape``, ``n_unique`` rows.

    ``host_us`` says where the host's time went (waiting for the slot, dedup + gather + pack,
    enqueueing the copy), for benchmarks.
    """

    slot: int
    shape: tuple[int, int]
    n_ids: int
    n_unique: int
    host_us: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class RowSource:
    """Where a table's stored rows live, as the numba gather reads them (see ``_staging``).

    ``keep`` holds the arrays whose addresses ``bases`` records.
    """

    seg_start: np.ndarray  # int64 [S]
    bases: np.ndarray  # int64 [F, S]
    row_bytes: np.ndarray  # int64 [F]
    field_off: np.ndarray  # int64 [F]
    shard_starts: np.ndarray  # int64 [K]
    scalars: np.ndarray  # float32 [K] (per-shard scale_2; empty when the format has none)
    keep: tuple[Any, ...]


def row_source(stored: StoredTable, layout: RecordLayout) -> RowSource:
    """The addresses of ``stored``'s per-row tensors, field by field of ``layout``.

    Raises:
        KernelError: a stored tensor's rows are not contiguous (a table always stores them so).
    """
    bases = np.empty((len(layout.fields), len(stored.segments)), np.int64)
    keep = []
    for s, seg in enumerate(stored.segments):
        for f, fld in enumerate(layout.fields):
            arr = np.asarray(seg.tensors[fld.spec.name])
            strided = arr.shape[0] > 1 and arr.strides[0] != fld.nbytes
            if strided or not arr[:1].flags.c_contiguous:
                raise KernelError(
                    f"{stored.format}: stored tensor {fld.spec.name} of rows {seg.start}.. has "
                    f"row stride {arr.strides[0]}, expected {fld.nbytes} contiguous bytes"
                )
            bases[f, s] = arr.ctypes.data
            keep.append(arr)
    s2_names = [s.name for s in stored.codec.specs if not s.per_row]
    scalars = (
        np.asarray(stored.shard_scalars[s2_names[0]], np.float32)
        if s2_names
        else np.empty(0, np.float32)
    )
    return RowSource(
        seg_start=np.array([seg.start for seg in stored.segments], np.int64),
        bases=bases,
        row_bytes=np.array([f.nbytes for f in layout.fields], np.int64),
        field_off=np.array([f.offset for f in layout.fields], np.int64),
        shard_starts=np.asarray(stored.shard_starts, np.int64),
        scalars=scalars,
        keep=tuple(keep),
    )


class StagedTable:
    """Lookups from a (memory-mapped) :class:`PLETable` through pinned staging buffers.

    Args:
        table: an opened table (any residency, any row range: other ids give zero rows).
        max_ids: the most ids one step may stage (``T * heads``).
        buffers: staging slots (2 = double-buffered).
        device: the CUDA device (``"cpu"`` runs the kernel in Triton's interpreter).
        prefault: touch every page of a memory-mapped table once now, so that steps pay no
            page-table faults (a 32 GB int4 table: 8M pages, a few seconds; the pages must
            already be in the page cache or this reads the file).
        workers: host threads gathering a step's rows (numba's threads; default: up to 8).
    """

    def __init__(
        self,
        table: PLETable,
        max_ids: int,
        buffers: int = 2,
        device: Any = "cuda",
        prefault: bool = True,
        workers: int | None = None,
    ):
        self.table = table
        self.layout = record_layout(table.codec, table.width)
        self.device = torch.device(device)
        self.max_ids = int(max_ids)
        self._src = row_source(table.stored(), self.layout)
        self._slot_bytes = self._offsets(self.max_ids, self.max_ids)[-1]
        pin = self.device.type != "cpu"
        # device="cpu" spelled out: vLLM builds layers under `with torch.device("cuda")`, which
        # would otherwise put these host slots on the GPU ("Only dense CPU tensors can be pinned").
        self._host = [
            torch.empty(self._slot_bytes, dtype=torch.uint8, device="cpu", pin_memory=pin)
            for _ in range(buffers)
        ]
        self._host_np = [h.numpy() for h in self._host]
        self._dev = [
            torch.empty(self._slot_bytes, dtype=torch.uint8, device=self.device)
            for _ in range(buffers)
        ]
        cuda = self.device.type == "cuda"
        self._copied = [torch.cuda.Event() if cuda else None for _ in range(buffers)]
        self._next = 0
        if self.max_ids > 1 << _staging.POS_BITS:
            raise KernelError(f"max_ids is {self.max_ids}, at most {1 << _staging.POS_BITS}")
        self._keys = np.empty(self.max_ids, np.int64)
        self._uniq = np.empty(self.max_ids, np.int64)
        self._e2m1, self._e4m3 = code_luts(self.device)
        self._zero = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._workers = workers or min(8, os.cpu_count() or 1)
        self._slot_map: np.ndarray | None = None  # int32 [served rows], host
        self._cache: Any = None  # uint8 [slots, record_bytes], device
        self._cache_s2: Any = None  # float32 [slots] (nvfp4 scale_2 of each cached row)
        if prefault:
            prefault_pages(table)

    def _offsets(self, n_ids: int, n_unique: int) -> tuple[int, int, int]:
        """Byte offsets of scale_2 and the records in a slot, and the used length.

        scale_2 gets room for ``n_ids`` rows (4 bytes each), so that the records' place is
        known before the dedup says how many rows there are.
        """
        s2_at = _align(4 * n_ids)
        rec_at = _align(s2_at + (4 * n_ids if self._src.scalars.size else 0))
        return s2_at, rec_at, rec_at + n_unique * self.layout.record_bytes

    def stage(self, ids: Any) -> StagedBatch:
        """Gather the rows of int ids ``[T, heads]`` (numpy, on the host) and enqueue their copy
        on the current stream (run :meth:`lookup` on the same stream).

        Blocks only while the slot it reuses is still being copied. Ids outside the table's
        ``row_range`` (-1 included) give zero rows, as in :class:`GpuTable`.

        Raises:
            KernelError: more than ``max_ids`` ids, or not 2-D integers.
        """
        arr = np.asarray(ids)
        if arr.ndim != 2 or arr.size > self.max_ids or arr.dtype.kind not in "iu":
            raise KernelError(
                f"staged ids must be int [T, heads] with at most {self.max_ids} ids, found "
                f"{arr.dtype} {list(arr.shape)}"
            )
        t_start = time.perf_counter()
        slot = self._next
        self._next = (slot + 1) % len(self._host)
        copied = self._copied[slot]
        if copied is not None:
            copied.synchronize()
        t_gather = time.perf_counter()
        flat = np.ascontiguousarray(arr.reshape(-1), dtype=np.int64)
        n_unique = self._fill(self._host_np[slot], flat)
        t_copy = time.perf_counter()
        used = self._offsets(flat.size, n_unique)[-1]
        self._dev[slot][:used].copy_(self._host[slot][:used], non_blocking=True)
        if copied is not None:
            copied.record()
        t_end = time.perf_counter()
        return StagedBatch(
            slot,
            (int(arr.shape[0]), int(arr.shape[1])),
            int(flat.size),
            n_unique,
            {
                "wait_us": (t_gather - t_start) * 1e6,
                "dedup_gather_us": (t_copy - t_gather) * 1e6,
                "copy_enqueue_us": (t_end - t_copy) * 1e6,
            },
        )

    def _fill(self, host: np.ndarray, flat: np.ndarray) -> int:
        """Dedup ``flat`` and gather its rows into the slot ``host``; returns the unique count."""
        n, src, rb = flat.size, self._src, self.layout.record_bytes
        lo, hi = self.table.row_range
        s2_at, rec_at, _ = self._offsets(n, 0)
        inverse = host[: 4 * n].view(np.int32)
        s2 = host[s2_at : s2_at + (4 * n if src.scalars.size else 0)].view(np.float32)
        records = host[rec_at : rec_at + n * rb].reshape(n, rb)
        if self._slot_map is None:
            m = _staging.sort_keys(flat, lo, hi, self._keys, inverse)
        else:
            m = _staging.sort_keys_cached(flat, lo, hi, self._slot_map, self._keys, inverse)
        keys = self._keys[:m]
        keys.sort()
        n_unique = _staging.stage_rows(
            keys, inverse, self._uniq, CHUNK_ROWS, self._workers, src.seg_start, src.bases,
            src.row_bytes, src.field_off, records, src.shard_starts, src.scalars, s2,
        )  # fmt: skip
        return int(n_unique)

    def lookup(self, batch: StagedBatch, out: Any = None) -> Any:
        """bf16 ``[T, heads * width]`` for a staged batch, on the current stream (the one
        :meth:`stage` enqueued the batch's copy on).

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
            s2_mode=_lookup.S2_PER_ROW if self._src.scalars.size else _lookup.S2_NONE,
            shard_starts=self._zero,
            coded_cache=self._cache,
            cache_s2=self._cache_s2,
        )
        return out

    def set_hot_rows(self, hot_rows: Any, cache_bytes: int) -> CacheInfo:
        """Cache the first rows of ``hot_rows`` that fit in ``cache_bytes`` on the device.

        The rule of ``GpuTable.set_hot_rows``: ``hot_rows`` is a HotRowProfile (``.row_ids``)
        or 1-D int row ids in priority order; rows outside the table's ``row_range`` are
        skipped, repeats keep their first place, and ``cache_bytes // record_bytes`` rows are
        kept. The slot map (4 bytes per served row) lives in host RAM here, not on the device.
        Call between steps, with no staged step pending (and before capturing a graph: the
        cache tensors are replaced). ``cache_bytes = 0`` turns the cache off.

        Returns:
            CacheInfo: cached rows and the device bytes they take (records + nvfp4 scale_2).

        Raises:
            KernelError: ids are not 1-D integers.
        """
        lo, hi = self.table.row_range
        ids = hot_row_ids(hot_rows)
        ids = ids[(ids >= lo) & (ids < hi)]
        _, first = np.unique(ids, return_index=True)
        keep = ids[np.sort(first)][: max(0, int(cache_bytes)) // self.layout.record_bytes]
        if keep.size == 0:
            self._slot_map = self._cache = self._cache_s2 = None
            return self.cache_info
        rows = np.sort(keep)  # slot order: ascending rows gather fastest
        src = self._src
        records = np.empty((rows.size, self.layout.record_bytes), np.uint8)
        s2 = np.empty(rows.size if src.scalars.size else 0, np.float32)
        _staging.gather_records(
            rows, 0, rows.size, src.seg_start, src.bases, src.row_bytes, src.field_off,
            records, src.shard_starts, src.scalars, s2,
        )  # fmt: skip
        slot_map = np.full(hi - lo, -1, np.int32)
        slot_map[rows - lo] = np.arange(rows.size, dtype=np.int32)
        self._cache = torch.from_numpy(records).to(self.device)
        self._cache_s2 = torch.from_numpy(s2).to(self.device) if s2.size else None
        self._slot_map = slot_map
        return self.cache_info

    def share_cache(self, other: StagedTable) -> CacheInfo:
        """Serve from ``other``'s device cache (same table and row range; e.g. one
        :class:`GraphStagedTable` per step shape over one cache). Same rules as
        :meth:`set_hot_rows` for when to call it.

        Raises:
            KernelError: ``other`` serves another table or row range.
        """
        if other.table is not self.table and (
            other.table.row_range != self.table.row_range or other.layout != self.layout
        ):
            raise KernelError("share_cache: the other staged table serves other rows")
        self._slot_map, self._cache, self._cache_s2 = (
            other._slot_map, other._cache, other._cache_s2,
        )  # fmt: skip
        return self.cache_info

    @property
    def cache_info(self) -> CacheInfo:
        """The device cache: rows and device bytes (0, 0 when off)."""
        if self._cache is None:
            return CacheInfo(0, 0)
        s2 = 0 if self._cache_s2 is None else self._cache_s2.numel() * 4
        return CacheInfo(int(self._cache.shape[0]), int(self._cache.numel() + s2))

    @property
    def pinned_bytes(self) -> int:
        """Host bytes this table pins (its staging slots; no table rows)."""
        return sum(int(h.numel()) for h in self._host) if self.device.type != "cpu" else 0


def prefault_pages(table: PLETable, page: int = 4096) -> None:
    """Read one byte of every page of the table's stored tensors (maps them into this process)."""
    for seg in table.stored().segments:
        for arr in seg.tensors.values():
            flat = np.asarray(arr).reshape(-1).view(np.uint8)
            int(flat[::page].sum(dtype=np.uint64))

"""Staged lookups for a table that stays memory-mapped on the host (too little RAM to pin it).

Per step the host deduplicates the ids and gathers the unique rows' stored bytes as records
straight into a pinned staging slot (numba, :mod:`flashnext.kernels.stager`: one call on the
calling thread for a step of up to ``serial_rows`` unique rows, else the gather split over up to
``workers`` threads, 64+ rows each), laid out as
``[inverse int32 [n_ids] | scale_2 float32 [n_ids] (nvfp4) | records [n_unique, R]]``; one async
H2D copy of the used prefix goes on the current stream, and the lookup kernel dequantizes with
the inverse index as row ids (-1 = a zero row). ``buffers`` slots (2 = double-buffered) let the
host gather step N+1 while the GPU still runs step N: :meth:`StagedTable.stage` waits only for
the copy that last read the slot it is about to overwrite.

A device cache (:meth:`StagedTable.set_device_cache`, the profile format and size rule of
``GpuTable.set_device_cache``) sits in front: the host looks each id up in a slot map (int32 per
served row, host RAM, not pinned); a hit is written into the inverse index as ``-(slot + 2)``
and never gathered, so only the misses are deduplicated (through the slot map itself: no sort),
gathered and copied, and the one kernel reads hits from the cache and misses from the staged
slot. Tables that share a cache (:meth:`StagedTable.share_cache`) must not stage at the same
time: a step marks its misses in the shared slot map, and records what its groups of ids
resolved to in the shared group memo, while it runs.

:class:`StagedTable` runs outside CUDA graphs (the copy's size is known only after the gather);
:mod:`flashnext.kernels.graph_staged` is its sibling that lives inside one. Both stand on
:class:`StagingSlots` (the stager, the slots, the device cache and the kernel's launch) and
serve the plugin through one interface, :class:`flashnext.kernels.rows.Rows`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from flashnext.errors import KernelError
from flashnext.host.table import PLETable
from flashnext.kernels.gather import prefault_pages
from flashnext.kernels.records import record_layout
from flashnext.kernels.stager import HostStager, StageKnobs, flat_ids
from flashnext.kernels.table import CacheInfo, UvaPointer, _lookup, code_luts, hot_row_ids, torch


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


class PinnedView(UvaPointer):
    """A pinned host tensor the kernel reads through UVA, with its element count."""

    def numel(self) -> int:
        return int(self.host.numel())


class OnSlots(Protocol):
    """A staged table (:class:`StagedTable`, ``GraphStagedTable``): what ``share_cache`` reads."""

    slots: StagingSlots


class StagingSlots:
    """What both staged tables stand on: the host stager, the pinned host slots, their device
    copies, the device cache, and the lookup kernel's launch over a filled slot.

    Args:
        table: an opened table (any residency, any row range: other ids give zero rows).
        max_ids: the most ids one step may stage.
        buffers: staging slots.
        device: the torch device (``"cpu"`` runs the kernel in Triton's interpreter).
        device_slots: give each host slot a device slot to copy it to (False: the kernel
            reads the pinned host slots through UVA).
        knobs: the stager's settings (:class:`~flashnext.kernels.stager.StageKnobs`).
    """

    def __init__(
        self,
        table: PLETable,
        max_ids: int,
        buffers: int,
        device: Any,
        *,
        device_slots: bool,
        knobs: StageKnobs,
    ):
        self.table = table
        self.layout = record_layout(table.codec, table.width)
        self.device = torch.device(device)
        self.max_ids = int(max_ids)
        self.stager = HostStager(table.stored(), self.layout, table.row_range, self.max_ids, knobs)
        size = self.stager.slot_bytes
        pin = self.device.type != "cpu"
        # device="cpu" spelled out: vLLM builds layers under `with torch.device("cuda")`, which
        # would otherwise put these host slots on the GPU ("Only dense CPU tensors can be pinned").
        self.host = [
            torch.empty(size, dtype=torch.uint8, device="cpu", pin_memory=pin)
            for _ in range(buffers)
        ]
        for h in self.host:
            self.stager.add_slot(h.numpy())
        self.dev = [
            torch.empty(size, dtype=torch.uint8, device=self.device)
            for _ in range(buffers if device_slots else 0)
        ]
        self.e2m1, self.e4m3 = code_luts(self.device)
        self.zero = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.cache: Any = None  # uint8 [slots, record_bytes], device
        self.cache_s2: Any = None  # float32 [slots] (nvfp4 scale_2 of each cached row)

    def offsets(self, n_ids: int, n_unique: int) -> tuple[int, int, int]:
        """Byte offsets of scale_2 and the records in a slot, and the used length."""
        return self.stager.offsets(n_ids, n_unique)

    def out(self, shape: tuple[int, int], out: Any) -> Any:
        """``out`` checked (or made) for ids of ``shape``: bf16 ``[T, heads * width]``.

        Raises:
            KernelError: ``out`` has the wrong shape or dtype.
        """
        want = (shape[0], shape[1] * self.layout.width)
        if out is None:
            return torch.empty(want, dtype=torch.bfloat16, device=self.device)
        if tuple(out.shape) != want or out.dtype != torch.bfloat16:
            raise KernelError(f"out is {out.dtype} {list(out.shape)}, expected bfloat16 {want}")
        return out

    def launch(
        self,
        slot: Any,
        n_ids: int,
        n_unique: int,
        out: Any,
        *,
        pinned: bool = False,
        handover: tuple[Any, Any] | None = None,
    ) -> None:
        """The lookup kernel over a filled slot: a device copy, or with ``pinned`` the pinned
        host slot itself, read through UVA; with ``handover`` (flag, counts) the kernel waits
        for the flag and writes it back to 0 when done (``launch_lookup``'s)."""
        s2_at, rec_at, _ = self.offsets(n_ids, n_unique)
        n_rec = max(1, n_unique)
        parts = (
            slot[: 4 * n_ids].view(torch.int32),
            slot[rec_at : rec_at + n_rec * self.layout.record_bytes],
            slot[s2_at : s2_at + 4 * n_rec].view(torch.float32),
        )
        ids, records, s2 = (PinnedView(p) for p in parts) if pinned else parts
        _lookup.launch_lookup(
            ids,
            out,
            records,
            fmt=self.layout.codec.name,
            width=self.layout.width,
            record_bytes=self.layout.record_bytes,
            scale_offset=self.layout.fields[-1].offset,
            row_start=0,
            row_end=n_unique,
            e2m1=self.e2m1,
            e4m3=self.e4m3,
            s2=s2,
            s2_mode=_lookup.S2_PER_ROW if self.stager.src.scalars.size else _lookup.S2_NONE,
            shard_starts=self.zero,
            coded_cache=self.cache,
            cache_s2=self.cache_s2,
            flag=handover[0] if handover else None,
            counts=handover[1] if handover else None,
        )

    def set_device_cache(self, profile: Any, cache_bytes: int) -> CacheInfo:
        """:meth:`StagedTable.set_device_cache`."""
        records, s2 = self.stager.cache_rows(hot_row_ids(profile), cache_bytes)
        if records.shape[0] == 0:
            self.cache = self.cache_s2 = None
        else:
            self.cache = torch.from_numpy(records).to(self.device)
            self.cache_s2 = torch.from_numpy(s2).to(self.device) if s2.size else None
        return self.cache_info

    def share(self, other: StagingSlots) -> CacheInfo:
        """:meth:`StagedTable.share_cache` of ``other``'s slots.

        Raises:
            KernelError: ``other`` serves another table or row range.
        """
        if other.table is not self.table and (
            other.table.row_range != self.table.row_range or other.layout != self.layout
        ):
            raise KernelError("share_cache: the other staged table serves other rows")
        self.stager.share(other.stager)
        self.cache, self.cache_s2 = other.cache, other.cache_s2
        return self.cache_info

    @property
    def cache_info(self) -> CacheInfo:
        """The device cache: rows and device bytes (0, 0 when off)."""
        if self.cache is None:
            return CacheInfo(0, 0)
        s2 = 0 if self.cache_s2 is None else self.cache_s2.numel() * 4
        return CacheInfo(int(self.cache.shape[0]), int(self.cache.numel() + s2))

    @property
    def pinned_bytes(self) -> int:
        """Host bytes pinned (the host slots; no table rows)."""
        return sum(int(h.numel()) for h in self.host) if self.device.type != "cpu" else 0


class SlotsFront:
    """What :class:`StagedTable` and ``GraphStagedTable`` both say through their
    :class:`StagingSlots` (``self.slots``): the device cache, the pinned bytes, ``cold_hints``."""

    slots: StagingSlots

    @property
    def cold_hints(self) -> str:
        """The ``cold_hints`` mode (settable between steps: ``"off"``, ``"on"``, ``"auto"``)."""
        return self.slots.stager.cold_hints

    @cold_hints.setter
    def cold_hints(self, mode: str) -> None:
        self.slots.stager.set_cold_hints(mode)

    @property
    def slot_map(self) -> np.ndarray | None:
        """The device cache's slot of each served row (int32 ``[hi - lo]``, -1 = not cached;
        host RAM), or None without a cache."""
        return self.slots.stager.slot_map

    def set_device_cache(self, profile: Any, cache_bytes: int) -> CacheInfo:
        """Cache the first rows of ``profile`` that fit in ``cache_bytes`` on the device.

        The rule of ``GpuTable.set_device_cache`` (``_layout.rows_that_fit``): ``profile`` is a
        RowProfile (``.row_ids``) or 1-D int row ids in priority order; rows outside the
        table's ``row_range`` are skipped, repeats keep their first place, and ``cache_bytes
        // record_bytes`` rows are kept. The slot map (4 bytes per served row) lives in host
        RAM here, not on the device. Call between steps, with no staged step pending (and
        before capturing a graph: the cache tensors are replaced). ``cache_bytes = 0`` turns
        the cache off.

        Returns:
            CacheInfo: cached rows and the device bytes they take (records + nvfp4 scale_2).

        Raises:
            KernelError: ids are not 1-D integers.
        """
        return self.slots.set_device_cache(profile, cache_bytes)

    set_hot_rows = set_device_cache  # deprecated: the old name of set_device_cache

    def share_cache(self, other: OnSlots) -> CacheInfo:
        """Serve from ``other``'s device cache (same table and row range; e.g. one
        :class:`GraphStagedTable` per step shape over one cache). Same rules as
        :meth:`set_device_cache` for when to call it.

        Raises:
            KernelError: ``other`` serves another table or row range.
        """
        return self.slots.share(other.slots)

    @property
    def cache_info(self) -> CacheInfo:
        """The device cache: rows and device bytes (0, 0 when off)."""
        return self.slots.cache_info

    @property
    def pinned_bytes(self) -> int:
        """Host bytes this table pins (its staging slots; no table rows)."""
        return self.slots.pinned_bytes


class StagedTable(SlotsFront):
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
        cold_hints: ``"off"`` (default), ``"on"`` or ``"auto"``: a step first asks the kernel to
            read the pages of the rows it gathers (``madvise(MADV_WILLNEED)`` per page run), for
            a table whose pages are not in the page cache; auto hints only while the process
            takes major page faults (``flashnext.kernels._cold``). Pair it with
            ``prefault=False``.
    """

    def __init__(
        self,
        table: PLETable,
        max_ids: int,
        buffers: int = 2,
        device: Any = "cuda",
        *,
        prefault: bool = True,
        workers: int | None = None,
        cold_hints: str = "off",
    ):
        knobs = StageKnobs(workers=workers or 0, cold_hints=cold_hints)
        self.slots = StagingSlots(table, max_ids, buffers, device, device_slots=True, knobs=knobs)
        self.table, self.layout, self.device = table, self.slots.layout, self.slots.device
        self.max_ids = self.slots.max_ids
        cuda = self.device.type == "cuda"
        self._copied = [torch.cuda.Event() if cuda else None for _ in range(buffers)]
        self._next = 0
        if prefault:
            prefault_pages(table)

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
        slots = self.slots  # one attribute read a step, not six (a decode step is ~100 us)
        slot = self._next
        self._next = (slot + 1) % len(slots.host)
        copied = self._copied[slot]
        if copied is not None:
            copied.synchronize()
        t_gather = time.perf_counter()
        flat = flat_ids(arr)
        n_unique = slots.stager.fill(slot, flat)
        t_copy = time.perf_counter()
        used = slots.offsets(flat.size, n_unique)[-1]
        slots.dev[slot][:used].copy_(slots.host[slot][:used], non_blocking=True)
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

    def lookup(self, batch: StagedBatch, out: Any = None) -> Any:
        """bf16 ``[T, heads * width]`` for a staged batch, on the current stream (the one
        :meth:`stage` enqueued the batch's copy on).

        Raises:
            KernelError: ``out`` has the wrong shape or dtype.
        """
        out = self.slots.out(batch.shape, out)
        self.slots.launch(self.slots.dev[batch.slot], batch.n_ids, batch.n_unique, out)
        return out

    def rows_into(self, ids: Any, out: Any) -> None:
        """:class:`~flashnext.kernels.rows.Rows`: :meth:`stage` (ids as torch or numpy int
        ``[T, heads]``) then :meth:`lookup` into ``out``."""
        host = ids.cpu().numpy() if hasattr(ids, "cpu") else ids
        self.lookup(self.stage(host), out=out)

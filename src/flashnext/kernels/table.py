"""GpuTable: one PLE table (or one tensor-parallel rank's rows of it) served to the GPU.

``placement="device"`` copies the table's per-row records into GPU memory; ``"pinned"`` keeps
them in pinned host memory that the kernel reads through UVA (zero-copy, as vLLM 0.33 does
with BF16 rows), optionally with a device cache in front. Either way
:meth:`GpuTable.lookup` is one kernel launch: no host sync, no allocation when ``out`` is given,
so it can be captured in a CUDA graph and replayed with new ids.

Ids are what vLLM 0.33's storage layer receives (``Qwen4ExpNGramEmbedding.compute_ngram_ids``):
int64 ``[T, heads]`` *global* row ids. A rank that owns rows ``[start, end)`` returns zero rows
for every other id (vLLM's ``_lookup_ple_embedding_from_pinned_kernel`` does the same), so the
ranks' outputs sum to the whole lookup. vLLM pads with valid ids (row 0 for DP padding); -1
also gives zero rows here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from flashnext._extras import require
from flashnext.errors import KernelError
from flashnext.host.table import PLETable, StoredTable
from flashnext.kernels._layout import rows_that_fit
from flashnext.kernels.records import RecordLayout, pack_records, record_layout
from flashnext.placement import Placement
from flashnext.ple.formats import E2M1_CODES, E4M3, Codec

torch = require("torch", "gpu", "GPU PLE lookups")
require("triton", "gpu", "GPU PLE lookups")
from flashnext.kernels import _triton_lookup as _lookup  # noqa: E402  (needs triton)

#: Pinned tables sort steps of at least this many ids before the gather (graph-safe, on the
#: GPU): over UVA sorted ids gathered 1.2x faster at 131K ids and 3.6x at 1M (H200, PCIe 5).
SORT_MIN_IDS = 32768
#: The same behind a device cache: at 131K real-text ids (55-85% hits) the sort cost more
#: than it saved (x0.8-0.95), at 1M ids it still gained 2-2.3x.
CACHED_SORT_MIN_IDS = 262144
_PACK_ROWS = 1 << 20  # rows packed per chunk when copying to the device


class UvaPointer:
    """A pinned host tensor presented to Triton by its UVA address (device-visible)."""

    def __init__(self, host: Any):
        self.host = host
        self.dtype = host.dtype

    def data_ptr(self) -> int:
        return int(self.host.data_ptr())


@dataclass(frozen=True)
class CacheInfo:
    """The device cache: ``rows`` cached rows, ``bytes`` of device memory (records + slot map)."""

    rows: int
    bytes: int


def code_luts(device: Any) -> tuple[Any, Any]:
    """float32 decode tables on ``device``: the 16 e2m1 codes and the 256 e4m3 bytes."""
    e4m3 = np.arange(256, dtype=np.uint8).view(E4M3).astype(np.float32)
    return (
        torch.from_numpy(np.ascontiguousarray(E2M1_CODES, dtype=np.float32)).to(device),
        torch.from_numpy(e4m3).to(device),
    )


def hot_row_ids(profile: Any) -> np.ndarray:
    """Row ids in priority order from an int array or a RowProfile (``.row_ids``)."""
    ids = getattr(profile, "row_ids", profile)
    arr = np.asarray(ids)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise KernelError(
            f"a profile must be 1-D integer row ids (or a RowProfile), found {arr.dtype} "
            f"{list(arr.shape)}"
        )
    return arr.astype(np.int64, copy=False)


class GpuTable:
    """Rows ``[row_start, row_end)`` of one table as records the lookup kernel reads.

    Build with :meth:`from_table` (an opened :class:`~flashnext.host.table.PLETable`) or
    :meth:`from_records` (records already packed, e.g. by a benchmark).
    """

    def __init__(
        self,
        layout: RecordLayout,
        records: Any,
        row_range: tuple[int, int],
        num_rows: int,
        *,
        shard_starts: np.ndarray,
        shard_scale_2: np.ndarray | None,
        device: Any,
    ):
        self.layout = layout
        self.records = records  # uint8 [rows, record_bytes]: device tensor or pinned host tensor
        self.row_range = (int(row_range[0]), int(row_range[1]))
        self.num_rows = int(num_rows)
        self.device = torch.device(device)
        on_host = records.device.type == "cpu" and self.device.type != "cpu"
        self.placement: Placement = "pinned" if on_host else "device"
        self._records_arg = UvaPointer(records) if self.placement == "pinned" else records
        self._e2m1, self._e4m3 = code_luts(self.device)
        self._starts = torch.from_numpy(np.asarray(shard_starts, dtype=np.int64)).to(self.device)
        s2 = np.ones(1, np.float32) if shard_scale_2 is None else shard_scale_2
        self._s2 = torch.from_numpy(np.asarray(s2, dtype=np.float32)).to(self.device)
        self._s2_mode = _lookup.S2_PER_SHARD if shard_scale_2 is not None else _lookup.S2_NONE
        self._slot_map: Any = None
        self._cache: Any = None
        self.sort_min_ids = SORT_MIN_IDS if self.placement == "pinned" else 0
        self._sort_ws: dict[tuple[int, Any], tuple[Any, Any]] = {}

    # -- building ------------------------------------------------------------------------
    @classmethod
    def from_table(
        cls,
        table: PLETable,
        placement: Placement = "device",
        row_range: tuple[int, int] | None = None,
        profile: Any = None,
        cache_bytes: int = 0,
        device: Any = "cuda",
    ) -> GpuTable:
        """Pack ``table``'s rows (or ``row_range`` of them) into records on ``device``.

        Args:
            table: an opened table; its :meth:`~PLETable.stored` tensors are read, not copied twice.
            placement: ``"device"`` (GPU memory) or ``"pinned"`` (pinned host memory over UVA).
            row_range: ``(start, end)`` global rows this rank serves; must lie inside the
                table's open ``row_range``. ``None`` = all open rows.
            profile: row ids in priority order (or a RowProfile) for the device cache in
                front of a pinned table, up to ``cache_bytes`` of records.
            cache_bytes: device bytes for cached records (the slot map, 4 bytes per served
                row, comes on top).
            device: the CUDA device (``"cpu"`` runs the kernel in Triton's interpreter).

        Raises:
            KernelError: bad placement, a row range outside the open rows, or a cache asked
                for with device placement.
        """
        stored = table.stored()
        start, end = _check_range(stored, row_range)
        layout = record_layout(stored.codec, stored.width)
        if placement not in ("device", "pinned"):  # "staged" is StagedTable's
            raise KernelError(
                f"placement must be 'device' or 'pinned' (staged: StagedTable), found {placement!r}"
            )
        host = placement == "pinned" and torch.device(device).type != "cpu"
        records = torch.empty(
            (end - start, layout.record_bytes),
            dtype=torch.uint8,
            pin_memory=host,
            device="cpu" if host else device,
        )
        _fill_records(stored, layout, start, end, records)
        s2 = _shard_scale_2(stored.codec, stored)
        gpu = cls(layout, records, (start, end), stored.num_rows, shard_starts=stored.shard_starts,
                  shard_scale_2=s2, device=device)  # fmt: skip
        if profile is not None and cache_bytes > 0:
            gpu.set_device_cache(profile, cache_bytes)
        return gpu

    @classmethod
    def from_records(
        cls,
        codec: Codec,
        width: int,
        records: Any,
        row_range: tuple[int, int],
        num_rows: int,
        *,
        shard_starts: Sequence[int] = (0,),
        shard_scale_2: Sequence[float] | None = None,
        device: Any = "cuda",
    ) -> GpuTable:
        """A table over already packed records (uint8 ``[end - start, record_bytes]``).

        Raises:
            KernelError: the records' shape does not match the layout and row range.
        """
        layout = record_layout(codec, width)
        rows = row_range[1] - row_range[0]
        if tuple(records.shape) != (rows, layout.record_bytes) or records.dtype != torch.uint8:
            raise KernelError(
                f"records are {records.dtype} {list(records.shape)}, expected uint8 "
                f"[{rows}, {layout.record_bytes}] for {codec.name} rows {row_range}"
            )
        s2 = None if shard_scale_2 is None else np.asarray(shard_scale_2, np.float32)
        return cls(layout, records, row_range, num_rows, shard_starts=np.asarray(shard_starts),
                   shard_scale_2=s2, device=device)  # fmt: skip

    def set_device_cache(self, profile: Any, cache_bytes: int) -> CacheInfo:
        """Cache the first rows of ``profile`` that fit in ``cache_bytes`` on the device.

        Rows outside this table's range are skipped; repeats keep their first place. Call
        between steps (not during graph replay): it replaces the cache tensors.

        Raises:
            KernelError: the table is device-placed (nothing to cache) or ids are not 1-D ints.
        """
        if self.placement != "pinned":
            raise KernelError("a device cache serves pinned tables; this one is on the device")
        start, end = self.row_range
        ids = hot_row_ids(profile)
        ids = ids[rows_that_fit(ids, self.row_range, cache_bytes, self.layout.record_bytes)]
        local = torch.from_numpy(ids - start)
        slot_map = torch.full((end - start,), -1, dtype=torch.int32, device=self.device)
        slot_map[local.to(self.device)] = torch.arange(
            ids.size, dtype=torch.int32, device=self.device
        )
        self._cache = self.records.index_select(0, local).to(self.device)
        self._slot_map = slot_map
        self.sort_min_ids = CACHED_SORT_MIN_IDS
        return self.cache_info

    set_hot_rows = set_device_cache  # deprecated: the old name of set_device_cache

    @property
    def slot_map(self) -> Any:
        """The device cache's slot of each served row (torch int32 ``[end - start]`` on the
        device, -1 = not cached), or None without a cache."""
        return self._slot_map

    @property
    def cache_info(self) -> CacheInfo:
        if self._cache is None:
            return CacheInfo(0, 0)
        return CacheInfo(
            int(self._cache.shape[0]),
            int(self._cache.numel() + 4 * self._slot_map.numel()),
        )

    # -- lookups -------------------------------------------------------------------------
    @property
    def width(self) -> int:
        return self.layout.width

    def rows_into(self, ids: Any, out: Any) -> None:
        """:class:`~flashnext.kernels.rows.Rows`: :meth:`lookup` into ``out``."""
        self.lookup(ids, out=out)

    def lookup(self, ids: Any, out: Any = None) -> Any:
        """bf16 ``[T, heads * width]`` rows for int ids ``[T, heads]`` (global row ids).

        ``-1`` and ids outside ``row_range`` give +0.0 rows. With ``out`` (bf16, contiguous,
        ``[T, heads * width]`` on the device) nothing waits on the host and, after the first
        call of each size, nothing is allocated, so the call can be captured in a CUDA graph
        (make one eager call first). Pinned tables sort steps of ``sort_min_ids`` ids or more
        on the GPU first (0 turns that off); the first such call allocates the sort's buffers.

        Raises:
            KernelError: ``ids`` is not a 2-D integer tensor on this table's device, or ``out``
                has the wrong shape, dtype or device.
        """
        if ids.dim() != 2 or ids.dtype not in (torch.int64, torch.int32):
            raise KernelError(f"ids must be int64 [T, heads], found {ids.dtype} {list(ids.shape)}")
        if ids.device != self.device and ids.device.type != self.device.type:
            raise KernelError(f"ids are on {ids.device}, the table is on {self.device}")
        shape = (ids.shape[0], ids.shape[1] * self.width)
        if out is None:
            out = torch.empty(shape, dtype=torch.bfloat16, device=ids.device)
        elif tuple(out.shape) != shape or out.dtype != torch.bfloat16 or not out.is_contiguous():
            raise KernelError(
                f"out is {out.dtype} {list(out.shape)}, expected contiguous bfloat16 {list(shape)}"
            )
        field = self.layout.fields[-1]
        flat, perm = ids.contiguous().reshape(-1), None
        if self.sort_min_ids and flat.numel() >= self.sort_min_ids:
            flat, perm = self._sorted(flat)
        _lookup.launch_lookup(
            flat,
            out,
            self._records_arg,
            fmt=self.layout.codec.name,
            width=self.width,
            record_bytes=self.layout.record_bytes,
            scale_offset=field.offset,
            row_start=self.row_range[0],
            row_end=self.row_range[1],
            e2m1=self._e2m1,
            e4m3=self._e4m3,
            s2=self._s2,
            s2_mode=self._s2_mode,
            shard_starts=self._starts,
            slot_map=self._slot_map,
            cache=self._cache,
            perm=perm,
        )
        return out

    def _sorted(self, flat: Any) -> tuple[Any, Any]:
        """``flat`` sorted ascending and the permutation, in buffers kept per size and dtype."""
        key = (flat.numel(), flat.dtype)
        ws = self._sort_ws.get(key)
        if ws is None:
            perm = torch.empty(flat.numel(), dtype=torch.int64, device=flat.device)
            ws = self._sort_ws[key] = (torch.empty_like(flat), perm)
        torch.sort(flat, out=ws)
        return ws

    def __repr__(self) -> str:
        return (
            f"GpuTable({self.layout.codec.name}, rows {self.row_range}, {self.placement}, "
            f"{self.records.numel() / 1e9:.2f} GB, cache {self.cache_info.rows} rows)"
        )


def _check_range(stored: StoredTable, row_range: tuple[int, int] | None) -> tuple[int, int]:
    lo, hi = stored.row_range
    start, end = (lo, hi) if row_range is None else (int(row_range[0]), int(row_range[1]))
    if not lo <= start < end <= hi:
        raise KernelError(
            f"row_range ({start}, {end}) is not inside the table's open rows ({lo}, {hi}); "
            "open the table with a wider row_range"
        )
    return start, end


def _fill_records(
    stored: StoredTable, layout: RecordLayout, start: int, end: int, records: Any
) -> None:
    """Pack rows ``[start, end)`` into ``records`` (host tensor: in place; device: by chunks)."""
    on_host = records.device.type == "cpu"
    dst = records.numpy() if on_host else None
    stage = None if on_host else np.empty((_PACK_ROWS, layout.record_bytes), np.uint8)
    for seg in stored.segments:
        lo, hi = max(start, seg.start), min(end, seg.start + seg.rows)
        for a in range(lo, hi, _PACK_ROWS):
            b = min(hi, a + _PACK_ROWS)
            part = {k: v[a - seg.start : b - seg.start] for k, v in seg.tensors.items()}
            if dst is not None:
                pack_records(layout, part, out=dst[a - start : b - start])
            else:
                packed = pack_records(layout, part, out=stage)
                records[a - start : b - start].copy_(torch.from_numpy(packed))


def _shard_scale_2(codec: Codec, stored: StoredTable) -> np.ndarray | None:
    names = [s.name for s in codec.specs if not s.per_row]
    if not names:
        return None
    if len(names) != 1:
        raise KernelError(f"{codec.name}: the kernel handles one per-shard scalar, found {names}")
    return np.asarray(stored.shard_scalars[names[0]], dtype=np.float32)

"""PLETable: row lookups from a sidecar, memory-mapped or resident, whole or one TP rank's rows.

``mmap`` maps each shard's tensors straight from the safetensors data offsets: nothing is read
until a row is gathered, and the cost in host RAM is reclaimable page cache. ``resident``
copies the rows into anonymous memory at open (slower to open, no cold-start page faults).
``row_range=(start, end)`` opens only the shards overlapping a tensor-parallel rank's rows;
ids of other ranks' rows give zero rows, so the rank's partial sums add up across ranks.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import numpy as np

from flashnext.errors import RowIdError, SidecarError
from flashnext.ple.formats import Codec
from flashnext.ple.preflight import HostMemory, check_fits
from flashnext.ple.sidecar import Sidecar, open_sidecar
from flashnext.safetensors_file import read_tensor

Residency = Literal["mmap", "resident"]
PAD_ID = -1


@dataclass
class _Segment:
    """Rows ``[start, start + rows)`` of the table held as arrays (maps or copies)."""

    start: int
    rows: int
    arrays: dict[str, np.ndarray]  # per-row tensors, leading dim = rows


@dataclass(frozen=True)
class StoredSegment:
    """Global rows ``[start, start + rows)`` as the format's stored per-row tensors.

    ``tensors[name]`` has shape ``[rows, *cols]`` (``[rows]`` for fp8's per-row scale) in the
    stored dtype: zero-copy views of the shard files (mmap) or anonymous copies (resident).
    """

    start: int
    rows: int
    tensors: Mapping[str, np.ndarray]


@dataclass(frozen=True)
class StoredTable:
    """What a :class:`PLETable` holds, for code that gathers rows itself (GPU kernels).

    ``segments`` are sorted, contiguous and cover exactly ``row_range``. Per-shard scalars
    (nvfp4 ``weight_scale_2``) are float32 ``[S]`` in ``shard_scalars[name]``, one per opened
    shard; shard ``k`` starts at global row ``shard_starts[k]`` (int64 ``[S]``). Format facts
    (names, dtypes, pad bytes) come from ``codec``.
    """

    format: str
    codec: Codec
    width: int
    num_rows: int
    row_range: tuple[int, int]
    residency: Residency
    segments: tuple[StoredSegment, ...]
    shard_starts: np.ndarray
    shard_scalars: Mapping[str, np.ndarray]


class PLETable:
    """Read-only access to one PLE layer's table; build it with :func:`open_table`."""

    def __init__(
        self,
        sidecar: Sidecar,
        residency: Residency,
        row_range: tuple[int, int] | None,
        preflight: bool | HostMemory = True,
    ):
        if residency not in ("mmap", "resident"):
            raise SidecarError(f"residency must be 'mmap' or 'resident', found {residency!r}")
        self.sidecar = sidecar
        self.residency: Residency = residency
        start, end = (
            (0, sidecar.num_rows) if row_range is None else (int(row_range[0]), int(row_range[1]))
        )
        if not 0 <= start < end <= sidecar.num_rows:
            raise SidecarError(
                f"{sidecar.path}: row_range ({start}, {end}) is not inside the table's "
                f"{sidecar.num_rows} rows"
            )
        self.row_range = (start, end)
        self._row_specs = [s for s in self.codec.specs if s.per_row]
        self._scalar_specs = [s for s in self.codec.specs if not s.per_row]
        shards = [
            sh for sh in sidecar.shards if sh.row_start < end and sh.row_start + sh.rows > start
        ]
        # Per-shard scalars (nvfp4 weight_scale_2), found per id by the shard's first row.
        self._shard_starts = np.array([sh.row_start for sh in shards], dtype=np.int64)
        self._shard_scalars = {
            spec.name: np.array([sh.scalars[spec.name] for sh in shards], dtype=np.float32)
            for spec in self._scalar_specs
        }
        if residency == "resident" and preflight is not False:
            check_fits(
                (end - start) * self.codec.bytes_per_row(self.width),
                f"a resident copy of {sidecar.path} ({self.format}, rows {start}..{end})",
                memory=preflight if isinstance(preflight, HostMemory) else None,
            )
        self._segments = self._open_segments(shards, start, end)
        self._starts = np.array([s.start for s in self._segments], dtype=np.int64)

    # -- description -------------------------------------------------------------------
    @property
    def codec(self) -> Codec:
        return self.sidecar.codec

    @property
    def format(self) -> str:
        return self.sidecar.format

    @property
    def num_rows(self) -> int:
        """Rows of the whole table (also when only a row range is open)."""
        return self.sidecar.num_rows

    @property
    def width(self) -> int:
        return self.sidecar.width

    @property
    def resident_bytes(self) -> int:
        """Anonymous memory held by a resident table (0 when memory-mapped)."""
        if self.residency == "mmap":
            return 0
        return sum(a.nbytes for seg in self._segments for a in seg.arrays.values())

    def stored(self) -> StoredTable:
        """The stored tensors of the open rows (no copy); see :class:`StoredTable`.

        Raises:
            SidecarError: the table is closed.
        """
        if not self._segments:
            raise SidecarError(f"{self.sidecar.path}: stored() on a closed table")
        return StoredTable(
            format=self.format,
            codec=self.codec,
            width=self.width,
            num_rows=self.num_rows,
            row_range=self.row_range,
            residency=self.residency,
            segments=tuple(StoredSegment(s.start, s.rows, dict(s.arrays)) for s in self._segments),
            shard_starts=self._shard_starts.copy(),
            shard_scalars={k: v.copy() for k, v in self._shard_scalars.items()},
        )

    # -- opening -------------------------------------------------------------------------
    def _open_segments(self, shards: list, start: int, end: int) -> list[_Segment]:
        maps = []
        for shard in shards:
            lo = max(start, shard.row_start) - shard.row_start
            hi = min(end, shard.row_start + shard.rows) - shard.row_start
            arrays = {}
            for spec in self._row_specs:
                full = read_tensor(shard.tensors[spec.name], shard.path, mmap=True)
                arrays[spec.name] = (
                    full.reshape(shard.rows, -1)[lo:hi]
                    if full.ndim > 1
                    else (full.reshape(shard.rows)[lo:hi])
                )
            maps.append(_Segment(shard.row_start + lo, hi - lo, arrays))
        if self.residency == "mmap":
            return maps
        # Resident: one anonymous array per tensor, so a lookup is a single gather.
        merged = {}
        for spec in self._row_specs:
            proto = maps[0].arrays[spec.name]
            dst = np.empty((end - start, *proto.shape[1:]), dtype=proto.dtype)
            for seg in maps:
                dst[seg.start - start : seg.start - start + seg.rows] = seg.arrays[spec.name]
            merged[spec.name] = dst
        return [_Segment(start, end - start, merged)]

    # -- lookups -------------------------------------------------------------------------
    def _check_ids(self, ids: object) -> np.ndarray:
        if not self._segments:
            raise SidecarError(f"{self.sidecar.path}: lookup on a closed table")
        arr = np.asarray(ids)
        if arr.dtype.kind not in "iu" and arr.size:
            raise RowIdError(f"row ids must be integers, found dtype {arr.dtype}")
        arr = arr.astype(np.int64, copy=False)
        bad = (arr < PAD_ID) | (arr >= self.num_rows)
        if bad.any():
            pos = np.argwhere(bad)[0]
            raise RowIdError(
                f"row id {int(arr[tuple(pos)])} at index {tuple(int(p) for p in pos)} is outside the "
                f"table {self.sidecar.path} of {self.num_rows} rows (use -1 for padding)"
            )
        return arr

    def gather_raw(self, ids: object) -> dict[str, np.ndarray]:
        """The stored tensors of rows ``ids``.

        Args:
            ids: int64, any shape ``[...]``: global row ids; ``-1`` pads.

        Returns:
            For each per-row tensor of the format, an array ``[..., cols]`` (``[...]`` for fp8's
            per-row scale) in its stored dtype; per-shard scalars (nvfp4 ``weight_scale_2``) as
            float32 ``[...]``. Padding ids and ids outside ``row_range`` give entries that
            dequantize to +0.0 rows (zero scales; int4 codes 0x88).

        Raises:
            IndexError: an id is ``< -1`` or ``>= num_rows``; the message names it.
        """
        arr = self._check_ids(ids)
        flat = arr.reshape(-1)
        n = flat.size
        start, end = self.row_range
        valid = (flat >= start) & (flat < end)
        all_valid = bool(valid.all())
        out: dict[str, np.ndarray] = {}
        if len(self._segments) == 1:
            # One array per tensor (resident, or a single shard): one gather, then pad fix-up.
            local = flat - start if all_valid else np.where(valid, flat - start, 0)
            for spec in self._row_specs:
                out[spec.name] = np.take(self._segments[0].arrays[spec.name], local, axis=0)
        else:
            for spec in self._row_specs:
                proto = self._segments[0].arrays[spec.name]
                out[spec.name] = np.empty((n, *proto.shape[1:]), dtype=proto.dtype)
            inside = np.arange(n) if all_valid else np.flatnonzero(valid)
            rows = flat[inside]
            seg_idx = np.searchsorted(self._starts, rows, side="right") - 1
            order = np.argsort(seg_idx, kind="stable")
            counts = np.bincount(seg_idx, minlength=len(self._segments))
            bounds = np.concatenate([[0], np.cumsum(counts)])
            for k in np.flatnonzero(counts):
                sel = order[bounds[k] : bounds[k + 1]]
                seg = self._segments[k]
                local = rows[sel] - seg.start
                for spec in self._row_specs:
                    out[spec.name][inside[sel]] = np.take(seg.arrays[spec.name], local, axis=0)
        for spec in self._scalar_specs:
            shard_idx = np.searchsorted(self._shard_starts, flat, side="right") - 1
            out[spec.name] = np.take(self._shard_scalars[spec.name], np.maximum(shard_idx, 0))
        if not all_valid:
            pad = ~valid
            for spec in self.codec.specs:
                out[spec.name][pad] = spec.pad
        shape = arr.shape
        return {k: v.reshape(*shape, *v.shape[1:]) for k, v in out.items()}

    def lookup(self, ids: object) -> np.ndarray:
        """Dequantized rows: float32 ``[..., width]`` for int ids ``[...]``.

        ``-1`` and ids of rows outside ``row_range`` give zero rows.

        Raises:
            IndexError: an id is ``< -1`` or ``>= num_rows``.
        """
        return dequantize_raw(self.codec, self.gather_raw(ids), self.width)

    # -- lifetime --------------------------------------------------------------------------
    def close(self) -> None:
        """Drop the maps and copies (memory maps close when their last view is gone)."""
        self._segments = []

    def __enter__(self) -> PLETable:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"PLETable({str(self.sidecar.path)!r}, format={self.format}, rows={self.num_rows}, "
            f"width={self.width}, residency={self.residency}, row_range={self.row_range})"
        )


def open_table(
    path: str | os.PathLike[str] | Sidecar,
    residency: Residency = "mmap",
    row_range: tuple[int, int] | None = None,
    preflight: bool | HostMemory = True,
) -> PLETable:
    """Open a sidecar directory for lookups.

    Args:
        path: the sidecar directory (or an already validated :class:`Sidecar`).
        residency: ``"mmap"`` (zero-copy maps of the shard files) or ``"resident"`` (copy the
            rows into anonymous memory now).
        row_range: ``(start, end)`` global rows this process serves (a tensor-parallel rank's
            rows); only overlapping shards are opened. ``None`` = the whole table.
        preflight: for ``resident``, refuse up front when host memory (MemAvailable, and the
            cgroup limit less usage plus reclaimable page cache) cannot hold the copy; a
            :class:`HostMemory` checks against that reading instead (another host's, say).

    Raises:
        SidecarError: the directory is not a valid sidecar or ``row_range`` is out of bounds.
        PreflightError: a resident copy would not fit in host memory.
    """
    sidecar = path if isinstance(path, Sidecar) else open_sidecar(path)
    return PLETable(sidecar, residency, row_range, preflight)


def dequantize_raw(codec: Codec, raw: Mapping[str, np.ndarray], width: int) -> np.ndarray:
    """Dequantize :meth:`PLETable.gather_raw` output ``[...]`` to float32 ``[..., width]``."""
    first = codec.specs[0]
    lead = np.shape(raw[first.name])[:-1]
    n = int(np.prod(lead, dtype=np.int64))
    if n == 0:
        return np.zeros((*lead, width), dtype=np.float32)
    flat = {k: np.asarray(v).reshape(n, *np.shape(v)[len(lead) :]) for k, v in raw.items()}
    return codec.dequantize(flat).reshape(*lead, width)

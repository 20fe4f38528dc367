"""PLETable: row lookups from a sidecar, memory-mapped, resident or with a hot tier.

``mmap`` maps each shard's tensors straight from the safetensors data offsets: nothing is read
until a row is gathered, the cost in host RAM is reclaimable page cache, and the maps are
advised ``MADV_RANDOM`` so one row does not drag in readahead. ``resident`` copies the rows
into anonymous memory at open. ``hot_tier`` (mmap only) copies the most-used rows of a
profile (:mod:`flashnext.store.profile`) into a small anonymous tier at open, in one pass in
file order; every other row stays mapped. :meth:`PLETable.warm` pulls the mapped files into
the page cache in the background.

``row_range=(start, end)`` opens only the shards overlapping a tensor-parallel rank's rows;
ids of other ranks' rows give zero rows, so the rank's partial sums add up across ranks.

Lookups run the fused kernels of :mod:`flashnext.host.lookup_kernels` (one pass per id, GIL
released, big batches split over threads); :meth:`PLETable.reference_lookup` is the plain
numpy path they are tested against. A table is safe to use from several threads at once.
"""

from __future__ import annotations

import mmap
import numbers
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

import numpy as np

from flashnext.errors import RowIdError, SidecarError
from flashnext.host import lookup_kernels as kern
from flashnext.host.mapping import MADV_POPULATE_READ, Warming, advise, will_need
from flashnext.host.preflight import HostMemory, check_fits
from flashnext.placement import RESIDENCIES, Residency
from flashnext.ple.formats import BF16, Codec
from flashnext.store.profile import RowProfile
from flashnext.store.sidecar import Shard, Sidecar, open_sidecar
from flashnext.words import say_renamed

#: A hot tier: a profile (:func:`~flashnext.store.profile.load_profile` reads one from a file;
#: ``profile.row_ids[:n]`` keeps its top n) or row ids (int, 1-D) in priority order.
HotTier = Union[RowProfile, np.ndarray, None]  # noqa: UP007
PAD_ID = -1
_NO_SCALARS = np.zeros(0, np.float32)
_NO_ROWS = np.zeros((0, 0), np.uint8)  # the absent second tensor of a one-tensor format
_INT64 = np.dtype(np.int64)

_KERNELS: dict[str, Callable[..., int]] = {
    "bf16": kern.lookup_bf16,
    "fp8": kern.lookup_fp8,
    "int4": kern.lookup_int4,
    "nvfp4": kern.lookup_nvfp4,
}
# lookup's out dtype (as a dtype or a scalar type) -> the bits the kernels write.
_OUT_BITS: dict[Any, np.dtype[Any]] = {
    np.dtype(np.float32): np.dtype(np.float32),
    np.float32: np.dtype(np.float32),
    BF16: np.dtype(np.uint16),
    BF16.type: np.dtype(np.uint16),
}


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


@dataclass(frozen=True)
class _Locator:
    """What a kernel call needs to find rows (see :mod:`flashnext.host.lookup_kernels`).

    Holding it keeps every addressed array alive, so a call in flight survives ``close()``.
    """

    loc: np.ndarray  # int64: geometry, shard starts, addresses, row bytes, hot ids
    scalars: np.ndarray  # float32 [S]
    hot_tier_rows: int
    keep: tuple[Any, ...]


class PLETable:
    """Read-only access to one PLE layer's table; build it with :func:`open_table`."""

    def __init__(
        self,
        sidecar: Sidecar,
        residency: Residency,
        row_range: tuple[int, int] | None,
        preflight: bool | HostMemory = True,
        hot_tier: HotTier = None,
        threads: int | None = None,
    ):
        if residency not in RESIDENCIES:
            raise SidecarError(f"residency must be 'mmap' or 'resident', found {residency!r}")
        self.sidecar = sidecar
        self.residency: Residency = residency
        #: Threads a big batch is split over (``FLASHNEXT_LOOKUP_THREADS`` or the CPUs).
        self.threads = threads or kern.default_threads()
        start, end = (0, sidecar.num_rows) if row_range is None else _row_range(row_range)
        if not 0 <= start < end <= sidecar.num_rows:
            raise SidecarError(
                f"{sidecar.path}: row_range ({start}, {end}) is not inside the table's "
                f"{sidecar.num_rows} rows"
            )
        _refuse_missing_rows(sidecar, start, end, row_range is None)
        self.row_range = (start, end)
        self._warming: Warming | None = None  # background warming in progress
        self._set_layout()
        self._shards = [
            sh for sh in sidecar.shards if sh.row_start < end and sh.row_start + sh.rows > start
        ]
        # Per-shard scalars (nvfp4 weight_scale_2), found per id by the shard's first row.
        self._shard_starts = np.array([sh.row_start for sh in self._shards], dtype=np.int64)
        self._shard_scalars = {
            spec.name: np.array([sh.scalars[spec.name] for sh in self._shards], dtype=np.float32)
            for spec in self._scalar_specs
        }
        memory = preflight if isinstance(preflight, HostMemory) else None
        if residency == "resident" and preflight is not False:
            check_fits(
                (end - start) * self.codec.bytes_per_row(self.width),
                f"a resident copy of {sidecar.path} ({self.format}, rows {start}..{end})",
                memory=memory,
            )
        # mmap residency: each shard file's map, for populate_maps and warming
        self._maps: dict[Path, mmap.mmap] = {}
        self._segments = self._open_segments(start, end)
        self._state: _Locator | None = self._locator({}, np.zeros(0, np.int64))
        hot_ids = self._hot_ids(hot_tier)
        if hot_ids.size:
            if preflight is not False:
                check_fits(  # the rows, and the index (at most 2 bits per open row)
                    hot_ids.size * self.codec.bytes_per_row(self.width) + (end - start) // 4,
                    f"the hot tier of {sidecar.path} ({hot_ids.size:,} rows)",
                    memory=memory,
                )
            self._state = self._locator(self._load_hot(hot_ids), hot_ids)
        self._warm_up()

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
    def hot_tier_rows(self) -> int:
        """Rows held in the hot tier (0 without one)."""
        return 0 if self._state is None else self._state.hot_tier_rows

    hot_rows = hot_tier_rows  # deprecated: the old name of hot_tier_rows

    @property
    def resident_bytes(self) -> int:
        """Anonymous memory held for rows: the whole copy (resident) or the hot tier (mmap)."""
        hot = self.hot_tier_rows * self.codec.bytes_per_row(self.width)
        if self.residency == "mmap":
            return hot
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
    def _set_layout(self) -> None:
        """What every call reuses: the format's tensors, kernel and gather_raw layout."""
        self._row_specs = [s for s in self.codec.specs if s.per_row]
        self._scalar_specs = [s for s in self.codec.specs if not s.per_row]
        self._kernel = _KERNELS[self.format]
        self._row_names = [s.name for s in self._row_specs]
        # gather_raw's outputs: (name, dtype, shape after the ids' shape) per tensor
        self._raw_layout = [
            (s.name, s.dtype if s.per_row else np.dtype(np.float32), s.shape(1, self.width)[1:])
            for s in self.codec.specs
        ]
        # pad byte per row tensor, and one for the absent second tensor of a one-tensor format
        self._pads = np.array([s.pad for s in self._row_specs] + [0], dtype=np.uint8)
        # gather_raw without ``out``: the kernel writes bytes [n, row_bytes] per row tensor,
        # handed back as views in the stored dtype (fewer numpy calls per decode-sized batch)
        self._row_bytes = [
            int(np.prod(tail, dtype=np.int64)) * np.dtype(dt).itemsize
            for name, dt, tail in self._raw_layout
            if name in self._row_names
        ]
        # ... and how each result comes out of them: (name, index into the byte buffers or -1
        # for the per-shard scalar, dtype to view the bytes as or None, shape after the ids',
        # whether 1-D ids need a reshape: fp8's scale [n, 4] bytes -> float32 [n])
        self._raw_views: list[tuple[str, int, np.dtype | None, tuple[int, ...], bool]] = []
        for name, dt, tail in self._raw_layout:
            k = self._row_names.index(name) if name in self._row_names else -1
            view = None if k < 0 or dt == np.uint8 else np.dtype(dt)
            self._raw_views.append((name, k, view, tail, k >= 0 and not tail))

    def _map_shard(self, shard: Shard, lo: int, hi: int) -> _Segment:
        # One map of the whole file, the tensors views into it: a map per tensor would leave
        # the 2 MiB pieces where one tensor ends and the next begins on 4 KiB pages (a page
        # table entry must cover 2 MiB of one map), a quarter of a 20 MB shard.
        with open(shard.path, "rb") as fh:
            whole = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        if self.residency == "mmap":
            if hasattr(whole, "madvise"):
                whole.madvise(mmap.MADV_RANDOM)  # a row is ~100 bytes: no readahead
            self._maps[shard.path] = whole
        arrays = {}
        for spec in self._row_specs:
            entry = shard.tensors[spec.name]
            count = int(np.prod(entry.shape, dtype=np.int64))
            full = np.frombuffer(whole, dtype=entry.dtype, count=count, offset=entry.offset)
            arrays[spec.name] = full.reshape(spec.shape(shard.rows, self.width))[lo:hi]
        return _Segment(shard.row_start + lo, hi - lo, arrays)

    def _open_segments(self, start: int, end: int) -> list[_Segment]:
        maps = []
        for shard in self._shards:
            lo = max(start, shard.row_start) - shard.row_start
            hi = min(end, shard.row_start + shard.rows) - shard.row_start
            maps.append(self._map_shard(shard, lo, hi))
        if self.residency == "mmap":
            return maps
        # Resident: one anonymous array per tensor, filled shard by shard in file order.
        merged = {}
        for spec in self._row_specs:
            proto = maps[0].arrays[spec.name]
            dst = np.empty((end - start, *proto.shape[1:]), dtype=proto.dtype)
            for seg in maps:
                dst[seg.start - start : seg.start - start + seg.rows] = seg.arrays[spec.name]
            merged[spec.name] = dst
        return [_Segment(start, end - start, merged)]

    def _locator(self, hot: Mapping[str, np.ndarray], hot_ids: np.ndarray) -> _Locator:
        """What the kernels need: per open shard its first open row and each tensor's address
        of that row, and the hot tier's copy, packed by :func:`~lookup_kernels.pack_locator`."""
        start, end = self.row_range
        seg_start = np.maximum(self._shard_starts, start)
        n_s, n_t = seg_start.size, len(self._row_specs)
        bases = np.zeros((n_t, n_s + 1), dtype=np.int64)
        row_bytes = np.zeros(n_t, dtype=np.int64)
        for t, spec in enumerate(self._row_specs):
            for k, first in enumerate(seg_start.tolist()):
                seg = self._segments[0 if self.residency == "resident" else k]
                arr = seg.arrays[spec.name]
                bases[t, k] = arr.ctypes.data + (first - seg.start) * arr.strides[0]
                row_bytes[t] = arr.strides[0]
            if hot:
                bases[t, -1] = hot[spec.name].ctypes.data
        loc, index = kern.pack_locator(
            self.sidecar.rows_per_shard, self._shards[0].index, (start, end), self.num_rows,
            self.format, seg_start, bases, row_bytes, hot_ids,
        )  # fmt: skip
        scal = self._shard_scalars
        scalars = next(iter(scal.values())) if scal else np.ones(n_s, np.float32)
        keep = (self._segments, dict(hot), index)
        return _Locator(loc, scalars, int(hot_ids.size), keep)

    def _hot_ids(self, hot_tier: HotTier) -> np.ndarray:
        """The hot tier's global row ids inside row_range, unique and sorted (file order)."""
        if hot_tier is None:
            return np.zeros(0, np.int64)
        if self.residency != "mmap":
            raise SidecarError(
                f"{self.sidecar.path}: hot_tier applies to residency='mmap'; a resident table "
                "already holds every row in memory"
            )
        ids = hot_tier.row_ids if isinstance(hot_tier, RowProfile) else hot_tier
        if (
            not isinstance(ids, np.ndarray)
            or ids.ndim != 1
            or (ids.size and ids.dtype.kind not in "iu")
        ):
            found = f"{ids.dtype} {list(ids.shape)}" if isinstance(ids, np.ndarray) else type(ids)
            raise SidecarError(
                f"{self.sidecar.path}: hot_tier must be a RowProfile or 1-D integer row ids, "
                f"found {found} (load a profile file with flashnext.store.profile.load_profile)"
            )
        ids = ids.astype(np.int64, copy=False)
        bad = ids[(ids < 0) | (ids >= self.num_rows)]
        if bad.size:
            raise SidecarError(
                f"{self.sidecar.path}: hot-tier row id {int(bad[0])} is outside the table's "
                f"{self.num_rows} rows; was the profile built for another table?"
            )
        start, end = self.row_range
        return np.unique(ids[(ids >= start) & (ids < end)])

    def _load_hot(self, hot_ids: np.ndarray) -> dict[str, np.ndarray]:
        """Copy rows ``hot_ids`` (sorted) out of the maps.

        The file ranges holding them are read first, in order and in large pieces: gathering
        straight from the ``MADV_RANDOM`` maps would fault them in one 4 KiB page at a time
        (a 4 KiB page holds ~40 int4 rows, so a 5% tier touches most pages of the files)."""
        ranges = self.row_ranges(hot_ids)
        Warming(ranges, maps=self._maps).run()
        self._map_ranges(ranges)
        raw = self.gather_raw(hot_ids)
        return {spec.name: raw[spec.name] for spec in self._row_specs}

    def _map_ranges(self, ranges: list[tuple[Path, int, int]]) -> None:
        """Map the cached pages of ``ranges`` (page-aligned offsets) into the table's maps now
        (``MADV_POPULATE_READ``, GIL released). The hot tier's read leaves them cached but
        mapped only in its temporary maps; unmapped, every row a lookup reads later takes a
        page fault of its own wherever the page cache holds 4 KiB folios (no 2 MiB folio to
        map at once: a fragmented or busy host), ~0.8 us per row, 40 ms over 100 decode
        steps (issue 26). Mapping them costs a fraction of that, once, at open."""
        for path, offset, length in ranges:
            view = self._maps.get(path)
            if view is None:
                continue
            try:
                advise(view, MADV_POPULATE_READ, offset, length)
            except (OSError, ValueError):  # an older kernel or another OS
                return

    def _warm_up(self) -> None:
        """Load the kernels now (from numba's on-disk cache) so no request pays for it."""
        pad = np.full(1, PAD_ID, np.int64)
        self.lookup(pad)
        self.lookup(pad, dtype=BF16)
        self.gather_raw(pad)

    # -- lookups -------------------------------------------------------------------------
    def _read_ahead(self, state: _Locator, ids: np.ndarray) -> None:
        """While warming runs: start the reads of every page rows ``ids`` need at once. Each
        lookup page fault is a 4 KiB read that waits in the disk's queue behind the warmer's
        2 MiB reads (no I/O priorities on a VM's queue); one at a time, 512 of them made the
        first decode step 318-420 ms (issue 26). Asked together, they wait once. Costs ~1 us
        per page asked (0.6 ms for a 512-id step), and nothing once warming is done."""
        if self._warming is not None and self._warming.done:
            self._warming = None  # warm: nothing left to read ahead
            return
        will_need(kern.row_pages(ids, state.loc))

    def _state_or_raise(self) -> _Locator:
        state = self._state
        if state is None:
            raise SidecarError(f"{self.sidecar.path}: lookup on a closed table")
        return state

    def _as_ids(self, ids: object) -> np.ndarray:
        if type(ids) is np.ndarray and ids.dtype == _INT64 and ids.flags.c_contiguous:
            return ids  # the common case, without a copy or a scan
        arr = _no_wrapping_ids(ids)
        if arr.dtype.kind not in "iu" and arr.size:
            raise RowIdError(f"row ids must be integers, found dtype {arr.dtype}")
        return np.asarray(arr, dtype=np.int64, order="C")  # a 0-d id stays 0-d

    def _raise_bad(self, arr: np.ndarray, index: int) -> None:
        pos = tuple(int(p) for p in np.unravel_index(index, arr.shape))
        raise RowIdError(
            f"row id {int(arr.reshape(-1)[index])} at index {pos} is outside the table "
            f"{self.sidecar.path} of {self.num_rows} rows (use -1 for padding)"
        )

    def lookup(
        self, ids: object, out: np.ndarray | None = None, dtype: Any = np.float32
    ) -> np.ndarray:
        """Dequantized rows ``[..., width]`` for int ids ``[...]``.

        Args:
            ids: int, any shape: global row ids; ``-1`` pads.
            out: optional C-contiguous destination of shape ``[..., width]`` and ``dtype``.
            dtype: ``np.float32`` (bit-exact with :meth:`reference_lookup`) or
                ``ml_dtypes.bfloat16`` (that float32 rounded to nearest-even).

        Returns:
            ``out`` (or a new array). ``-1`` and ids of rows outside ``row_range`` give +0.0 rows.

        Raises:
            IndexError: an id is ``< -1`` or ``>= num_rows`` (the message names it).
            ValueError: ``dtype`` or ``out`` does not fit.
            SidecarError: the table is closed.
        """
        state = self._state_or_raise()
        arr = self._as_ids(ids)
        bits_dtype = _OUT_BITS.get(dtype)
        if bits_dtype is None:
            dtype = np.dtype(dtype)  # a name such as "float32"
            bits_dtype = _OUT_BITS.get(dtype)
            if bits_dtype is None:
                raise ValueError(f"lookup dtype must be float32 or bfloat16, found {dtype}")
        shape = (*arr.shape, self.width)
        if out is None:
            out = np.empty(shape, dtype=dtype)
        elif out.dtype != dtype or out.shape != shape or not out.flags.c_contiguous:
            raise ValueError(
                f"out must be a C-contiguous {np.dtype(dtype)} array of shape {list(shape)}, "
                f"found {out.dtype} {list(out.shape)}"
            )
        n = arr.size
        if n:
            bits = out.view(bits_dtype)
            if bits.ndim != 2:
                bits, arr_flat = bits.reshape(n, self.width), arr.reshape(n)
            else:
                arr_flat = arr
            args = (state.loc, state.scalars, bits)
            if self._warming is not None:
                self._read_ahead(state, arr_flat)
            bad = kern.run_split(self._kernel, arr_flat, args, self.threads)
            if bad >= 0:
                self._raise_bad(arr, bad)
        return out

    def gather_raw(
        self, ids: object, out: Mapping[str, np.ndarray] | None = None
    ) -> dict[str, np.ndarray]:
        """The stored tensors of rows ``ids``.

        Args:
            ids: int, any shape ``[...]``: global row ids; ``-1`` pads.
            out: optional destinations, one per tensor name, shaped as the result below.

        Returns:
            For each per-row tensor of the format, an array ``[..., cols]`` (``[...]`` for fp8's
            per-row scale) in its stored dtype; per-shard scalars (nvfp4 ``weight_scale_2``) as
            float32 ``[...]``. Padding ids and ids outside ``row_range`` give entries that
            dequantize to +0.0 rows (the format's pad bytes; zero scalars).

        Raises:
            IndexError: an id is ``< -1`` or ``>= num_rows``; the message names it.
            ValueError: an ``out`` array is missing or has the wrong dtype or shape.
        """
        state = self._state_or_raise()
        arr = self._as_ids(ids)
        n = arr.size
        flat = arr if arr.ndim == 1 else arr.reshape(n)
        if out is None:
            dst = [np.empty((n, size), np.uint8) for size in self._row_bytes]
            scal = np.empty(n, np.float32) if self._scalar_specs else _NO_SCALARS
        else:
            given = self._raw_buffers(arr.shape, out)
            dst = [given[name].reshape(n, -1).view(np.uint8) for name in self._row_names]
            scal = _NO_SCALARS
            if self._scalar_specs:
                scal = given[self._scalar_specs[0].name].reshape(n)
        second = dst[1] if len(dst) > 1 else _NO_ROWS
        args = (state.loc, state.scalars, dst[0], second, self._pads, scal)
        if self._warming is not None:
            self._read_ahead(state, flat)
        bad = kern.run_split(kern.gather_rows, flat, args, self.threads)
        if bad >= 0:
            self._raise_bad(arr, bad)
        if out is not None:
            return given
        lead = arr.shape if arr.ndim != 1 else None
        result = {}
        for name, k, view, tail, flatten in self._raw_views:
            got = scal if k < 0 else dst[k] if view is None else dst[k].view(view)
            if lead is not None:
                got = got.reshape(*lead, *tail)
            elif flatten:
                got = got.reshape(n)
            result[name] = got
        return result

    def _raw_buffers(
        self, shape: tuple[int, ...], out: Mapping[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        """``out`` checked against the layout of ids of ``shape``."""
        result = {}
        for name, dtype, tail in self._raw_layout:
            want = (*shape, *tail)
            got = out.get(name)
            if got is None or got.dtype != dtype or got.shape != want or not got.flags.c_contiguous:
                found = "missing" if got is None else f"{got.dtype} {list(got.shape)}"
                raise ValueError(
                    f"out[{name!r}] must be a C-contiguous {dtype} array of shape "
                    f"{list(want)}, found {found}"
                )
            result[name] = got
        return result

    # -- the numpy reference -----------------------------------------------------------------
    def reference_gather_raw(self, ids: object) -> dict[str, np.ndarray]:
        """:meth:`gather_raw` in plain numpy from the stored segments (the hot tier unused)."""
        self._state_or_raise()
        arr = self._as_ids(ids)
        flat = arr.reshape(-1)
        bad = np.flatnonzero((flat < PAD_ID) | (flat >= self.num_rows))
        if bad.size:
            self._raise_bad(arr, int(bad[0]))
        start, end = self.row_range
        valid = (flat >= start) & (flat < end)
        rows = flat[valid]
        seg_idx = np.searchsorted([s.start for s in self._segments], rows, side="right") - 1
        out: dict[str, np.ndarray] = {}
        for spec in self._row_specs:
            proto = self._segments[0].arrays[spec.name]
            out[spec.name] = np.empty((flat.size, *proto.shape[1:]), dtype=proto.dtype)
            out[spec.name][~valid] = spec.pad
            picked = np.empty((rows.size, *proto.shape[1:]), dtype=proto.dtype)
            for k in np.unique(seg_idx):
                sel = seg_idx == k
                seg = self._segments[k]
                picked[sel] = np.take(seg.arrays[spec.name], rows[sel] - seg.start, axis=0)
            out[spec.name][valid] = picked
        for spec in self._scalar_specs:
            shard = np.searchsorted(self._shard_starts, flat, side="right") - 1
            values = np.take(self._shard_scalars[spec.name], np.maximum(shard, 0))
            out[spec.name] = np.where(valid, values, np.float32(spec.pad)).astype(np.float32)
        return {k: v.reshape(*arr.shape, *v.shape[1:]) for k, v in out.items()}

    def reference_lookup(self, ids: object) -> np.ndarray:
        """:meth:`lookup` (float32) through the numpy codec: the reference for the kernels."""
        return dequantize_raw(self.codec, self.reference_gather_raw(ids), self.width)

    # -- cold start ------------------------------------------------------------------------
    def warm(
        self,
        background: bool = True,
        progress: Callable[[int], None] | None = None,
        populate: bool = True,
    ) -> Warming:
        """Pull the open rows' bytes of every shard file into the page cache.

        Faults the files in front to back in large pieces through a temporary map advised
        ``MADV_HUGEPAGE`` (2 MiB page-cache folios where the filesystem allows; elsewhere large
        reads after ``posix_fadvise(WILLNEED)`` into one reused buffer): no anonymous copy of
        the table. Lookups keep running meanwhile.
        Then maps the cached pages into the process (:meth:`populate_maps`): the first
        lookups after warming take no page faults, on huge pages where the kernel allows.

        Args:
            background: run in a daemon thread and return at once (``Warming.wait()`` joins).
            progress: called with the bytes read after each piece.
            populate: map the pages afterwards (False for a process that only warms the cache
                for another one, such as ``flashnext ple warm``).
        """
        then = self.populate_maps if populate else None
        warming = Warming(self.file_ranges(), progress, then=then, maps=self._maps)
        if background:
            self._warming = warming  # lookups read their rows ahead until it is done
            warming.start()
        else:
            warming.run()
        return warming

    def file_ranges(self) -> list[tuple[Path, int, int]]:
        """``(file, offset, length)`` of the open rows' bytes, per shard and tensor."""
        start, end = self.row_range
        ranges = []
        for shard in self._shards:
            lo = max(start, shard.row_start) - shard.row_start
            hi = min(end, shard.row_start + shard.rows) - shard.row_start
            for spec in self._row_specs:
                entry = shard.tensors[spec.name]
                row_bytes = entry.nbytes // shard.rows
                ranges.append((shard.path, entry.offset + lo * row_bytes, (hi - lo) * row_bytes))
        return ranges

    def row_ranges(self, row_ids: np.ndarray, gap: int = 1 << 20) -> list[tuple[Path, int, int]]:
        """``(file, offset, length)`` covering rows ``row_ids`` (int64 [n], sorted, open rows),
        per shard and tensor, page-aligned, ranges closer than ``gap`` bytes merged."""
        page = mmap.PAGESIZE
        ranges = []
        for shard in self._shards:
            lo, hi = np.searchsorted(row_ids, [shard.row_start, shard.row_start + shard.rows])
            local = row_ids[lo:hi] - shard.row_start
            if not local.size:
                continue
            for spec in self._row_specs:
                entry = shard.tensors[spec.name]
                row_bytes = entry.nbytes // shard.rows
                first = (entry.offset + local * row_bytes) // page * page
                last = entry.offset + (local + 1) * row_bytes  # exclusive
                cut = np.flatnonzero(first[1:] - last[:-1] > gap) + 1
                starts, ends = first[np.r_[0, cut]], last[np.r_[cut - 1, local.size - 1]]
                ranges += [(shard.path, int(a), int(b - a)) for a, b in zip(starts, ends)]
        return ranges

    def populate_maps(self) -> None:
        """Map every cached page of the shard files into this process now
        (``MADV_POPULATE_READ``, Linux >= 5.14), so lookups take no page faults; where the
        page cache holds 2 MiB folios (large sequential reads on a filesystem with large
        folios, e.g. ext4 on Linux >= 6.16, xfs) they are mapped as huge pages, so random rows
        stop missing the TLB. A no-op where the kernel lacks the advice."""
        for handle in self._maps.values():
            try:
                advise(handle, MADV_POPULATE_READ)
            except (OSError, ValueError):  # an older kernel or another OS
                return

    # -- lifetime --------------------------------------------------------------------------
    def close(self) -> None:
        """Drop the maps and copies (memory maps close when their last view is gone)."""
        self._state = None
        self._segments = []
        self._maps = {}

    def __enter__(self) -> PLETable:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"PLETable({str(self.sidecar.path)!r}, format={self.format}, rows={self.num_rows}, "
            f"width={self.width}, residency={self.residency}, row_range={self.row_range}, "
            f"hot_tier_rows={self.hot_tier_rows})"
        )


def open_table(
    path: str | os.PathLike[str] | Sidecar,
    residency: Residency = "mmap",
    row_range: tuple[int, int] | None = None,
    preflight: bool | HostMemory = True,
    hot_tier: HotTier = None,
    threads: int | None = None,
    *,
    hot_rows: HotTier = None,
) -> PLETable:
    """Open a sidecar directory for lookups.

    Args:
        path: the sidecar directory (or an already validated :class:`Sidecar`).
        residency: ``"mmap"`` (zero-copy maps of the shard files) or ``"resident"`` (copy the
            rows into anonymous memory now).
        row_range: ``(start, end)`` global rows this process serves (a tensor-parallel rank's
            rows); only overlapping shards are opened. ``None`` = the whole table.
        preflight: for a resident copy or a hot tier, refuse up front when host memory
            (MemAvailable, the cgroup limit less usage plus reclaimable page cache, and the
            commit limit under ``vm.overcommit_memory=2``) cannot hold it; a
            :class:`HostMemory` checks against that reading instead (another host's, say).
        hot_tier: mmap only: a :class:`RowProfile` or row ids (int, 1-D) in priority
            order, copied into anonymous memory at open; other rows stay mapped.
        threads: threads a big lookup is split over (default: the CPUs this process may use).
        hot_rows: the old name of ``hot_tier`` (one deprecation line).

    Raises:
        SidecarError: the directory is not a valid sidecar, ``row_range`` is out of bounds, or
            ``hot_tier`` is not a profile or 1-D integer ids, or names rows outside the table.
        PreflightError: a resident copy or hot tier would not fit in host memory.
    """
    sidecar = path if isinstance(path, Sidecar) else open_sidecar(path)
    if hot_rows is not None:
        say_renamed("open_table(hot_rows=)", "open_table(hot_tier=)")
        hot_tier = hot_rows if hot_tier is None else hot_tier
    return PLETable(sidecar, residency, row_range, preflight, hot_tier, threads)


def _row_range(value: Any) -> tuple[int, int]:
    """``(start, end)`` as two ints, refused by name otherwise: ``int()`` would quietly floor
    a rank's row bounds computed with true division (or parse strings)."""
    ok = isinstance(value, (tuple, list)) and len(value) == 2
    if not ok or not all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in value):
        raise SidecarError(f"row_range must be two integers (start, end), found {value!r}")
    return int(value[0]), int(value[1])


def _refuse_missing_rows(sidecar: Sidecar, start: int, end: int, whole: bool) -> None:
    """Refuse rows ``[start, end)`` of a slice that does not hold them all, naming the missing."""
    missing = sidecar.missing_rows(start, end)
    if not missing:
        return
    gaps = ", ".join(f"{lo}..{hi}" for lo, hi in missing[:4]) + (" ..." if len(missing) > 4 else "")
    asked = "the whole table (no row_range)" if whole else f"rows {start}..{end}"
    raise SidecarError(
        f"{sidecar.path}: a slice holding rows {sidecar.present_text()} of {sidecar.num_rows}; "
        f"{asked} needs rows {gaps}, which it does not hold: serve this rank from a slice with its "
        "ranks (`flashnext ple slice SIDECAR DST --tp N --ranks R`) or from the full sidecar"
    )


def dequantize_raw(codec: Codec, raw: Mapping[str, np.ndarray], width: int) -> np.ndarray:
    """Dequantize :meth:`PLETable.gather_raw` output ``[...]`` to float32 ``[..., width]``."""
    first = codec.specs[0]
    lead = np.shape(raw[first.name])[:-1]
    n = int(np.prod(lead, dtype=np.int64))
    if n == 0:
        return np.zeros((*lead, width), dtype=np.float32)
    flat = {k: np.asarray(v).reshape(n, *np.shape(v)[len(lead) :]) for k, v in raw.items()}
    return codec.dequantize(flat).reshape(*lead, width)


def _no_wrapping_ids(ids: object) -> np.ndarray:
    """``ids`` as an array, refusing unsigned ids that int64 would wrap to -1 (padding)."""
    arr = np.asarray(ids)
    if arr.dtype.kind == "u" and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
        raise RowIdError(
            f"row id {int(arr.max())} does not fit in int64 (it would wrap to a negative id); "
            "ids must be in [-1, num_rows)"
        )
    return arr

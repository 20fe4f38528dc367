"""The staged path's layouts, declared once: the step context, the slot, the device cache.

Read by the numba kernels (:mod:`flashnext.kernels.stager`), the Python side that fills what
they read (``HostStager``), the GPU cache (``GpuTable.set_device_cache``) and the planner
(:mod:`flashnext.serve.cache_plan`), which must not load numba or numpy to import it: this
module imports neither at the top.

- :class:`StepContext`: the words of a staged step's context, an int64 array the one numba
  call of a step reads every argument from but the ids. The filler builds it by keyword
  (``StepContext(lo=..., ...)``: a field it does not name is a TypeError), the kernel reads
  ``ctx[AT.name]`` (:data:`AT`: each field's word). A reordered or renamed field changes
  :data:`LAYOUT_ID`, the context's first word, which the kernel checks: numba's on-disk cache
  of the kernel keys on the kernel's own file only, so a stale compiled kernel is caught there
  and recompiled instead of reading the wrong words.
- :func:`slot_offsets`: where scale_2 and the records start in a staging slot (the same
  function compiled into the kernel and called by Python).
- the device cache's host structures (slot map, hit index, group memo) and
  :func:`rows_that_fit`, the one rule for which profiled rows a device cache holds.
"""

from __future__ import annotations

import zlib
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import numpy as np

#: Bytes per served row of the cache's int32 slot map: on the GPU in front of a pinned table
#: (``GpuTable``), in host RAM in front of a staged one (``StagedTable``).
SLOT_MAP_BYTES = 4
#: Rows per 64-byte line of the staged path's hit index (``dedup.build_hit_index``: 2 words of
#: counts, then 6 words of bits).
HIT_BLOCK = 384
HIT_LINE_BYTES = 64
#: Lines of the staged path's group memo (``dedup.classify_grouped``), 64 bytes each: a fixed
#: 64 MiB per cache, whatever the table's size.
MEMO_LINES = 1 << 20
MEMO_LINE_BYTES = 64


class StepContext(NamedTuple):
    """The words of a staged step's context (int64 each: an address, a size or a setting).

    One step's call then unboxes two arrays instead of 23 arguments: numba's dispatch of
    those took 2.1 us of a 26 us T = 32 step on the development VM (on the H200's host the
    fill went from ~27 to ~24 us). Addresses point into arrays the ``HostStager`` keeps alive.
    """

    layout_id: int  # LAYOUT_ID: the kernel refuses a context of another declaration
    lo: int  # first served row
    hi: int  # end of the served rows
    cached: int  # 1: a device cache is set (slot map, hit index, memo), 0: none
    hash_ids: int  # knob: steps of at most this many ids dedup their misses in ``hash``
    serial_rows: int  # knob: at most this many unique rows gather on the calling thread
    depth: int  # knob: rows prefetched ahead of the gather's copy
    rec_bytes: int  # bytes per record
    hit_index: int  # uint64 [blocks, 8]
    blocks: int
    slot_map: int  # int32 [map_rows]
    map_rows: int
    hash: int  # int32 [hash_size]
    hash_size: int
    keys: int  # int64 [max_ids]
    uniq: int  # int64 [max_ids]
    pos: int  # int64 [max_ids]
    max_ids: int
    words: int  # the staging slot, int32 [slot_words] (and float32, the same bytes)
    slot_words: int
    seg_start: int  # int64 [segments]
    segments: int
    seg_dir: int  # int64 [dir_size]
    dir_size: int
    seg_shift: int
    bases: int  # int64 [fields, segments]
    fields: int
    row_bytes: int  # int64 [fields]
    field_off: int  # int64 [fields]
    shard_starts: int  # int64 [shards]
    shards: int
    scalars: int  # float32 [n_scalars]
    n_scalars: int
    memo: int  # int32 [memo_lines, 2 * GROUP]
    memo_lines: int
    memo_shift: int
    scratch: int  # int64 [scratch_size]
    scratch_size: int


#: Each field's word in the context array: ``ctx[AT.lo]``.
AT = StepContext(*range(len(StepContext._fields)))
#: Words in a step context.
CONTEXT_WORDS = len(StepContext._fields)
#: The declaration's fingerprint (its field names in order), a context's first word.
LAYOUT_ID = zlib.crc32(",".join(StepContext._fields).encode())
#: What the kernel returns for a context of another declaration (a stale compiled kernel).
STALE_LAYOUT = -(1 << 62)


def slot_offsets(n_ids: int, has_scale_2: int) -> tuple[int, int]:
    """Byte offsets of scale_2 and of the records in a staging slot of ``n_ids`` ids.

    A slot is ``[inverse int32 [n_ids] | scale_2 float32 [n_ids] (nvfp4) | records]``, each
    part 16-byte aligned; scale_2 gets room for ``n_ids`` rows, so that the records' place is
    known before the dedup says how many rows there are. Compiled into the kernel as is.
    """
    s2_at = (4 * n_ids + 15) & ~15
    rec_at = (s2_at + (4 * n_ids if has_scale_2 else 0) + 15) & ~15
    return s2_at, rec_at


def rows_that_fit(
    ids: np.ndarray, row_range: tuple[int, int], cache_bytes: int, record_bytes: int
) -> np.ndarray:
    """Which of the priority-ordered row ids ``ids`` (int64 ``[n]``) a device cache of
    ``cache_bytes`` holds: rows outside ``row_range`` skipped, repeats keep their first place,
    ``cache_bytes // record_bytes`` rows kept. Returns their positions in ``ids`` (int64
    ``[k]``, priority order); the GPU cache, the stager and the planner all use this one rule."""
    import numpy as np  # lazily: the planner imports this module without numpy

    lo, hi = row_range
    inside = np.flatnonzero((ids >= lo) & (ids < hi))
    _, first = np.unique(ids[inside], return_index=True)
    keep = max(0, int(cache_bytes)) // max(1, int(record_bytes))
    return inside[np.sort(first)][:keep].astype(np.int64)

"""Per-row records: a table's stored tensors repacked so one row is one contiguous run of bytes.

Pure numpy (no GPU needed). A sidecar stores each per-row tensor separately (int4: nibbles in
``weight_i4``, scales in ``weight_scale``); a GPU gather of one row then touches two places.
A *record* concatenates a row's per-row tensors, in the order of the codec's ``specs``, as raw
bytes (int4 at width 160: 80 nibble bytes + 10 fp16 scales = 100 bytes; fp8: 160 codes + one
fp32 scale = 164 bytes; nvfp4: 80 + 10 = 90; bf16: 320). Measured fastest for random gathers.
Per-shard scalars (nvfp4 ``weight_scale_2``) stay outside the records. Nothing here restates a
format fact: names, dtypes and shapes come from :mod:`flashnext.ple.formats`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from flashnext.errors import FormatError
from flashnext.ple.formats import Codec, TensorSpec


@dataclass(frozen=True)
class RecordField:
    """One per-row tensor inside a record: ``nbytes`` bytes at byte ``offset``."""

    spec: TensorSpec
    offset: int
    nbytes: int


@dataclass(frozen=True)
class RecordLayout:
    """Where each per-row tensor of ``codec`` sits in a ``record_bytes``-byte record."""

    codec: Codec
    width: int
    fields: tuple[RecordField, ...]
    record_bytes: int

    def field(self, name: str) -> RecordField:
        for f in self.fields:
            if f.spec.name == name:
                return f
        raise FormatError(f"{self.codec.name}: records have no field {name!r}")


def record_layout(codec: Codec, width: int) -> RecordLayout:
    """The record layout of ``codec`` at row width ``width`` (fields in ``codec.specs`` order).

    Raises:
        FormatError: the width does not fit the format, or a field would be misaligned for
            its dtype (a multi-byte field must start at a multiple of its item size).
    """
    codec.check_width(width)
    fields = []
    offset = 0
    for spec in codec.specs:
        if not spec.per_row:
            continue
        nbytes = int(np.prod(spec.shape(1, width))) * spec.dtype.itemsize
        if offset % spec.dtype.itemsize:
            raise FormatError(
                f"{codec.name}: record field {spec.name} at byte {offset} is not aligned to "
                f"its {spec.dtype.itemsize}-byte dtype {spec.dtype}"
            )
        fields.append(RecordField(spec, offset, nbytes))
        offset += nbytes
    return RecordLayout(codec, width, tuple(fields), offset)


def pack_records(
    layout: RecordLayout, tensors: Mapping[str, np.ndarray], out: np.ndarray | None = None
) -> np.ndarray:
    """Per-row tensors of ``n`` rows -> uint8 records ``[n, record_bytes]``.

    Args:
        layout: from :func:`record_layout`.
        tensors: each per-row tensor ``[n, ...]`` in its stored dtype (extra keys, such as
            per-shard scalars, are ignored).
        out: optional uint8 ``[>= n, record_bytes]`` to write into (a pinned staging buffer);
            the first ``n`` rows are written and returned.

    Raises:
        FormatError: a tensor is missing or has the wrong dtype or row size.
    """
    first = tensors[layout.fields[0].spec.name]
    n = int(np.shape(first)[0])
    if out is None:
        out = np.empty((n, layout.record_bytes), dtype=np.uint8)
    elif out.dtype != np.uint8 or out.shape[0] < n or out.shape[1] != layout.record_bytes:
        raise FormatError(
            f"{layout.codec.name}: record buffer is {out.dtype} {list(out.shape)}, expected "
            f"uint8 [>= {n}, {layout.record_bytes}]"
        )
    dst = out[:n]
    for f in layout.fields:
        arr = tensors.get(f.spec.name)
        if arr is None:
            raise FormatError(f"{layout.codec.name}: tensor {f.spec.name} is missing")
        arr = np.asarray(arr)
        if arr.dtype != f.spec.dtype or arr.shape[0] != n or arr[:1].nbytes not in (0, f.nbytes):
            raise FormatError(
                f"{layout.codec.name}: tensor {f.spec.name} is {arr.dtype} {list(arr.shape)}, "
                f"expected {f.spec.dtype} [{n}, ...] of {f.nbytes} bytes per row"
            )
        dst[:, f.offset : f.offset + f.nbytes] = (
            np.ascontiguousarray(arr).view(np.uint8).reshape(n, f.nbytes)
        )
    return dst


def unpack_records(layout: RecordLayout, records: np.ndarray) -> dict[str, np.ndarray]:
    """uint8 records ``[n, record_bytes]`` -> the per-row tensors (inverse of :func:`pack_records`)."""
    n = records.shape[0]
    out = {}
    for f in layout.fields:
        raw = np.ascontiguousarray(records[:, f.offset : f.offset + f.nbytes])
        arr = raw.view(f.spec.dtype)
        out[f.spec.name] = arr.reshape(n, *f.spec.shape(1, layout.width)[1:])
    return out

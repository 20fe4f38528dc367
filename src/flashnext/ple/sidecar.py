"""The on-disk PLE sidecar: ``shard_N.safetensors`` files plus ``META.json``.

Spec (format version 1)
-----------------------
A sidecar is a directory holding one PLE layer's table, split by rows:

- ``shard_0.safetensors`` .. ``shard_{K-1}.safetensors``: shard ``k`` holds table rows
  ``[k * S, min((k + 1) * S, num_rows))``; every shard holds ``S`` rows except the last, which
  may hold fewer. Concatenating the shards in index order gives the table.
- Each shard holds exactly the tensors of one format, with the names, dtypes and shapes of
  the table in :mod:`flashnext.ple.formats` (``Codec.specs``; a per-shard scalar has shape
  ``[]``). The format is detected from these names; META.json is not needed to read a sidecar.
- ``META.json`` (written last, atomically; optional for readers)::

      {"format_version": 1, "format": "int4", "width": 160, "rows_per_shard": S,
       "num_rows": R, "num_shards": K,
       "shards": [{"file": "shard_0.safetensors", "rows": S, "sha256": "..."}, ...],
       "geometry": {...PLEGeometry.to_dict()...} | null,
       "source": {...free-form: where the rows came from...},
       "quantization": {"rel_rmse": ...} | null,
       "flashnext_version": "0.1.0"}

  META.json holds no timestamp, so the same input always gives byte-identical files.

  Readers ignore unknown fields and accept the alternative key names other tools use
  (``shard_rows``, ``total_rows``, ``variant``). Where META.json gives ``rows_per_shard``,
  ``num_rows``, ``num_shards`` or ``width``, every shard is checked against it.

Each shard is written to a temporary name and renamed when complete, so a shard file that
exists under its final name is whole; its sha256 is recorded in META.json.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from flashnext import __version__
from flashnext.atomic import write_json
from flashnext.errors import FormatError, SidecarError
from flashnext.ple.formats import FORMATS, Codec, detect_format, get_codec
from flashnext.safetensors_file import (
    Header,
    SafetensorsError,
    TensorEntry,
    dtype_name,
    read_header,
    sha256_file,
    write_file,
)

FORMAT_VERSION = 1
META_NAME = "META.json"
_SHARD_RE = re.compile(r"^shard_(\d+)\.safetensors$")


def shard_name(index: int) -> str:
    """``shard_{index}.safetensors``."""
    return f"shard_{index}.safetensors"


@dataclass(frozen=True)
class Shard:
    """One validated shard: its file, first global row, row count and tensor locations."""

    index: int
    path: Path
    row_start: int
    rows: int
    tensors: dict[str, TensorEntry]
    scalars: dict[str, float]  # per-shard scalars: the format's Codec.scalar_specs


@dataclass
class Sidecar:
    """A validated sidecar directory (see the module docstring for the spec)."""

    path: Path
    codec: Codec
    width: int
    rows_per_shard: int
    num_rows: int
    shards: list[Shard]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def format(self) -> str:
        return self.codec.name

    @property
    def nbytes(self) -> int:
        """Bytes on disk of all shard files."""
        return sum(s.path.stat().st_size for s in self.shards)

    @property
    def geometry(self) -> dict[str, Any] | None:
        geo = self.meta.get("geometry")
        return geo if isinstance(geo, dict) else None

    def expected_checksums(self) -> dict[int, str]:
        """Shard index -> sha256 recorded in META.json (empty when none recorded)."""
        out: dict[int, str] = {}
        for rec in self.meta.get("shards", []) if isinstance(self.meta.get("shards"), list) else []:
            if isinstance(rec, dict) and isinstance(rec.get("sha256"), str):
                m = _SHARD_RE.match(str(rec.get("file", "")))
                if m:
                    out[int(m.group(1))] = rec["sha256"]
        return out

    def verify_checksums(self, progress: Callable[[int], None] | None = None) -> list[str]:
        """Re-hash every shard with a recorded sha256; return one problem line per mismatch."""
        problems = []
        expected = self.expected_checksums()
        for shard in self.shards:
            want = expected.get(shard.index)
            if want is None:
                continue
            got = sha256_file(shard.path, progress=progress)
            if got != want:
                problems.append(
                    f"{shard.path.name}: sha256 {got[:16]}..., expected {want[:16]}... from "
                    f"{META_NAME}; the file changed after it was written: re-create it"
                )
        return problems


def _meta_int(meta: Mapping[str, Any], *keys: str) -> int | None:
    for k in keys:
        v = meta.get(k)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return None


def _load_meta(root: Path) -> dict[str, Any]:
    path = root / META_NAME
    if not path.exists():
        return {}
    try:
        meta = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SidecarError(f"{path}: not valid JSON ({exc}); delete or re-create it") from None
    if not isinstance(meta, dict):
        raise SidecarError(f"{path}: expected a JSON object, found {type(meta).__name__}")
    return meta


def open_sidecar(path: str | os.PathLike[str]) -> Sidecar:
    """Validate a sidecar directory's headers and return its description (no data is read).

    Every shard is checked: the header parses and matches the file size; the tensor names are
    those of one format, the same in every shard; dtypes and shapes match the format; every
    shard but the last holds ``rows_per_shard`` rows; widths agree; shard indices have no gap.

    Raises:
        SidecarError: with the file, the tensor, what was expected and what was found.
    """
    root = Path(path)
    if not root.is_dir():
        raise SidecarError(
            f"{root}: not a directory (expected a PLE sidecar: shard_N.safetensors + META.json)"
        )
    meta = _load_meta(root)
    found: dict[int, Path] = {}
    for entry in root.iterdir():
        m = _SHARD_RE.match(entry.name)
        if m:
            index = int(m.group(1))
            if index in found:
                raise SidecarError(
                    f"{root}: {found[index].name} and {entry.name} both claim shard {index}; "
                    "remove the one that does not belong"
                )
            found[index] = entry
    if not found:
        raise SidecarError(f"{root}: no shard_N.safetensors files")
    num_shards = _meta_int(meta, "num_shards", "shards")
    last = max(found) if num_shards is None else max(num_shards - 1, max(found))
    missing = [i for i in range(last + 1) if i not in found]
    if missing:
        names = ", ".join(shard_name(i) for i in missing[:5])
        raise SidecarError(
            f"{root}: missing {names}{' ...' if len(missing) > 5 else ''} "
            f"({len(missing)} of {last + 1} shards); re-create or re-download them"
        )
    if num_shards is not None and len(found) != num_shards:
        raise SidecarError(
            f"{root}: {len(found)} shard files, but {META_NAME} says num_shards={num_shards}"
        )

    headers: list[Header] = []
    for i in range(last + 1):
        try:
            headers.append(read_header(found[i]))
        except SafetensorsError as exc:
            raise SidecarError(str(exc)) from None

    try:
        codec = detect_format(headers[0].tensors)
    except FormatError as exc:
        raise SidecarError(f"{headers[0].path}: {exc}") from None
    # Other tools name the format "variant" and may prefix it like the card's folders.
    meta_format = meta.get("format", meta.get("variant"))
    named = meta_format.removeprefix("ples_") if isinstance(meta_format, str) else None
    if named in FORMATS and named != codec.name:
        raise SidecarError(
            f"{root}: {META_NAME} says format {meta_format!r} but the shards hold {codec.name} "
            f"tensors {list(codec.tensor_names)}"
        )

    first_rows = _rows_of(headers[0], codec)
    rows_per_shard = _meta_int(meta, "rows_per_shard", "shard_rows") or first_rows
    width = _meta_int(meta, "width") or _width_of(headers[0], codec)
    codec.check_width(width)
    shards = []
    row_start = 0
    for i, header in enumerate(headers):
        rows = _check_shard(header, codec, width, rows_per_shard, is_last=i == last)
        scalars = {}
        for spec in codec.specs:
            if not spec.per_row:
                scalar = header.tensors[spec.name]
                scalars[spec.name] = float(
                    np.fromfile(header.path, scalar.dtype, 1, offset=scalar.offset)[0]
                )
        shards.append(Shard(i, header.path, row_start, rows, header.tensors, scalars))
        row_start += rows
    num_rows = _meta_int(meta, "num_rows", "total_rows")
    if num_rows is not None and num_rows != row_start:
        raise SidecarError(
            f"{root}: shards hold {row_start} rows in all, but {META_NAME} says num_rows={num_rows}"
        )
    return Sidecar(root, codec, width, rows_per_shard, row_start, shards, meta)


def _rows_of(header: Header, codec: Codec) -> int:
    spec = codec.specs[0]
    shape = header.tensors[spec.name].shape
    if len(shape) != 2:
        raise SidecarError(
            f"{header.path}: tensor {spec.name} has shape {list(shape)}, expected 2-D [rows, cols]"
        )
    return shape[0]


def _width_of(header: Header, codec: Codec) -> int:
    return codec.width_of(header.tensors[codec.rows_spec.name].shape)


def _check_shard(
    header: Header, codec: Codec, width: int, rows_per_shard: int, is_last: bool
) -> int:
    names = set(header.tensors)
    if names != set(codec.tensor_names):
        raise SidecarError(
            f"{header.path}: tensors {sorted(names)}, expected {list(codec.tensor_names)} "
            f"({codec.name}, as in {shard_name(0)})"
        )
    rows = _rows_of(header, codec)
    where = "rows per shard from META.json or shard_0" if not is_last else "at most rows per shard"
    if rows != rows_per_shard and not (is_last and 0 < rows <= rows_per_shard):
        raise SidecarError(
            f"{header.path}: tensor {codec.specs[0].name} has {rows} rows, expected "
            f"{rows_per_shard} ({where}). Re-run `flashnext ple quantize` for this shard."
        )
    for spec in codec.specs:
        entry = header.tensors[spec.name]
        if entry.dtype != spec.dtype:
            raise SidecarError(
                f"{header.path}: tensor {spec.name} has dtype {entry.dtype_name}, expected "
                f"{dtype_name(spec.dtype)} ({codec.name} format)"
            )
        expect = spec.shape(rows, width)
        shape = entry.shape
        # Other tools store per-row scalars as [rows, 1] and shard scalars as [1].
        if shape != expect and not (shape == (*expect, 1) or (expect == () and shape == (1,))):
            raise SidecarError(
                f"{header.path}: tensor {spec.name} has shape {list(shape)}, expected "
                f"{list(expect)} ({codec.name}, width {width}, {rows} rows)"
            )
    return rows


class SidecarWriter:
    """Writes a sidecar shard by shard; :meth:`finish` writes META.json last.

    Shards may be written in any order (parallel workers); each lands atomically. A shard
    already on disk whose sha256 matches ``resume`` is kept (see :meth:`completed`).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        fmt: str,
        width: int,
        num_rows: int,
        rows_per_shard: int,
        geometry: Mapping[str, Any] | None = None,
        source: Mapping[str, Any] | None = None,
    ) -> None:
        self.path = Path(path)
        self.codec = get_codec(fmt)
        self.codec.check_width(width)
        if num_rows <= 0 or rows_per_shard <= 0:
            raise SidecarError(
                f"{self.path}: num_rows={num_rows} and rows_per_shard={rows_per_shard} must be positive"
            )
        self.width = width
        self.num_rows = num_rows
        self.rows_per_shard = rows_per_shard
        self.num_shards = -(-num_rows // rows_per_shard)
        self.geometry = dict(geometry) if geometry is not None else None
        self.source = dict(source or {})
        self.records: dict[int, dict[str, Any]] = {}
        self.path.mkdir(parents=True, exist_ok=True)

    def shard_rows(self, index: int) -> tuple[int, int]:
        """Global row range ``[start, end)`` of shard ``index``."""
        start = index * self.rows_per_shard
        return start, min(start + self.rows_per_shard, self.num_rows)

    def write_shard(
        self, index: int, tensors: Mapping[str, np.ndarray], **extra: Any
    ) -> dict[str, Any]:
        """Check ``tensors`` against the format and write shard ``index`` atomically.

        ``extra`` (e.g. ``rel_rmse``) is stored in the shard's META.json record.
        Returns the record ``{"file", "rows", "sha256", **extra}``.
        """
        if not 0 <= index < self.num_shards:
            raise SidecarError(f"{self.path}: shard index {index} outside [0, {self.num_shards})")
        start, end = self.shard_rows(index)
        record = write_shard_file(
            self.path, self.codec, self.width, index, start, end - start, tensors, **extra
        )
        self.records[index] = record
        return record

    def adopt(self, record: Mapping[str, Any]) -> None:
        """Count a shard already on disk (verified by the caller) as written."""
        m = _SHARD_RE.match(str(record.get("file", "")))
        if not m:
            raise SidecarError(f"{self.path}: record {record!r} names no shard file")
        self.records[int(m.group(1))] = dict(record)

    def finish(self, quantization: Mapping[str, Any] | None = None) -> Sidecar:
        """Write META.json once every shard is written, then re-open and return the sidecar."""
        missing = [i for i in range(self.num_shards) if i not in self.records]
        if missing:
            raise SidecarError(f"{self.path}: cannot finish, shards {missing[:8]} not written")
        meta = {
            "format_version": FORMAT_VERSION,
            "format": self.codec.name,
            "width": self.width,
            "rows_per_shard": self.rows_per_shard,
            "num_rows": self.num_rows,
            "num_shards": self.num_shards,
            "shards": [self.records[i] for i in range(self.num_shards)],
            "geometry": self.geometry,
            "source": self.source,
            "quantization": dict(quantization) if quantization else None,
            "flashnext_version": __version__,
        }
        write_json(self.path / META_NAME, meta)
        return open_sidecar(self.path)


def write_shard_file(
    root: Path,
    codec: Codec,
    width: int,
    index: int,
    row_start: int,
    rows: int,
    tensors: Mapping[str, np.ndarray],
    **extra: Any,
) -> dict[str, Any]:
    """Write ``root/shard_{index}.safetensors`` atomically after checking names, dtypes, shapes.

    Returns the shard's META.json record ``{"file", "rows", "sha256", **extra}``.

    Raises:
        FormatError: a tensor is missing or has the wrong dtype or shape.
    """
    ordered = {}
    for spec in codec.specs:
        if spec.name not in tensors:
            raise FormatError(f"{shard_name(index)}: tensor {spec.name} missing for {codec.name}")
        arr = np.asarray(tensors[spec.name])
        want = spec.shape(rows, width)
        if arr.dtype != spec.dtype or arr.shape != want:
            raise FormatError(
                f"{shard_name(index)}: tensor {spec.name} is {arr.dtype} {list(arr.shape)}, "
                f"expected {spec.dtype} {list(want)}"
            )
        ordered[spec.name] = arr
    digest = write_file(
        Path(root) / shard_name(index),
        ordered,
        metadata={"format": codec.name, "row_start": str(row_start), "flashnext": __version__},
    )
    return {"file": shard_name(index), "rows": rows, "sha256": digest, **extra}


def write_sidecar(
    path: str | os.PathLike[str],
    fmt: str,
    rows: np.ndarray,
    rows_per_shard: int,
    geometry: Mapping[str, Any] | None = None,
    source: Mapping[str, Any] | None = None,
) -> Sidecar:
    """Quantize float32 ``rows`` [num_rows, width] to ``fmt`` and write a whole sidecar.

    Convenience for tables that fit in memory (tests, the demo); large tables stream through
    :func:`flashnext.ple.quantize.quantize_sidecar`.
    """
    rows = np.asarray(rows)
    writer = SidecarWriter(
        path, fmt, rows.shape[1], rows.shape[0], rows_per_shard, geometry, source
    )
    for i in range(writer.num_shards):
        start, end = writer.shard_rows(i)
        writer.write_shard(i, writer.codec.quantize(rows[start:end]))
    return writer.finish()

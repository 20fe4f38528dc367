"""Find each PLE layer's n-gram table in a checkpoint, in any layout, and map its rows.

Layouts (``P`` = the layer's tensor prefix, see below; ``k`` = 0..split_ngram_parts-1):

=============  ===============================================  ======================================
layout         row tensors                                      rows held
=============  ===============================================  ======================================
shards         ``P.ngram_embedding.shard_{k}.weight``           ``[k*S, min((k+1)*S, R))``,
                                                                ``S = ceil(R / split_ngram_parts)``
whole          ``P.ngram_embedding.weight``                     all ``R``
empty-shard    ``P.ngram_embedding.shard_.weight``              all ``R`` (vLLM 0.33.0 rejects this
                                                                name; we accept it after the shape
                                                                check)
=============  ===============================================  ======================================

``P`` is ``{prefix}{L}.ple.ple_embedding`` with ``{L}`` the 0-based decoder layer index
(``ple_layer_id - 1``) and ``{prefix}`` one of ``model.language_model.layers.`` (long),
``model.layers.`` (short) or ``language_model.model.layers.`` (VL).

``weight`` is the rows tensor every format spells alike
(:data:`~flashnext.ple.formats.CHECKPOINT_ROWS`). Which other tensors a format adds to each
piece and beside the pieces is its checkpoint spelling in :mod:`flashnext.ple.formats` (the
"Checkpoint spellings" table there); the rows' dtype tells the format
(:func:`~flashnext.ple.formats.checkpoint_format`), and the format's codec dequantizes them.

Optional int64 geometry buffers ``layer_multipliers``, ``ngram_heads_vocab_sizes``,
``ngram_heads_offsets`` under ``P`` (or ``P.ngram_embedding``) win over the geometry computed
from config.json, and are read before any shape is checked.

Every shape is checked against the geometry before any row is read. A tensor whose name
contains ``ngram_embedding`` but fits none of the layouts is an error, never skipped.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from flashnext.checkpoint.config import check_ple_config, read_config
from flashnext.checkpoint.snapshot import resolve_snapshot, tensor_map
from flashnext.errors import CheckpointError, FormatError, GeometryError
from flashnext.ple.formats import (
    CHECKPOINT_PER_ROW_NAMES,
    CHECKPOINT_ROWS,
    CHECKPOINT_SCALAR_NAMES,
    CheckpointSpelling,
    CheckpointTensor,
    Codec,
    checkpoint_format,
    get_codec,
)
from flashnext.ple.geometry import PLEGeometry, ple_layer_ids, text_config
from flashnext.safetensors_file import DTYPES, TensorEntry, dtype_name

#: Tensor-name prefixes before the 0-based layer index, by the name we report them under.
PREFIXES: dict[str, str] = {
    "long": "model.language_model.layers.",
    "short": "model.layers.",
    "vl": "language_model.model.layers.",
}
BUFFER_NAMES = ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets")
LAYOUTS = ("shards", "whole", "empty-shard")

_LAYER_RE = re.compile(
    r"^(?P<prefix>model\.language_model\.layers\.|model\.layers\.|language_model\.model\.layers\.)"
    r"(?P<L>0|[1-9]\d*)\.(?P<rest>.*)$"
)
#: The table's module in every tensor name, and the head before a table tensor's own name.
TABLE_MODULE = "ngram_embedding"
_TABLE_HEAD = f"ple.ple_embedding.{TABLE_MODULE}."
#: Names relative to the PLE layer's ``ngram_embedding.`` (what vLLM's loader is handed).
EMPTY_SHARD = f"{TABLE_MODULE}.shard_.weight"
WHOLE_TABLE = f"{TABLE_MODULE}.weight"
GLOBAL_SCALE = f"{TABLE_MODULE}.weight_scale"
NUMBERED_SHARD = re.compile(rf"^{TABLE_MODULE}\.shard_\d+\.weight$")
#: Any checkpoint prefix before the table: "<...>layers.{L}.ple.ple_embedding." (long, short
#: and VL spellings all end so), or the PLE layer's own "ple_embedding.".
TABLE_NAME_PREFIX = re.compile(
    rf"^(?:(?:[\w.]*\.)?layers\.\d+\.ple\.)?(?:ple_embedding\.)?(?={TABLE_MODULE}\.)"
)
#: Tensor names relative to ``...ngram_embedding.`` that a PLE table layer takes (and, served
#: from a sidecar, drops).
TABLE_TENSOR = re.compile(r"^(shard_\d*\.)?(weight|weight_scale|weight_scale_2|input_scale)$")
#: Tensors of a PLE table (any layout) and its geometry buffers: a sidecar replaces them all.
PLE_TENSOR = re.compile(
    rf"(^|\.)ple\.ple_embedding\.({TABLE_MODULE}\.|layer_multipliers$|ngram_heads_)"
)


def table_prefix(layer_index: int, prefix: str = "short") -> str:
    """``{prefix}{L}.ple.ple_embedding.ngram_embedding``: the table of 0-based decoder layer
    ``layer_index`` (the short spelling is also vLLM's module prefix of the layer)."""
    return f"{PREFIXES[prefix]}{layer_index}.{_TABLE_HEAD[:-1]}"
# Tensor names after the table head, from the formats' checkpoint spellings: per-row tensors
# per piece (shard_{k}. / shard_.), and under the head itself the whole table's per-row
# tensors or the one-per-table scalars.
_TOP_NAMES = tuple(dict.fromkeys((*CHECKPOINT_PER_ROW_NAMES, *CHECKPOINT_SCALAR_NAMES)))
_SHARD_RE = re.compile(
    r"^shard_(?P<k>0|[1-9]\d*)?\.(?P<kind>"
    + "|".join(map(re.escape, CHECKPOINT_PER_ROW_NAMES))
    + ")$"
)
_TOP_RE = re.compile(r"^(?P<kind>" + "|".join(map(re.escape, _TOP_NAMES)) + ")$")
_BUFFER_RE = re.compile(
    r"^ple\.(?:ple_embedding\.)?(?:ngram_embedding\.)?(?P<buf>" + "|".join(BUFFER_NAMES) + r")$"
)


@dataclass(frozen=True)
class TablePart:
    """One stored tensor of per-row data: table rows ``[row_start, row_start + rows)``.

    ``kind`` is the tensor's name in the format's checkpoint spelling: :data:`CHECKPOINT_ROWS`
    for the rows, else a per-row scale. ``cols`` is the number of stored columns (the tensor's
    second dimension); ``offset`` the absolute byte offset of its first element in ``file``.
    """

    name: str
    file: str
    kind: str
    dtype: str  # safetensors dtype name
    offset: int
    cols: int
    row_start: int
    rows: int
    shard: int | None  # k for the shards layout, None otherwise

    @property
    def row_bytes(self) -> int:
        return self.cols * DTYPES[self.dtype].itemsize


@dataclass(frozen=True)
class RowCopy:
    """Copy ``rows`` rows of ``tensor`` (in ``file``) starting at its row ``src_offset`` into
    the destination (a rank's partition) starting at its row ``dst_offset``."""

    tensor: str
    file: str
    src_offset: int
    dst_offset: int
    rows: int


@dataclass
class PLETableInfo:
    """One PLE layer's table as found in a checkpoint (headers only, plus global scalars).

    Attributes:
        layer_id: 1-based decoder layer number (as in ``ple_layer_ids``).
        layer_index: ``{L}`` in tensor names (``layer_id - 1``).
        ordinal: ``d``, the layer's position among the sorted PLE layers.
        prefix: ``long``, ``short`` or ``vl`` (see :data:`PREFIXES`).
        layout: ``shards``, ``whole`` or ``empty-shard``.
        format: one of :data:`~flashnext.ple.formats.CHECKPOINT_FORMATS`.
        geometry: the layer's geometry, checkpoint buffers applied.
        parts: per-row tensors in row order; per piece in the order of the format's
            checkpoint spelling (the rows first, then their per-row scales).
        scalars: the format's one-per-table scalars, checkpoint name -> value (fp8: the
            global scale; nvfp4: the global second-level scale; none for bf16).
        scalar_tensors: tensor name -> file of the global scalars.
        buffers: geometry buffers found in the checkpoint: name -> values.
    """

    layer_id: int
    layer_index: int
    ordinal: int
    prefix: str
    layout: str
    format: str
    geometry: PLEGeometry
    parts: list[TablePart]
    scalars: dict[str, float] = field(default_factory=dict)
    scalar_tensors: dict[str, str] = field(default_factory=dict)
    buffers: dict[str, list[int]] = field(default_factory=dict)

    @property
    def codec(self) -> Codec:
        """The format's codec (its tensors, checkpoint spelling and dequantizer)."""
        return get_codec(self.format)

    @property
    def num_rows(self) -> int:
        return self.geometry.num_rows

    @property
    def width(self) -> int:
        return self.geometry.width

    @property
    def rows_per_shard(self) -> int:
        """``ceil(num_rows / split_ngram_parts)``: the checkpoint's shard size by definition."""
        return self.geometry.shard_rows()

    @property
    def name_prefix(self) -> str:
        """``{prefix}{L}.ple.ple_embedding.ngram_embedding``."""
        return table_prefix(self.layer_index, self.prefix)

    @property
    def weights(self) -> list[TablePart]:
        """The parts holding rows (not their per-row scales)."""
        return [p for p in self.parts if p.kind == CHECKPOINT_ROWS]

    @property
    def nbytes(self) -> int:
        """Bytes of per-row data (global scalars excluded)."""
        return sum(p.rows * p.row_bytes for p in self.parts)

    def row_map(self, start: int, end: int) -> list[RowCopy]:
        """What to copy to assemble table rows ``[start, end)`` in a destination buffer.

        For every per-row source tensor overlapping the range (shards: each overlapping
        shard's rows and per-row scales; whole/empty-shard: the one piece's, checkpoint offset
        ``start``), one :class:`RowCopy` with the first source row, the first destination row
        (relative to ``start``) and the row count. The one-per-table scalars (:attr:`scalars`)
        are not rows; every rank loads them.

        Raises:
            CheckpointError: the range is empty or outside ``[0, num_rows]``.
        """
        if not 0 <= start < end <= self.num_rows:
            raise CheckpointError(
                f"row range [{start}, {end}) is not inside layer {self.layer_id}'s table "
                f"of {self.num_rows} rows"
            )
        out = []
        for part in self.parts:
            lo = max(start, part.row_start)
            hi = min(end, part.row_start + part.rows)
            if lo < hi:
                out.append(RowCopy(part.name, part.file, lo - part.row_start, lo - start, hi - lo))
        return out

    def tp_row_map(self, tp_size: int, rank: int) -> list[RowCopy]:
        """:meth:`row_map` of the rows tensor-parallel ``rank`` owns: ``[r*P, (r+1)*P)``,
        ``P = num_rows / tp_size``.

        Raises:
            CheckpointError: ``rank`` is outside the group or the rows do not split evenly.
        """
        try:
            start, end = self.geometry.tp_rows(tp_size, rank)
        except GeometryError as exc:
            raise CheckpointError(f"layer {self.layer_id}: {exc}") from None
        return self.row_map(start, end)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary (no per-row data)."""
        weights = self.weights
        return {
            "layer_id": self.layer_id,
            "layer_index": self.layer_index,
            "ordinal": self.ordinal,
            "prefix": self.prefix,
            "tensor_prefix": self.name_prefix,
            "layout": self.layout,
            "format": self.format,
            "num_rows": self.num_rows,
            "width": self.width,
            "rows_per_shard": self.rows_per_shard,
            "num_tensors": len(weights),
            "files": sorted({p.file for p in self.parts}),
            "nbytes": self.nbytes,
            **{name: self.scalars.get(name) for name in CHECKPOINT_SCALAR_NAMES},
            "buffers": sorted(self.buffers),
            "first_tensor": weights[0].name if weights else None,
        }


def _shape_text(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _bad_shape(
    path: Path, name: str, found: tuple[int, ...], expected: tuple[int, ...], why: str
) -> CheckpointError:
    return CheckpointError(
        f"{path}: tensor {name} has shape {_shape_text(found)}, expected "
        f"{_shape_text(expected)} ({why}). The checkpoint does not match its config.json: "
        "re-download the file, or fix the PLE fields in config.json if they were edited"
    )


def _read_scalar(path: Path, entry: TensorEntry, spec: CheckpointTensor, what: str) -> float:
    if entry.dtype != spec.dtype or entry.shape not in ((), (1,)):
        raise CheckpointError(
            f"{path}: tensor {entry.name} is {entry.dtype_name} {_shape_text(entry.shape)}, "
            f"expected {dtype_name(spec.dtype)} [] or [1] ({what})"
        )
    value = float(np.fromfile(path, spec.dtype, 1, offset=entry.offset)[0])
    if not (np.isfinite(value) and value > 0):
        raise CheckpointError(
            f"{path}: tensor {entry.name} ({what}) is {value}; a scale must be finite and positive"
        )
    return value


@dataclass
class _LayerNames:
    prefix: str
    layer_index: int
    shards: dict[int, dict[str, str]] = field(default_factory=dict)  # k -> kind -> name
    empty: dict[str, str] = field(default_factory=dict)  # kind -> name
    whole: dict[str, str] = field(default_factory=dict)  # kind -> name (incl. globals)
    buffers: dict[str, str] = field(default_factory=dict)

    @property
    def base(self) -> str:
        """``{prefix}{L}.ple.ple_embedding.ngram_embedding.``: the table tensors' head."""
        return f"{PREFIXES[self.prefix]}{self.layer_index}.{_TABLE_HEAD}"


_KNOWN_TAILS = (
    "{"
    + " | ".join(
        [f"shard_<k>.{n}" for n in CHECKPOINT_PER_ROW_NAMES]
        + [f"shard_.{n}" for n in CHECKPOINT_PER_ROW_NAMES]
        + list(_TOP_NAMES)
    )
    + "}"
)


def _classify(names: Mapping[str, tuple[Path, TensorEntry]]) -> dict[int, _LayerNames]:
    """Group PLE table tensor names by 0-based layer index; raise on anything unrecognised."""
    layers: dict[int, _LayerNames] = {}
    for name in sorted(names):
        is_table = TABLE_MODULE in name
        m = _LAYER_RE.match(name)
        if m is None:
            if is_table:
                raise CheckpointError(
                    f"{names[name][0]}: tensor {name} looks like a PLE table tensor but has no "
                    f"known layer prefix (expected one of {list(PREFIXES.values())} followed "
                    "by the 0-based layer index)"
                )
            continue
        rest = m.group("rest")
        buf = _BUFFER_RE.match(rest)
        if not is_table and not buf:
            continue
        L = int(m.group("L"))
        prefix = next(k for k, v in PREFIXES.items() if v == m.group("prefix"))
        layer = layers.setdefault(L, _LayerNames(prefix, L))
        if layer.prefix != prefix:
            raise CheckpointError(
                f"{names[name][0]}: tensor {name} uses the {prefix} prefix "
                f"{PREFIXES[prefix]!r}, but layer {L}'s other PLE tensors use "
                f"{PREFIXES[layer.prefix]!r}: two copies of one table? Keep one"
            )
        if buf:
            layer.buffers[buf.group("buf")] = name
            continue
        tail = rest[len(_TABLE_HEAD) :] if rest.startswith(_TABLE_HEAD) else None
        sm = _SHARD_RE.match(tail) if tail is not None else None
        gm = _TOP_RE.match(tail) if tail is not None else None
        if sm:
            if sm.group("k") is None:
                layer.empty[sm.group("kind")] = name
            else:
                layer.shards.setdefault(int(sm.group("k")), {})[sm.group("kind")] = name
        elif gm:
            layer.whole[gm.group("kind")] = name
        else:
            raise CheckpointError(
                f"{names[name][0]}: tensor {name} looks like a PLE table tensor but fits no "
                f"known layout (expected {layer.base}{_KNOWN_TAILS} with <k> a plain decimal "
                "index). Rename or remove it; it is never skipped silently"
            )
    return layers


def _read_buffers(
    ln: _LayerNames, names: Mapping[str, tuple[Path, TensorEntry]]
) -> dict[str, list[int]]:
    out = {}
    for buf, name in ln.buffers.items():
        path, entry = names[name]
        if entry.dtype_name not in ("I64", "I32", "U64"):
            raise CheckpointError(
                f"{path}: tensor {name} is {entry.dtype_name}, expected I64 (geometry buffer)"
            )
        arr = np.fromfile(
            path, entry.dtype, int(np.prod(entry.shape, dtype=np.int64)), offset=entry.offset
        )
        out[buf] = [int(v) for v in arr.reshape(-1)]
    return out


@dataclass(frozen=True)
class _Piece:
    """One piece of a layout: its per-row tensors (checkpoint name -> tensor) and rows."""

    shard: int | None  # k for the shards layout, None otherwise
    tensors: Mapping[str, str]
    row_start: int
    rows: int


def _describe_table(
    ln: _LayerNames,
    names: Mapping[str, tuple[Path, TensorEntry]],
    config: Mapping[str, Any],
    layer_id: int,
    ordinal: int,
) -> PLETableInfo:
    """One layer's table, checked in order: geometry, layout, completeness, format, shapes,
    global scalars. Raises CheckpointError naming the tensor at the first problem."""
    geo, buffers = _layer_geometry(ln, names, config, layer_id)
    layout = _pick_layout(ln, layer_id)
    pieces = _pieces(ln, layout, geo, config, names, layer_id)
    codec, spelling = _table_format(pieces[0], names)
    _refuse_strays(ln, layout, codec, spelling, names)
    parts = [p for piece in pieces for p in _piece_parts(piece, codec, spelling, geo, names)]
    scalars, scalar_tensors = _table_scalars(ln, codec, spelling, parts[0], names)
    return PLETableInfo(
        layer_id=layer_id,
        layer_index=ln.layer_index,
        ordinal=ordinal,
        prefix=ln.prefix,
        layout=layout,
        format=codec.name,
        geometry=geo,
        parts=parts,
        scalars=scalars,
        scalar_tensors=scalar_tensors,
        buffers=buffers,
    )


def _layer_geometry(
    ln: _LayerNames,
    names: Mapping[str, tuple[Path, TensorEntry]],
    config: Mapping[str, Any],
    layer_id: int,
) -> tuple[PLEGeometry, dict[str, list[int]]]:
    """The layer's geometry from config.json, with the checkpoint's buffers applied."""
    geo = PLEGeometry.from_config(config, layer_id=layer_id)
    buffers = _read_buffers(ln, names)
    if buffers:
        try:
            geo = geo.with_buffers(**buffers)
        except GeometryError as exc:
            first_buf = next(iter(ln.buffers.values()))
            raise CheckpointError(
                f"{names[first_buf][0]}: layer {layer_id}'s geometry buffers "
                f"({', '.join(sorted(ln.buffers.values()))}) are invalid: {exc}"
            ) from None
    return geo, buffers


def _pick_layout(ln: _LayerNames, layer_id: int) -> str:
    """The one layout the layer's rows are stored in (see the module table)."""
    layouts = [
        lay
        for lay, present in (
            ("shards", bool(ln.shards)),
            ("whole", CHECKPOINT_ROWS in ln.whole),
            ("empty-shard", bool(ln.empty)),
        )
        if present
    ]
    base = ln.base
    if not layouts:
        found = sorted([*ln.whole.values(), *ln.empty.values()])
        raise CheckpointError(
            f"layer {layer_id} (tensor prefix {base}): no table rows found "
            f"({'only ' + ', '.join(found) if found else 'no table tensors'}); expected "
            f"{base}shard_<k>.{CHECKPOINT_ROWS}, {base}{CHECKPOINT_ROWS} or "
            f"{base}shard_.{CHECKPOINT_ROWS}"
        )
    if len(layouts) > 1:
        raise CheckpointError(
            f"layer {layer_id}: the table is stored in {len(layouts)} layouts at once "
            f"({', '.join(layouts)}; under {base}); keep exactly one"
        )
    return layouts[0]


def _pieces(
    ln: _LayerNames,
    layout: str,
    geo: PLEGeometry,
    config: Mapping[str, Any],
    names: Mapping[str, tuple[Path, TensorEntry]],
    layer_id: int,
) -> list[_Piece]:
    """The layout's pieces in row order; for shards, after checking that none is missing."""
    R = geo.num_rows
    if layout == "whole":
        return [_Piece(None, ln.whole, 0, R)]
    if layout == "empty-shard":
        return [_Piece(None, ln.empty, 0, R)]
    _check_shard_set(ln, geo, config, names, layer_id)
    S = geo.shard_rows()
    return [
        _Piece(k, ln.shards[k], k * S, max(0, min((k + 1) * S, R) - k * S))
        for k in sorted(ln.shards)
    ]


def _check_shard_set(
    ln: _LayerNames,
    geo: PLEGeometry,
    config: Mapping[str, Any],
    names: Mapping[str, tuple[Path, TensorEntry]],
    layer_id: int,
) -> None:
    """Shards 0..split_ngram_parts-1 that hold rows are all there, and no others."""
    parts_n, S, R = geo.split_ngram_parts, geo.shard_rows(), geo.num_rows
    extra = sorted(k for k in ln.shards if k >= parts_n)
    if extra:
        name = next(iter(ln.shards[extra[0]].values()))
        raise CheckpointError(
            f"{names[name][0]}: tensor {name}: shard index {extra[0]} is beyond "
            f"split_ngram_parts={parts_n} in config.json (shards 0..{parts_n - 1} expected)"
        )
    missing = [
        k
        for k in range(parts_n)
        if CHECKPOINT_ROWS not in ln.shards.get(k, {}) and min((k + 1) * S, R) - k * S > 0
    ]
    if not missing:
        return
    if "split_ngram_parts" not in text_config(config):
        # The count came from the default, not the checkpoint's config: say so.
        raise CheckpointError(
            f"layer {layer_id}: config.json has no split_ngram_parts, so the released "
            f"checkpoints' {parts_n} shards were assumed, but {len(ln.shards)} shard "
            f'tensors are stored under {ln.base}; add "split_ngram_parts": '
            f"{len(ln.shards)} to config.json if that is the table's shard count"
        )
    raise CheckpointError(
        f"layer {layer_id}: missing {len(missing)} of {parts_n} table shards, e.g. "
        f"{ln.base}shard_{missing[0]}.{CHECKPOINT_ROWS}; the checkpoint is incomplete: run "
        "`flashnext checkpoint verify` and re-download"
    )


def _table_format(
    piece: _Piece, names: Mapping[str, tuple[Path, TensorEntry]]
) -> tuple[Codec, CheckpointSpelling]:
    """The format, from the dtype of the first piece's rows tensor."""
    path, entry = names[piece.tensors[CHECKPOINT_ROWS]]
    try:
        codec = checkpoint_format(entry.dtype)
    except FormatError as exc:
        raise CheckpointError(f"{path}: tensor {entry.name}: {exc}") from None
    if codec.checkpoint is None:  # checkpoint_format only returns spelled formats
        raise CheckpointError(f"{codec.name} has no checkpoint spelling")
    return codec, codec.checkpoint


def _refuse_strays(
    ln: _LayerNames,
    layout: str,
    codec: Codec,
    spelling: CheckpointSpelling,
    names: Mapping[str, tuple[Path, TensorEntry]],
) -> None:
    """Every table tensor of the layer belongs to the format's spelling in this layout."""
    per_row = {t.name for t in spelling.per_row}
    top = {t.name for t in spelling.table_scalars} | (per_row if layout == "whole" else set())
    places = [(ln.whole, top), (ln.empty, per_row), *((d, per_row) for d in ln.shards.values())]
    for found, allowed in places:
        for kind, name in found.items():
            if kind not in allowed:
                raise CheckpointError(
                    f"{names[name][0]}: tensor {name} is not part of a {codec.name} table "
                    f"stored as {layout} (a {codec.name} table is {spelling.describe()}, "
                    f"as its rows' dtype says); this layout is not known: remove the tensor "
                    "or fix the table"
                )


def _piece_parts(
    piece: _Piece,
    codec: Codec,
    spelling: CheckpointSpelling,
    geo: PLEGeometry,
    names: Mapping[str, tuple[Path, TensorEntry]],
) -> list[TablePart]:
    """The piece's per-row tensors, dtype and shape checked against the spelling."""
    # The rows tensor, or (a shard past the last row holding only a scale) any other.
    anchor = piece.tensors.get(CHECKPOINT_ROWS) or next(iter(piece.tensors.values()))
    out = []
    for t in spelling.per_row:
        name = piece.tensors.get(t.name)
        expected = t.shape(piece.rows, geo.width)
        if name is None:
            raise CheckpointError(
                f"{names[anchor][0]}: {codec.name} tensor {anchor} has no "
                f"{anchor.rsplit('.', 1)[0]}.{t.name} beside it "
                f"({dtype_name(t.dtype)} {_shape_text(expected)})"
            )
        path, entry = names[name]
        if entry.dtype != t.dtype:
            raise CheckpointError(
                f"{path}: tensor {name} has dtype {entry.dtype_name}, expected "
                f"{dtype_name(t.dtype)}: the rows' dtype makes this a {codec.name} table "
                f"({spelling.describe()}), and every table tensor of a layer shares one format"
            )
        if entry.shape != expected:
            raise _bad_shape(path, name, entry.shape, expected, _where(piece, geo, t))
        cols = t.cols(geo.width)
        out.append(
            TablePart(
                name=name,
                file=str(path),
                kind=t.name,
                dtype=entry.dtype_name,
                offset=entry.offset,
                cols=1 if cols is None else cols,
                row_start=piece.row_start,
                rows=piece.rows,
                shard=piece.shard,
            )
        )
    return out


def _where(piece: _Piece, geo: PLEGeometry, spec: CheckpointTensor) -> str:
    """Where a piece's expected shape comes from, for shape errors."""
    n = geo.split_ngram_parts
    rows = (
        f"shard {piece.shard} of {n}: rows per shard = ceil({geo.num_rows} / "
        f"split_ngram_parts={n}) = {geo.shard_rows()}"
        if piece.shard is not None
        else f"the whole table: {geo.num_rows} rows"
    )
    cols = f", width = ple_embed_dim / heads = {geo.width}"
    if spec.span is not None and spec.span > 1:
        cols += f", {spec.span} columns per stored value"
    return rows + cols


def _table_scalars(
    ln: _LayerNames,
    codec: Codec,
    spelling: CheckpointSpelling,
    first: TablePart,
    names: Mapping[str, tuple[Path, TensorEntry]],
) -> tuple[dict[str, float], dict[str, str]]:
    """The spelling's one-per-table scalars: name -> value, and tensor -> file."""
    values: dict[str, float] = {}
    files: dict[str, str] = {}
    for t in spelling.table_scalars:
        name = ln.whole.get(t.name)
        if name is None:
            raise CheckpointError(
                f"{first.file}: {codec.name} table {first.name} has no global scale "
                f"{ln.base}{t.name} ({dtype_name(t.dtype)} []); without it the rows cannot "
                "be dequantized"
            )
        path, entry = names[name]
        values[t.name] = _read_scalar(path, entry, t, f"{codec.name} global {t.name}")
        files[name] = str(path)
    return values, files


def find_ple_tables(
    path: str | os.PathLike[str], config: Mapping[str, Any] | None = None
) -> list[PLETableInfo]:
    """Find, classify and shape-check every PLE layer's table in a checkpoint directory.

    Reads config.json (unless ``config`` is given) and the safetensors headers; reads no row
    data (only the small geometry buffers and global scales).

    Returns:
        One :class:`PLETableInfo` per layer in ``ple_layer_ids``, in layer order.

    Raises:
        CheckpointError: a PLE layer has no table; a table tensor fits no layout, has the wrong
            shape or dtype (the message names the tensor, its file, the shape found and the
            shape expected); a table sits at a layer that ``ple_layer_ids`` does not list; a
            weight file is missing or truncated.
    """
    root, _layout = resolve_snapshot(path)
    if config is None:
        config = read_config(root)
    check_ple_config(config, root / "config.json")
    ids = ple_layer_ids(config)
    if not ids:
        raise CheckpointError(
            f"{root / 'config.json'}: no ple_layer_ids; this model has no PLE tables"
        )
    names = tensor_map(root)
    layers = _classify(names)
    for L, ln in sorted(layers.items()):
        if L + 1 not in ids:
            any_name = next(
                iter(
                    [*ln.whole.values(), *ln.empty.values(), *ln.buffers.values()]
                    or [next(iter(ln.shards[min(ln.shards)].values()))]
                )
            )
            raise CheckpointError(
                f"{names[any_name][0]}: tensor {any_name} holds a PLE table for layer index {L} "
                f"(decoder layer {L + 1}), but config.json's ple_layer_ids {ids} does not list "
                f"{L + 1}; the checkpoint and config.json disagree"
            )
    out = []
    for d, layer_id in enumerate(ids):
        found = layers.get(layer_id - 1)
        if found is None:
            raise CheckpointError(
                f"{root}: no PLE table for decoder layer {layer_id} (ple_layer_ids {ids}); "
                f"expected tensors like {PREFIXES['long']}{layer_id - 1}.{_TABLE_HEAD}shard_0.{CHECKPOINT_ROWS}"
            )
        out.append(_describe_table(found, names, config, layer_id, d))
    return out


class CheckpointTableSource:
    """Float32 rows of one checkpoint PLE table, any layout and format (a ``RowSource``).

    Picklable (it travels to quantizer worker processes): it holds file names and offsets,
    and reads each requested block with one positioned read per overlapping tensor, so memory
    is bounded by the block, never the table.
    """

    def __init__(self, info: PLETableInfo, root: str | os.PathLike[str]):
        self.info = info
        self.root = str(Path(root).resolve())
        self._base = str(Path(root))  # the parts' file names start with it
        self.num_rows = info.num_rows
        self.width = info.width
        self.format = info.format
        self.geometry = info.geometry.to_dict()
        self.rows_per_shard = info.rows_per_shard

    def read_rows(self, start: int, end: int) -> np.ndarray:
        """float32 [end - start, width] of table rows ``[start, end)``, dequantized.

        Raises:
            CheckpointError: the range is outside the table, or a file is shorter than its
                header says (changed since it was opened).
        """
        out = np.empty((end - start, self.width), dtype=np.float32)
        # Each piece's rows and per-row scales land at the same destination row.
        blocks: dict[int, dict[str, np.ndarray]] = {}
        for copy in self.info.row_map(start, end):
            part = self._parts[copy.tensor]
            arr = self._read(part, copy.src_offset, copy.rows)
            blocks.setdefault(copy.dst_offset, {})[part.kind] = arr
        codec = self.info.codec
        for dst, per_row in blocks.items():
            n = per_row[CHECKPOINT_ROWS].shape[0]
            tensors = codec.from_checkpoint(per_row, self.info.scalars)
            codec.dequantize_into(tensors, out[dst : dst + n])
        return out

    @property
    def _parts(self) -> dict[str, TablePart]:
        return {p.name: p for p in self.info.parts}

    @staticmethod
    def _read(part: TablePart, row: int, rows: int) -> np.ndarray:
        count = rows * part.cols
        arr = np.fromfile(
            part.file, DTYPES[part.dtype], count, offset=part.offset + row * part.row_bytes
        )
        if arr.size != count:
            raise CheckpointError(
                f"{part.file}: tensor {part.name}: read {arr.size} of {count} values at row "
                f"{row}; the file is shorter than its header says (truncated after opening?)"
            )
        return arr.reshape(rows, part.cols)

    def describe(self) -> dict[str, Any]:
        """Where the rows come from (recorded in the sidecar's META.json ``source``).

        Includes each table file's size and mtime, so a resumed quantization notices a file
        that was replaced (re-downloaded) since the interrupted run and starts over.
        """
        files = {}
        for name in sorted({p.file for p in self.info.parts}):
            st = os.stat(name)
            files[os.path.relpath(name, self._base)] = [st.st_size, st.st_mtime_ns]
        return {
            "kind": "checkpoint",
            "path": self.root,
            "layer_id": self.info.layer_id,
            "tensor_prefix": self.info.name_prefix,
            "layout": self.info.layout,
            "format": self.info.format,
            "files": files,
        }


def open_table_source(
    path: str | os.PathLike[str], layer_ordinal: int | None = None
) -> CheckpointTableSource:
    """A :class:`CheckpointTableSource` for one PLE layer of the checkpoint at ``path``.

    ``layer_ordinal`` is the layer's position among ``sorted(set(ple_layer_ids))`` (0-based);
    it may be omitted when the model has one PLE layer.

    Raises:
        CheckpointError: as :func:`find_ple_tables`, or the ordinal is out of range / missing.
    """
    root, _layout = resolve_snapshot(path)
    tables = find_ple_tables(root)
    if layer_ordinal is None:
        if len(tables) != 1:
            raise CheckpointError(
                f"{root}: {len(tables)} PLE layers (decoder layers "
                f"{[t.layer_id for t in tables]}); choose one with --layer 0..{len(tables) - 1}"
            )
        layer_ordinal = 0
    if not 0 <= layer_ordinal < len(tables):
        raise CheckpointError(
            f"{root}: --layer {layer_ordinal} is out of range: {len(tables)} PLE layers "
            f"(decoder layers {[t.layer_id for t in tables]}), ordinals 0..{len(tables) - 1}"
        )
    return CheckpointTableSource(tables[layer_ordinal], root)

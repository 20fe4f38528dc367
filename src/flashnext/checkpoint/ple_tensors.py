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

Stored formats, detected from the row tensor's dtype (``w`` = width = ple_embed_dim / heads):

- bf16: row tensors BF16 ``[rows, w]``.
- fp8: row tensors F8_E4M3 ``[rows, w]`` plus ONE global F32 ``P.ngram_embedding.weight_scale``
  (shape ``[]`` or ``[1]``): ``row = fp8 * weight_scale``.
- nvfp4: row tensors U8 ``[rows, w/2]`` (two E2M1 codes per byte, low nibble = even column),
  next to each a F8_E4M3 ``...weight_scale`` ``[rows, w/16]``, plus a global F32
  ``P.ngram_embedding.weight_scale_2``: ``row[c] = E2M1[code] * weight_scale[row, c//16] *
  weight_scale_2`` (the same math as the sidecar nvfp4 codec with one scale_2 for the table).

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
from flashnext.errors import CheckpointError, GeometryError
from flashnext.ple.formats import GROUP, get_codec
from flashnext.ple.geometry import PLEGeometry, ple_layer_ids, text_config
from flashnext.safetensors_file import DTYPES, TensorEntry

#: Tensor-name prefixes before the 0-based layer index, by the name we report them under.
PREFIXES: dict[str, str] = {
    "long": "model.language_model.layers.",
    "short": "model.layers.",
    "vl": "language_model.model.layers.",
}
BUFFER_NAMES = ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets")
LAYOUTS = ("shards", "whole", "empty-shard")
FORMATS = ("bf16", "fp8", "nvfp4")

_LAYER_RE = re.compile(
    r"^(?P<prefix>model\.language_model\.layers\.|model\.layers\.|language_model\.model\.layers\.)"
    r"(?P<L>0|[1-9]\d*)\.(?P<rest>.*)$"
)
_TABLE_HEAD = "ple.ple_embedding.ngram_embedding."
_SHARD_RE = re.compile(r"^shard_(?P<k>0|[1-9]\d*)?\.(?P<kind>weight|weight_scale)$")
_GLOBAL_RE = re.compile(r"^(?P<kind>weight|weight_scale|weight_scale_2)$")
_BUFFER_RE = re.compile(
    r"^ple\.(?:ple_embedding\.)?(?:ngram_embedding\.)?(?P<buf>" + "|".join(BUFFER_NAMES) + r")$"
)


@dataclass(frozen=True)
class TablePart:
    """One stored tensor of per-row data: table rows ``[row_start, row_start + rows)``.

    ``kind`` is ``weight`` (the rows) or ``weight_scale`` (nvfp4 per-row block scales).
    ``cols`` is the tensor's second dimension; ``offset`` the absolute byte offset of its
    first element in ``file``.
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
        format: ``bf16``, ``fp8`` or ``nvfp4``.
        geometry: the layer's geometry, checkpoint buffers applied.
        parts: per-row tensors in row order (nvfp4: each ``weight`` then its ``weight_scale``).
        weight_scale: fp8 global scale (float) or None.
        weight_scale_2: nvfp4 global scale (float) or None.
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
    weight_scale: float | None = None
    weight_scale_2: float | None = None
    scalar_tensors: dict[str, str] = field(default_factory=dict)
    buffers: dict[str, list[int]] = field(default_factory=dict)

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
        return f"{PREFIXES[self.prefix]}{self.layer_index}.ple.ple_embedding.ngram_embedding"

    @property
    def weights(self) -> list[TablePart]:
        return [p for p in self.parts if p.kind == "weight"]

    @property
    def nbytes(self) -> int:
        """Bytes of per-row data (global scalars excluded)."""
        return sum(p.rows * p.row_bytes for p in self.parts)

    def row_map(self, start: int, end: int) -> list[RowCopy]:
        """What to copy to assemble table rows ``[start, end)`` in a destination buffer.

        For every per-row source tensor overlapping the range (shards: each overlapping
        shard's ``weight`` and, for nvfp4, ``weight_scale``; whole/empty-shard: the one
        tensor, checkpoint offset ``start``), one :class:`RowCopy` with the first source row,
        the first destination row (relative to ``start``) and the row count. Global scalars
        (fp8 ``weight_scale``, nvfp4 ``weight_scale_2``) are not rows; every rank loads them.

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
            "weight_scale": self.weight_scale,
            "weight_scale_2": self.weight_scale_2,
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


def _read_scalar(path: Path, entry: TensorEntry, what: str) -> float:
    if entry.dtype_name != "F32" or entry.shape not in ((), (1,)):
        raise CheckpointError(
            f"{path}: tensor {entry.name} is {entry.dtype_name} {_shape_text(entry.shape)}, "
            f"expected F32 [] or [1] ({what})"
        )
    value = float(np.fromfile(path, np.float32, 1, offset=entry.offset)[0])
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


def _classify(names: Mapping[str, tuple[Path, TensorEntry]]) -> dict[int, _LayerNames]:
    """Group PLE table tensor names by 0-based layer index; raise on anything unrecognised."""
    layers: dict[int, _LayerNames] = {}
    for name in sorted(names):
        is_table = "ngram_embedding" in name
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
        gm = _GLOBAL_RE.match(tail) if tail is not None else None
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
                f"known layout (expected {PREFIXES[prefix]}{L}.{_TABLE_HEAD}"
                "{shard_<k>.weight | shard_<k>.weight_scale | shard_.weight | weight | "
                "weight_scale | weight_scale_2} with <k> a plain decimal index). "
                "Rename or remove it; it is never skipped silently"
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


def _describe_table(
    ln: _LayerNames,
    names: Mapping[str, tuple[Path, TensorEntry]],
    config: Mapping[str, Any],
    layer_id: int,
    ordinal: int,
) -> PLETableInfo:
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
    layouts = [
        lay
        for lay, present in (
            ("shards", bool(ln.shards)),
            ("whole", "weight" in ln.whole),
            ("empty-shard", bool(ln.empty)),
        )
        if present
    ]
    base = f"{PREFIXES[ln.prefix]}{ln.layer_index}.{_TABLE_HEAD}"
    if not layouts:
        found = sorted([*ln.whole.values(), *ln.empty.values()])
        raise CheckpointError(
            f"layer {layer_id} (tensor prefix {base}): no table rows found "
            f"({'only ' + ', '.join(found) if found else 'no table tensors'}); expected "
            f"{base}shard_<k>.weight, {base}weight or {base}shard_.weight"
        )
    if len(layouts) > 1:
        raise CheckpointError(
            f"layer {layer_id}: the table is stored in {len(layouts)} layouts at once "
            f"({', '.join(layouts)}; under {base}); keep exactly one"
        )
    layout = layouts[0]
    R, W = geo.num_rows, geo.width

    # (shard, weight name, scale name or None, row_start, rows)
    pieces: list[tuple[int | None, str, str | None, int, int]] = []
    if layout == "shards":
        parts_n = geo.split_ngram_parts
        S = geo.shard_rows()
        extra = sorted(k for k in ln.shards if k >= parts_n)
        if extra:
            name = next(iter(ln.shards[extra[0]].values()))
            raise CheckpointError(
                f"{names[name][0]}: tensor {name}: shard index {extra[0]} is beyond "
                f"split_ngram_parts={parts_n} in config.json (shards 0..{parts_n - 1} expected)"
            )
        missing = [k for k in range(parts_n) if "weight" not in ln.shards.get(k, {})]
        missing = [k for k in missing if min((k + 1) * S, R) - k * S > 0]
        if missing:
            if "split_ngram_parts" not in text_config(config):
                # The count came from the default, not the checkpoint's config: say so.
                raise CheckpointError(
                    f"layer {layer_id}: config.json has no split_ngram_parts, so the released "
                    f"checkpoints' {parts_n} shards were assumed, but {len(ln.shards)} shard "
                    f'tensors are stored under {base}; add "split_ngram_parts": '
                    f"{len(ln.shards)} to config.json if that is the table's shard count"
                )
            raise CheckpointError(
                f"layer {layer_id}: missing {len(missing)} of {parts_n} table shards, e.g. "
                f"{base}shard_{missing[0]}.weight; the checkpoint is incomplete: run "
                "`flashnext checkpoint verify` and re-download"
            )
        for k in sorted(ln.shards):
            lo, hi = k * S, min((k + 1) * S, R)
            pieces.append(
                (k, ln.shards[k]["weight"], ln.shards[k].get("weight_scale"), lo, hi - lo)
            )
    elif layout == "whole":
        per_row_scale = None
        ws = ln.whole.get("weight_scale")
        if ws is not None and len(names[ws][1].shape) == 2:
            per_row_scale = ws  # nvfp4: [rows, w/16]; fp8's global scale is a scalar
        pieces.append((None, ln.whole["weight"], per_row_scale, 0, R))
    else:
        pieces.append((None, ln.empty["weight"], ln.empty.get("weight_scale"), 0, R))

    first_path, first = names[pieces[0][1]]
    fmt = {"BF16": "bf16", "F8_E4M3": "fp8", "U8": "nvfp4"}.get(first.dtype_name)
    if fmt is None:
        raise CheckpointError(
            f"{first_path}: tensor {first.name} has dtype {first.dtype_name}; a PLE table is "
            "BF16 (bf16), F8_E4M3 (fp8 + global weight_scale) or U8 (nvfp4 + weight_scale + "
            "weight_scale_2)"
        )
    cols = W // 2 if fmt == "nvfp4" else W
    if fmt == "nvfp4" and W % GROUP:
        raise CheckpointError(
            f"layer {layer_id}: width {W} is not a multiple of {GROUP}, so it cannot be nvfp4"
        )
    parts: list[TablePart] = []
    for shard, wname, sname, row_start, rows in pieces:
        path, entry = names[wname]
        where = (
            (
                f"shard {shard} of {geo.split_ngram_parts}: rows per shard = ceil({R} / "
                f"split_ngram_parts={geo.split_ngram_parts}) = {geo.shard_rows()}"
                if shard is not None
                else f"the whole table: {R} rows"
            )
            + f", width = ple_embed_dim / heads = {W}"
            + (" / 2 bytes per row (nvfp4)" if fmt == "nvfp4" else "")
        )
        if entry.dtype_name != first.dtype_name:
            raise CheckpointError(
                f"{path}: tensor {wname} has dtype {entry.dtype_name}, but {first.name} has "
                f"{first.dtype_name}; every table tensor of a layer must share one format"
            )
        if entry.shape != (rows, cols):
            raise _bad_shape(path, wname, entry.shape, (rows, cols), where)
        parts.append(
            TablePart(
                wname,
                str(path),
                "weight",
                entry.dtype_name,
                entry.offset,
                cols,
                row_start,
                rows,
                shard,
            )
        )
        if fmt == "nvfp4":
            if sname is None:
                raise CheckpointError(
                    f"{path}: nvfp4 tensor {wname} has no block scale "
                    f"{wname.removesuffix('weight')}weight_scale (F8_E4M3 [{rows}, {W // GROUP}])"
                )
            spath, sentry = names[sname]
            if sentry.dtype_name != "F8_E4M3":
                raise CheckpointError(
                    f"{spath}: tensor {sname} has dtype {sentry.dtype_name}, expected F8_E4M3 "
                    "(nvfp4 block scale)"
                )
            if sentry.shape != (rows, W // GROUP):
                raise _bad_shape(
                    spath,
                    sname,
                    sentry.shape,
                    (rows, W // GROUP),
                    where + f", {GROUP} columns per scale",
                )
            parts.append(
                TablePart(
                    sname,
                    str(spath),
                    "weight_scale",
                    "F8_E4M3",
                    sentry.offset,
                    W // GROUP,
                    row_start,
                    rows,
                    shard,
                )
            )
        elif sname is not None:
            spath, _ = names[sname]
            raise CheckpointError(
                f"{spath}: tensor {sname} is a per-row scale, but {wname} is {first.dtype_name} "
                f"({fmt}), which has none; this layout is not known"
            )

    info = PLETableInfo(
        layer_id=layer_id,
        layer_index=ln.layer_index,
        ordinal=ordinal,
        prefix=ln.prefix,
        layout=layout,
        format=fmt,
        geometry=geo,
        parts=parts,
        buffers=buffers,
    )
    gscale = ln.whole.get("weight_scale")
    if layout == "whole" and gscale is not None and len(names[gscale][1].shape) == 2:
        gscale = None  # the whole table's per-row nvfp4 block scale, checked above
    gscale2 = ln.whole.get("weight_scale_2")
    if fmt == "fp8":
        if gscale is None:
            raise CheckpointError(
                f"{first_path}: fp8 table {first.name} has no global scale {base}weight_scale "
                "(F32 []); without it the rows cannot be dequantized"
            )
        gpath, gentry = names[gscale]
        info.weight_scale = _read_scalar(gpath, gentry, "fp8 global weight_scale")
        info.scalar_tensors[gscale] = str(gpath)
    elif gscale is not None:
        gpath, _ = names[gscale]
        raise CheckpointError(
            f"{gpath}: tensor {gscale} is a global scale, but the table is {fmt}, which has none"
        )
    if fmt == "nvfp4":
        if gscale2 is None:
            raise CheckpointError(
                f"{first_path}: nvfp4 table {first.name} has no global scale "
                f"{base}weight_scale_2 (F32 [])"
            )
        gpath, gentry = names[gscale2]
        info.weight_scale_2 = _read_scalar(gpath, gentry, "nvfp4 global weight_scale_2")
        info.scalar_tensors[gscale2] = str(gpath)
    elif gscale2 is not None:
        gpath, _ = names[gscale2]
        raise CheckpointError(
            f"{gpath}: tensor {gscale2} is an nvfp4 scale, but the table is {fmt}"
        )
    return info


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
                f"expected tensors like {PREFIXES['long']}{layer_id - 1}.{_TABLE_HEAD}shard_0.weight"
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
        weights: dict[int, tuple[TablePart, np.ndarray]] = {}
        scales: dict[int, tuple[TablePart, np.ndarray]] = {}
        for copy in self.info.row_map(start, end):
            part = self._parts[copy.tensor]
            arr = self._read(part, copy.src_offset, copy.rows)
            (weights if part.kind == "weight" else scales)[copy.dst_offset] = (part, arr)
        for dst, (_part, raw) in weights.items():
            n = raw.shape[0]
            if self.format == "bf16":
                # bf16 -> float32 is the 16 bits shifted up; done in place in ``out`` because
                # the codec's temporaries cost more (fresh pages) than the shift itself.
                bits = out.view(np.uint32)[dst : dst + n]
                bits[...] = raw.view(np.uint16)
                bits <<= 16
                continue
            if self.format == "fp8":
                # The checkpoint's one global scale is the sidecar codec's per-row scale,
                # repeated: the same float32 product.
                scale = np.full(n, self.info.weight_scale, dtype=np.float32)
                rows = get_codec("fp8").dequantize({"weight_fp8": raw, "weight_scale": scale})
            else:  # nvfp4
                rows = get_codec("nvfp4").dequantize(
                    {
                        "weight_e2m1": raw,
                        "weight_scale": scales[dst][1],
                        "weight_scale_2": np.array(self.info.weight_scale_2, dtype=np.float32),
                    }
                )
            out[dst : dst + n] = rows
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

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

  A *slice* (``flashnext ple slice``: the shards some tensor-parallel ranks read) holds only
  some shards. Its META.json gives ``num_rows``, ``num_shards`` and ``rows_per_shard`` of the
  whole table, ``shards`` lists the shards present, and ``"rows_present": [[start, end], ...]``
  (sorted, disjoint, on shard boundaries) says which rows they hold; ``"slice": {"tp": N,
  "ranks": [...], "source": DIR}`` says how it was cut. Readers open exactly those shards at
  their place in the table and refuse a row range that is not inside the rows present.

  Readers ignore unknown fields and accept the alternative key names other tools use
  (``shard_rows``, ``total_rows``, ``variant``). Where META.json gives ``rows_per_shard``,
  ``num_rows``, ``num_shards`` or ``width``, every shard is checked against it.

Each shard is written to a temporary name and renamed when complete, so a shard file that
exists under its final name is whole; its sha256 is recorded in META.json. Each shard's
safetensors ``__metadata__`` holds ``format``, ``row_start`` (its first table row) and
``table_rows`` (the table's row count); readers check them where present, so a misnumbered,
swapped or stray shard is refused even without META.json.

Completeness (finished vs unfinished)
-------------------------------------
While a writer works (:mod:`flashnext.store.destination` owns writing), the directory holds
``.flashnext-quantize.json`` (:data:`STATE_NAME`, a ``flashnext.ple.quantize_state`` record:
the settings, the source's identity, the shards done).
META.json is written last and the state file removed after it, so a directory is *finished*
exactly when it has no state file. Readers refuse an unfinished directory ("unfinished: N of M
shards, rerun the command that made it").

Sidecars without META.json (written by other tools) are read only when order and extent are
unambiguous: shard numbers consecutive from 0, every shard but the last of equal rows, and
per-shard metadata (where present) consistent with that order. META.json numbers are bounded
(:data:`MAX_SHARDS`, :data:`MAX_ROWS`, :data:`MAX_WIDTH`) and checked before anything is
allocated from them.
"""

from __future__ import annotations

import json
import os
import re
import shlex
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from flashnext import __version__
from flashnext.atomic import write_json
from flashnext.errors import FlashnextError, FormatError, GeometryError, SidecarError
from flashnext.ple.formats import FORMATS, Codec, detect_format
from flashnext.ple.geometry import PLEGeometry
from flashnext.records import PLE_QUANTIZE_STATE, check_record, make_record
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
#: Present while a writer works; its absence (with META.json written) marks a finished sidecar.
STATE_NAME = ".flashnext-quantize.json"
STATE_KIND = PLE_QUANTIZE_STATE
#: Bounds on what META.json or a directory may claim, checked before anything is allocated.
MAX_SHARDS = 1 << 20
MAX_ROWS = 1 << 40
MAX_WIDTH = 1 << 16
MAX_META_BYTES = 16 << 20
_SHARD_RE = re.compile(r"^shard_(\d+)\.safetensors$")


def shard_name(index: int) -> str:
    """``shard_{index}.safetensors``."""
    return f"shard_{index}.safetensors"


def shard_index(name: str) -> int | None:
    """The index of a shard file name (``shard_7.safetensors`` -> 7), None for other names."""
    m = _SHARD_RE.match(name)
    return int(m.group(1)) if m else None


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
    #: The rows a slice holds (``[(start, end), ...]``), or None for a whole table.
    rows_present: tuple[tuple[int, int], ...] | None = None

    def missing_rows(self, start: int, end: int) -> list[tuple[int, int]]:
        """The parts of rows ``[start, end)`` this sidecar does not hold ([] for a whole table)."""
        if self.rows_present is None:
            return []
        missing, at = [], start
        for lo, hi in self.rows_present:
            if hi <= at or lo >= end:
                continue
            if lo > at:
                missing.append((at, lo))
            at = max(at, hi)
        if at < end:
            missing.append((at, end))
        return missing

    def present_text(self) -> str:
        """The rows held, as ``a..b, c..d`` (``0..num_rows`` for a whole table)."""
        ranges = self.rows_present or ((0, self.num_rows),)
        return ", ".join(f"{lo}..{hi}" for lo, hi in ranges)

    @property
    def format(self) -> str:
        return self.codec.name

    @property
    def nbytes(self) -> int:
        """Bytes on disk of all shard files."""
        return sum(s.path.stat().st_size for s in self.shards)

    @property
    def geometry(self) -> PLEGeometry | None:
        """The table's geometry from META.json (validated when the sidecar was opened)."""
        return _meta_geometry(self.path, self.meta, self.num_rows, self.width)

    def expected_checksums(self) -> dict[int, str]:
        """Shard index -> sha256 recorded in META.json (empty when none recorded)."""
        # validated at open (_check_meta_shards): one record per shard file, or none at all
        named = {rec["file"]: rec["sha256"] for rec in self.meta.get("shards") or []}
        return {sh.index: named[sh.path.name] for sh in self.shards if sh.path.name in named}

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


def _meta_int(root: Path, meta: Mapping[str, Any], *keys: str, limit: int = MAX_ROWS) -> int | None:
    """The first of ``keys`` present in META.json, checked to be an int in ``[1, limit]``."""
    for k in keys:
        if k not in meta or meta[k] is None:
            continue
        v = meta[k]
        if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= limit:
            raise SidecarError(
                f"{root / META_NAME}: {k}={v!r}, expected an integer in [1, {limit}]; "
                "fix or remove it"
            )
        return v
    return None


def read_meta(root: Path) -> dict[str, Any]:
    """META.json of ``root`` as a dict ({} when absent), size-bounded and checked to be an object.

    Raises:
        SidecarError: unreadable (permissions), too large, not JSON or not an object.
    """
    path = root / META_NAME
    if not path.exists():
        return {}
    try:
        if not path.is_file():
            raise SidecarError(f"{path}: is not a file; remove it or replace it with META.json")
        if path.stat().st_size > MAX_META_BYTES:
            raise SidecarError(
                f"{path}: {path.stat().st_size} bytes, more than {MAX_META_BYTES} for a META.json"
            )
        text = path.read_bytes()
    except OSError as exc:
        raise SidecarError(f"{path}: cannot read ({exc.strerror}); check its permissions") from None
    try:
        meta = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SidecarError(f"{path}: not valid JSON ({exc}); delete or re-create it") from None
    if not isinstance(meta, dict):
        raise SidecarError(f"{path}: expected a JSON object, found {type(meta).__name__}")
    return meta


def _meta_geometry(
    root: Path, meta: Mapping[str, Any], num_rows: int, width: int
) -> PLEGeometry | None:
    data = meta.get("geometry")
    if data is None:
        return None
    where = f"{root / META_NAME}: geometry"
    try:
        if not isinstance(data, dict):
            raise GeometryError(f"expected an object, found {type(data).__name__}")
        geo = PLEGeometry.from_dict(data)
    except (GeometryError, TypeError, ValueError) as exc:
        raise SidecarError(f"{where}: {exc}; fix it or remove the geometry field") from None
    if (geo.num_rows, geo.width) != (num_rows, width):
        raise SidecarError(
            f"{where} describes {geo.num_rows} rows x {geo.width}, but the shards hold "
            f"{num_rows} x {width}; the geometry belongs to another table: fix or remove it"
        )
    return geo


def read_state(root: Path) -> dict[str, Any] | None:
    """The writer's state record in ``root`` (None when there is none: a finished directory).

    Raises:
        SidecarError: the state file exists but is not a readable state record.
    """
    path = root / STATE_NAME
    if not path.exists():
        return None
    try:
        record = check_record(json.loads(path.read_text()), STATE_KIND, source=str(path))
    except (OSError, UnicodeDecodeError, ValueError, FlashnextError) as exc:
        raise SidecarError(
            f"{root}: unfinished (its state file is unreadable: {exc}); rerun the command that "
            "made it, or remove the directory"
        ) from None
    return record


def write_state(root: Path, num_shards: int, params: Any, shards: Mapping[int, Any]) -> None:
    """Write the state record that marks ``root`` unfinished (:func:`read_state` reads it):
    the run's ``params`` and each finished shard's record (JSON values). Rewritten after every
    shard, as compact JSON (json's C encoder): a save that re-encoded every shard so far in
    Python once took most of a 128-shard quantize's time."""
    payload = {"directory": str(root), "num_shards": num_shards, "params": params, "shards": {}}
    record = make_record(STATE_KIND, payload)
    record["shards"] = {str(k): v for k, v in sorted(shards.items())}
    write_json(root / STATE_NAME, record, indent=None)


def _refuse_unfinished(root: Path) -> None:
    state = read_state(root)
    if state is None:
        return
    done = state.get("shards")
    total = state.get("num_shards")
    command = state["environment"].get("command")
    how = f" ({shlex.join(map(str, command))})" if isinstance(command, list) and command else ""
    raise SidecarError(
        f"{root}: unfinished: {len(done) if isinstance(done, dict) else '?'} of {total} shards, "
        f"rerun the command that made it{how}"
    )


def _list_shards(root: Path) -> dict[int, Path]:
    """Shard index -> file, refusing duplicates, directories and unreadable entries."""
    found: dict[int, Path] = {}
    try:
        entries = list(root.iterdir())
    except OSError as exc:
        raise SidecarError(f"{root}: cannot list ({exc.strerror}); check its permissions") from None
    for entry in entries:
        m = _SHARD_RE.match(entry.name)
        if not m:
            continue
        index = int(m.group(1))
        if index in found:
            raise SidecarError(
                f"{root}: {found[index].name} and {entry.name} both claim shard {index}; "
                "remove the one that does not belong"
            )
        if not entry.is_file():
            raise SidecarError(f"{entry}: is not a file (expected a safetensors shard); remove it")
        found[index] = entry
        if len(found) > MAX_SHARDS:
            raise SidecarError(f"{root}: more than {MAX_SHARDS} shard files")
    if not found:
        raise SidecarError(f"{root}: no shard_N.safetensors files")
    return found


def _names(indices: list[int], limit: int = 5) -> str:
    names = ", ".join(shard_name(i) for i in indices[:limit])
    return names + (" ..." if len(indices) > limit else "")


def _shard_order(
    root: Path, found: dict[int, Path], num_shards: int | None, expected: list[int] | None = None
) -> list[Path]:
    """The shard files in row order, or an error saying what is missing or does not belong.

    ``expected``: a slice's shard indices (from ``rows_present``); exactly those must be there.
    """
    if expected is not None:
        return _slice_order(root, found, expected)
    indices = sorted(found)
    if num_shards is not None:
        beyond = [i for i in indices if i >= num_shards]
        if beyond:
            raise SidecarError(
                f"{root}: {_names(beyond)} beyond num_shards={num_shards} in {META_NAME}: "
                "not part of this table; remove them (or fix num_shards)"
            )
        if len(found) < num_shards:
            missing = [i for i in range(num_shards) if i not in found]
            raise SidecarError(
                f"{root}: missing {_names(missing)} ({len(missing)} of {num_shards} shards); "
                "re-create or re-download them"
            )
        return [found[i] for i in range(num_shards)]
    run = next((k for k, i in enumerate(indices) if i != k), len(indices))
    if run < len(indices):
        after = indices[run:]
        gap = after[0] - run
        absent = shard_name(run) + (f" .. {shard_name(after[0] - 1)}" if gap > 1 else "")
        have = (
            "no shard_0"
            if run == 0
            else f"{shard_name(0)}" + (f" .. {shard_name(run - 1)}" if run > 1 else "")
        )
        raise SidecarError(
            f"{root}: shard numbers are not consecutive from 0 ({have}, then {_names(after)}): "
            f"either {absent} {'are' if gap > 1 else 'is'} missing (restore "
            f"{'them' if gap > 1 else 'it'}) or {_names(after)} "
            f"{'do' if len(after) > 1 else 'does'} not belong (remove "
            f'{"them" if len(after) > 1 else "it"}); add {META_NAME} with "num_shards" '
            "to say which"
        )
    return [found[i] for i in indices]


def _slice_order(root: Path, found: dict[int, Path], expected: list[int]) -> list[Path]:
    stray = sorted(set(found) - set(expected))
    if stray:
        raise SidecarError(
            f"{root}: {_names(stray)} hold rows outside rows_present in {META_NAME}: not part "
            "of this slice; remove them (or re-slice with `flashnext ple slice`)"
        )
    missing = [i for i in expected if i not in found]
    if missing:
        raise SidecarError(
            f"{root}: missing {_names(missing)} ({len(missing)} of the {len(expected)} shards "
            f"rows_present in {META_NAME} needs); re-slice with `flashnext ple slice`"
        )
    return [found[i] for i in expected]


def _rows_present(
    root: Path, meta: Mapping[str, Any], counts: tuple[int | None, int | None, int | None]
) -> tuple[tuple[tuple[int, int], ...], list[int]] | None:
    """A slice's ``rows_present`` and the shard indices holding them (None: a whole table).

    ``counts``: META.json's ``(num_shards, rows_per_shard, num_rows)``, all required for a slice.
    """
    raw = meta.get("rows_present")
    if raw is None:
        return None
    num_shards, per, rows = counts
    where = f"{root / META_NAME}: rows_present"
    if num_shards is None or per is None or rows is None:
        raise SidecarError(f"{where} needs num_shards, rows_per_shard and num_rows beside it")
    ok = (
        isinstance(raw, list)
        and raw
        and all(isinstance(r, list) and len(r) == 2 and all(type(v) is int for v in r) for r in raw)
    )
    ranges = tuple((int(r[0]), int(r[1])) for r in raw) if ok else ()
    flat = [v for r in ranges for v in r]
    if (
        not ok
        or flat != sorted(flat)
        or any(
            not 0 <= lo < hi <= rows or lo % per or (hi % per and hi != rows) for lo, hi in ranges
        )
    ):
        raise SidecarError(
            f"{where}={raw!r}: expected sorted, disjoint [start, end] pairs on shard boundaries "
            f"(multiples of {per}, or {rows}) inside the table; re-slice with `flashnext ple slice`"
        )  # fmt: skip
    indices = [k for lo, hi in ranges for k in range(lo // per, -(-hi // per))]
    if indices and indices[-1] >= num_shards:
        raise SidecarError(f"{where}={raw!r} needs shards beyond num_shards={num_shards}")
    return ranges, indices


def _read_headers(paths: list[Path]) -> list[Header]:
    headers = []
    for path in paths:
        try:
            headers.append(read_header(path))
        except SafetensorsError as exc:
            raise SidecarError(str(exc)) from None
        except OSError as exc:
            raise SidecarError(
                f"{path}: cannot read ({exc.strerror}); check its permissions"
            ) from None
    return headers


def _detect_codec(root: Path, header: Header, meta: Mapping[str, Any]) -> Codec:
    try:
        codec = detect_format(header.tensors)
    except FormatError as exc:
        raise SidecarError(f"{header.path}: {exc}") from None
    # Other tools name the format "variant" and may prefix it like the card's folders.
    meta_format = meta.get("format", meta.get("variant"))
    named = meta_format.removeprefix("ples_") if isinstance(meta_format, str) else None
    if named in FORMATS and named != codec.name:
        raise SidecarError(
            f"{root}: {META_NAME} says format {meta_format!r} but the shards hold {codec.name} "
            f"tensors {list(codec.tensor_names)}"
        )
    return codec


def open_sidecar(path: str | os.PathLike[str]) -> Sidecar:
    """Validate a sidecar directory's headers and return its description (no data is read).

    Every shard is checked: the header parses and matches the file size; the tensor names are
    those of one format, the same in every shard; dtypes and shapes match the format; every
    shard but the last holds ``rows_per_shard`` rows; widths agree; shard numbers run from 0
    without gaps; per-shard metadata agrees with the shard's place; META.json numbers agree.

    Raises:
        SidecarError: with the file, the tensor, what was expected and what was found; an
            unfinished directory (a writer's state file present) is refused.
    """
    root = Path(path)
    try:
        return _open_sidecar(root)
    except OSError as exc:  # a permission or I/O error on any file: one line naming it
        raise SidecarError(
            f"{exc.filename or root}: cannot read ({exc.strerror or exc}); check its permissions"
        ) from None


def _open_sidecar(root: Path) -> Sidecar:
    if not root.is_dir():
        raise SidecarError(
            f"{root}: not a directory (expected a PLE sidecar: shard_N.safetensors + META.json)"
        )
    _refuse_unfinished(root)
    meta = read_meta(root)
    num_shards = _meta_int(root, meta, "num_shards", limit=MAX_SHARDS)
    rows_per_shard = _meta_int(root, meta, "rows_per_shard", "shard_rows")
    num_rows = _meta_int(root, meta, "num_rows", "total_rows")
    meta_width = _meta_int(root, meta, "width", limit=MAX_WIDTH)
    present = _rows_present(root, meta, (num_shards, rows_per_shard, num_rows))
    indices = present[1] if present else None
    headers = _read_headers(_shard_order(root, _list_shards(root), num_shards, indices))
    codec = _detect_codec(root, headers[0], meta)
    rows_per_shard = rows_per_shard or _rows_of(headers[0], codec)
    width = meta_width or _width_of(headers[0], codec)
    try:
        codec.check_width(width)
    except FormatError as exc:
        source = META_NAME if meta_width else headers[0].path.name
        raise SidecarError(f"{root}: width {width} from {source}: {exc}") from None
    order = indices or list(range(len(headers)))
    last = num_shards - 1 if present and num_shards else len(headers) - 1
    shards = []
    for k, header in zip(order, headers, strict=True):
        rows = _check_shard(header, codec, width, rows_per_shard, is_last=k == last)
        _check_shard_metadata(header, codec, k * rows_per_shard)
        shards.append(
            Shard(k, header.path, k * rows_per_shard, rows, header.tensors, _scalars(header, codec))
        )
    held = sum(sh.rows for sh in shards)
    table_rows = num_rows if present and num_rows else held
    wanted = sum(hi - lo for lo, hi in present[0]) if present else num_rows
    if wanted is not None and wanted != held:
        says = "rows_present covers " if present else "num_rows="
        raise SidecarError(
            f"{root}: shards hold {held} rows in all, but {META_NAME} says {says}{wanted}"
        )
    for header in headers:
        _check_table_rows(header, table_rows)
    _meta_geometry(root, meta, table_rows, width)
    _check_meta_shards(root, meta.get("shards"), shards)
    ranges = present[0] if present else None
    return Sidecar(root, codec, width, rows_per_shard, table_rows, shards, meta, ranges)


_SHA256 = re.compile(r"[0-9a-f]{64}")


def _check_meta_shards(root: Path, records: Any, shards: list[Shard]) -> None:
    """META.json's ``shards`` list, when present, must vouch for exactly these files: one
    record per shard file, by name, each a ``{"file", "rows", "sha256"}`` object whose rows
    match the file. A malformed list or a renamed, missing or extra entry is refused here, so
    no reader mistakes it for "checksums not recorded" or lets a shard pass unhashed.

    Raises:
        SidecarError: naming META.json, the entry and what was expected.
    """
    where = f"{root / META_NAME}: shards"
    if records is None:
        return  # no checksums recorded: said as such by inspect, verify and quantize
    fix = "re-create the sidecar, or remove the shards key to serve it without checksums"
    if not isinstance(records, list) or not records:
        raise SidecarError(
            f"{where}={_short(records)}, expected a list of {{'file', 'rows', 'sha256'}} "
            f"records, one per shard file; {fix}"
        )
    by_name: dict[str, Mapping[str, Any]] = {}
    for i, rec in enumerate(records):
        name = rec.get("file") if isinstance(rec, dict) else None
        sha = rec.get("sha256") if isinstance(rec, dict) else None
        if not isinstance(name, str) or not isinstance(sha, str) or not _SHA256.fullmatch(sha):
            raise SidecarError(
                f"{where}[{i}]={_short(rec)}, expected {{'file': 'shard_N.safetensors', "
                f"'rows': R, 'sha256': 64 hex digits}}; {fix}"
            )
        if name in by_name:
            raise SidecarError(f"{where}: {name!r} is listed twice; {fix}")
        by_name[name] = rec
    files = {sh.path.name: sh for sh in shards}
    unlisted = sorted(set(files) - set(by_name), key=_by_index)
    unknown = sorted(set(by_name) - set(files))
    if unlisted or unknown:
        wrong = [f"no checksum for {', '.join(unlisted[:3])}"] if unlisted else []
        wrong += [f"{', '.join(map(repr, unknown[:3]))} is not a shard here"] if unknown else []
        raise SidecarError(
            f"{where} lists {len(by_name)} file(s) for {len(files)} shard file(s): "
            f"{'; '.join(wrong)}; {fix}"
        )
    for name, rec in by_name.items():
        rows = rec.get("rows")
        if rows is not None and rows != files[name].rows:
            raise SidecarError(
                f"{where}: {name} rows={rows!r}, but the file holds {files[name].rows}; {fix}"
            )


def _by_index(name: str) -> tuple[int, str]:
    """Sort key of a shard file name: by index, then by name."""
    index = shard_index(name)
    return (-1 if index is None else index, name)


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _scalars(header: Header, codec: Codec) -> dict[str, float]:
    """Per-shard scalars (nvfp4 ``weight_scale_2``) read from the file: finite and positive,
    as the writer makes them (a zero, negative or NaN one would zero, flip or poison every row
    of the shard without a word)."""
    scalars = {}
    for spec in codec.specs:
        if not spec.per_row:
            entry = header.tensors[spec.name]
            value = np.fromfile(header.path, entry.dtype, 1, offset=entry.offset)[0]
            if not (np.isfinite(value) and value > 0):
                raise SidecarError(
                    f"{header.path}: {spec.name} is {value!s}, expected a finite positive scale; "
                    "this shard is corrupt: re-create it"
                )
            scalars[spec.name] = float(value)
    return scalars


def _metadata_int(header: Header, key: str) -> int | None:
    value = header.metadata.get(key)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise SidecarError(
            f"{header.path}: metadata {key}={value!r} is not an integer; re-create this shard"
        ) from None


def _check_shard_metadata(header: Header, codec: Codec, row_start: int) -> None:
    """A shard's own metadata (where present) must agree with its place in the table."""
    fmt = header.metadata.get("format")
    if fmt in FORMATS and fmt != codec.name:
        raise SidecarError(
            f"{header.path}: its metadata says format {fmt!r}, the table is {codec.name}"
        )
    claimed = _metadata_int(header, "row_start")
    if claimed is not None and claimed != row_start:
        raise SidecarError(
            f"{header.path}: its metadata says row_start {claimed}, but in shard-number order it "
            f"starts at row {row_start}: the files are misnumbered, swapped or from another "
            "table; rename them to follow row order or remove the stray one"
        )


def _check_table_rows(header: Header, total: int) -> None:
    claimed = _metadata_int(header, "table_rows")
    if claimed is not None and claimed != total:
        raise SidecarError(
            f"{header.path}: its metadata says the table has {claimed} rows, the shards hold "
            f"{total}: a shard is missing or does not belong to this table"
        )


def _rows_of(header: Header, codec: Codec) -> int:
    spec = codec.specs[0]
    shape = header.tensors[spec.name].shape
    if len(shape) != 2:
        raise SidecarError(
            f"{header.path}: tensor {spec.name} has shape {list(shape)}, expected 2-D [rows, cols]"
        )
    return shape[0]


def _width_of(header: Header, codec: Codec) -> int:
    _rows_of(header, codec)  # 2-D, or a clear error
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
    if rows == 0:
        raise SidecarError(
            f"{header.path}: tensor {codec.specs[0].name} has 0 rows; a shard holds at least one "
            "row: remove it or re-create it"
        )
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


def write_shard_file(
    root: Path,
    codec: Codec,
    width: int,
    index: int,
    row_start: int,
    rows: int,
    tensors: Mapping[str, np.ndarray],
    *,
    table_rows: int | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """Write ``root/shard_{index}.safetensors`` atomically after checking names, dtypes, shapes.

    The shard's metadata records its format, first row and (when given) the table's rows,
    so readers can check its place without META.json. Returns the shard's META.json record ``{"file", "rows", "sha256", **extra}``.

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
        metadata={
            "format": codec.name,
            "row_start": str(row_start),
            **({"table_rows": str(table_rows)} if table_rows is not None else {}),
            "flashnext": __version__,
        },
    )
    return {"file": shard_name(index), "rows": rows, "sha256": digest, **extra}

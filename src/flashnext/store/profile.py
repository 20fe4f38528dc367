"""Profiles: which rows of a PLE table real text reads most, in priority order.

Spec (schema version 1): a safetensors file, by default ``SIDECAR.profile.safetensors`` beside
the sidecar directory ``SIDECAR`` (:func:`default_profile_path`; never inside it: a writer does
not add files to its input, and the sidecar's own writer would not know the file), holding

- ``row_ids`` int64 [N]: global row ids, sorted by count descending, ties by id ascending;
- ``counts`` int64 [N]: how many lookups of the profiled text hit each row (all > 0);
- ``__metadata__`` ``{"record": <JSON text of a flashnext.store.profile record>}``: the corpus
  files (path, sha256, tokens), the tokenizer, the table geometry, the layer and
  ``total_lookups`` (tokens x heads, every lookup of the text, profiled rows or not) and
  ``coverage_by_table_share`` (the share of lookups the top 0.1%, 1% and 5% of the table's rows
  serve, counted before ``rows`` truncation).

Consumers (the CPU hot tier of :func:`flashnext.host.table.open_table`, the GPU row cache) take
the ``row_ids`` in order, or a prefix of them.

:func:`profile_text_files` builds one from text files: tokenized with a ``tokenizers`` tokenizer
(:func:`load_tokenizer`: a ``tokenizer.json``, a model directory, a model already in the local
Hugging Face cache, or ``demo``, the byte-level BPE ``flashnext demo`` trains) and hashed exactly
as the model does (:mod:`flashnext.ple.hashing`), one fresh request per file.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from flashnext import hub_cache
from flashnext._extras import require
from flashnext.errors import SidecarError
from flashnext.ple.geometry import PLEGeometry
from flashnext.ple.hashing import ngram_ids
from flashnext.records import PLE_PROFILE, RecordError, check_record, dumps, make_record
from flashnext.safetensors_file import SafetensorsError, read_header, read_tensor, write_file
from flashnext.store.destination import DestinationLock
from flashnext.store.sidecar import Sidecar, open_sidecar
from flashnext.user_files import read_user_file

PROFILE_NAME = "profile.safetensors"
#: Its name before issue 43 ("hot rows"): still read, never written.
OLD_PROFILE_NAME = "hot_rows.safetensors"
PROFILE_KIND = PLE_PROFILE
SCHEMA_VERSION = 1
DEMO_TOKENIZER = "demo"


@dataclass(frozen=True)
class RowProfile:
    """Rows by use: ``row_ids`` int64 [N] (count descending, ties by id), ``counts`` int64 [N].

    ``meta`` is the profile record's payload (corpus, tokenizer, geometry, layer).
    """

    row_ids: np.ndarray
    counts: np.ndarray
    total_lookups: int
    meta: Mapping[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.row_ids.size)

    def coverage(self, n: int) -> float:
        """Share of the profiled lookups served by the first ``n`` rows (0..1)."""
        if self.total_lookups <= 0:
            return 0.0
        return float(self.counts[: max(n, 0)].sum()) / self.total_lookups


HotRowProfile = RowProfile  # deprecated: the old name of RowProfile


def build_profile(
    geometry: PLEGeometry,
    token_arrays: Iterable[object],
    rows: int | None = None,
    meta: Mapping[str, Any] | None = None,
) -> RowProfile:
    """Hash each token array (one fresh request each) through ``geometry`` and count rows.

    Args:
        geometry: the table's geometry.
        token_arrays: int [T] token ids per document.
        rows: keep only the ``rows`` most-used rows (``None``: every row seen).
        meta: extra fields for the profile record (corpus, tokenizer, layer).

    Raises:
        GeometryError: a token id is outside the geometry's vocabulary.
    """
    counts = np.zeros(0, dtype=np.int64)
    ids_seen = np.zeros(0, dtype=np.int64)
    total = 0
    for tokens in token_arrays:
        ids = ngram_ids(geometry, tokens).reshape(-1)
        total += ids.size
        ids_seen, counts = _merge_counts(ids_seen, counts, ids)
    # Count descending, ties by id ascending (ids_seen is sorted, the sort is stable).
    order = np.argsort(-counts, kind="stable")
    tiers = _coverage_tiers(counts[order], total, geometry.num_rows)
    if rows is not None:
        order = order[:rows]
    payload = {
        "geometry": geometry.to_dict(),
        "total_lookups": total,
        "coverage_by_table_share": tiers,
        **(meta or {}),
    }
    return RowProfile(ids_seen[order], counts[order], total, payload)


def _coverage_tiers(
    sorted_counts: np.ndarray, total: int, table_rows: int
) -> dict[str, dict[str, float | int]]:
    """Share of all lookups served by the top 0.1%, 1%, 5% of the table's rows (every row
    seen counts, whatever a later truncation keeps)."""
    cumulative = np.cumsum(sorted_counts)
    out: dict[str, dict[str, float | int]] = {}
    for share in (0.001, 0.01, 0.05):
        n = max(1, int(table_rows * share))
        served = int(cumulative[min(n, cumulative.size) - 1]) if cumulative.size else 0
        out[f"{share:.1%}"] = {"rows": n, "coverage": served / total if total > 0 else 0.0}
    return out


def default_profile_path(sidecar_dir: str | os.PathLike[str]) -> Path:
    """Where ``ple profile`` writes by default: ``SIDECAR.profile.safetensors`` beside it."""
    root = Path(sidecar_dir)
    return root.with_name(f"{root.name}.{PROFILE_NAME}")


def profile_files(directory: str | os.PathLike[str]) -> list[Path]:
    """Where a sidecar (or slice) directory's profile may be, in the order they are tried:
    beside it (``ple profile``'s default), then inside it (``ple slice``'s copy, and earlier
    versions), each under :data:`PROFILE_NAME` and then :data:`OLD_PROFILE_NAME`."""
    root = Path(directory)
    names = (PROFILE_NAME, OLD_PROFILE_NAME)
    return [root.with_name(f"{root.name}.{n}") for n in names] + [root / n for n in names]


def _profile_in(directory: Path) -> Path:
    """A sidecar directory's profile (:func:`profile_files`), or where it would be written."""
    return next((p for p in profile_files(directory) if p.is_file()), directory / PROFILE_NAME)


def _merge_counts(
    ids_seen: np.ndarray, counts: np.ndarray, new_ids: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    uniq, cnt = np.unique(new_ids, return_counts=True)
    all_ids = np.concatenate([ids_seen, uniq])
    all_counts = np.concatenate([counts, cnt.astype(np.int64)])
    merged, inverse = np.unique(all_ids, return_inverse=True)
    return merged, np.bincount(inverse, weights=all_counts, minlength=merged.size).astype(np.int64)


def write_profile(
    path: str | os.PathLike[str], profile: RowProfile, lock: DestinationLock | None = None
) -> Path:
    """Write ``profile`` to ``path`` (a file, or a sidecar directory: the file beside it,
    :func:`default_profile_path`), atomically, under the file's :class:`DestinationLock`:
    ``lock`` when the caller took it before its work (so a second writer is refused at once),
    else one taken here. Returns the file written.

    Raises:
        SidecarError: the profile holds no rows (the text held no tokens), or another process
            is writing ``path``; nothing is written.
    """
    target = Path(path)
    if target.is_dir():
        target = default_profile_path(target)
    if len(profile) == 0:
        corpus = profile.meta.get("corpus") or []
        names = ", ".join(str(c.get("path")) for c in corpus[:3] if isinstance(c, Mapping))
        raise SidecarError(
            f"{target}: not written: the profile holds no rows (the text{f' ({names})' if names else ''} "
            "held no tokens); profile a non-empty text"
        )
    payload = {**profile.meta, "total_lookups": int(profile.total_lookups), "rows": len(profile)}
    record = make_record(PROFILE_KIND, payload, schema_version=SCHEMA_VERSION)
    with contextlib.nullcontext() if lock is not None and lock.held else DestinationLock(target):
        write_file(
            target,
            {
                "row_ids": np.ascontiguousarray(profile.row_ids, dtype=np.int64),
                "counts": np.ascontiguousarray(profile.counts, dtype=np.int64),
            },
            metadata={"record": dumps(record, indent=None)},
        )
    return target


def load_profile(path: str | os.PathLike[str]) -> RowProfile:
    """Read a profile file (or a sidecar directory's: beside it, else inside) and check it.

    Raises:
        SidecarError: the file is missing, not a profile, or its tensors disagree with the spec
            (the message names the file and the field).
    """
    target = Path(path)
    if target.is_dir():
        target = _profile_in(target)
    if not target.is_file():
        raise SidecarError(
            f"{target}: no profile; build one with `flashnext ple profile SIDECAR "
            "--text FILES...`"
        )
    try:
        header = read_header(target)
        record = check_record(
            json.loads(header.metadata.get("record", "null")),
            kind=PROFILE_KIND,
            schema_version=SCHEMA_VERSION,
            source=str(target),
        )
    except (SafetensorsError, RecordError, json.JSONDecodeError) as exc:
        raise SidecarError(f"{target}: not a profile ({exc})") from None
    arrays = {}
    for name in ("row_ids", "counts"):
        entry = header.tensors.get(name)
        if entry is None or entry.dtype != np.int64 or len(entry.shape) != 1:
            found = "missing" if entry is None else f"{entry.dtype_name} {list(entry.shape)}"
            raise SidecarError(f"{target}: tensor {name} is {found}, expected int64 [N]")
        arrays[name] = read_tensor(entry, target, mmap=False)
    ids, counts = arrays["row_ids"], arrays["counts"]
    if ids.shape != counts.shape or np.any(np.diff(counts) > 0) or np.any(counts <= 0):
        raise SidecarError(
            f"{target}: counts must be positive and non-increasing, one per row id; "
            "re-create the profile with `flashnext ple profile`"
        )
    meta = {k: v for k, v in record.items() if k not in ("schema_version", "kind")}
    return RowProfile(ids, counts, int(record.get("total_lookups", 0)), meta)


# -- building a profile from text files ---------------------------------------------------------


def _cached_tokenizer(name: str) -> Path | None:
    """``tokenizer.json`` of model ``name`` ("org/model") in the local Hugging Face cache."""
    for cache in hub_cache.cache_dirs():
        for snap in hub_cache.snapshots(hub_cache.repo_folder(cache, name)):
            if (snap / "tokenizer.json").is_file():
                return snap / "tokenizer.json"
    return None


@functools.lru_cache(maxsize=1)
def _demo_tokenizer() -> tuple[Any, int]:
    """``flashnext demo``'s BPE and its EOS id (trained once per process: ~2 s)."""
    from flashnext.text import EOS, corpus_files, train_tokenizer

    tok = train_tokenizer(corpus_files())
    return tok, tok.token_to_id(EOS)


def load_tokenizer(spec: str | None, geometry: PLEGeometry) -> tuple[Any, dict[str, Any]]:
    """A ``tokenizers.Tokenizer`` for ``spec`` and its description for the profile record.

    ``spec``: a ``tokenizer.json`` file, a directory holding one, a model name already in the
    local Hugging Face cache (nothing is downloaded), or ``"demo"`` (``flashnext demo``'s BPE,
    trained again on this machine's files: the same text gives the same tokenizer). ``None``
    means ``"demo"`` when the table's vocabulary is the demo's.

    Raises:
        SidecarError: the tokenizer cannot be found, or its vocabulary does not fit the table's.
        MissingExtraError: the ``tokenizers`` package is missing.
    """
    tokenizers = require("tokenizers", "demo", "flashnext ple profile")
    if spec is None or spec == DEMO_TOKENIZER:
        tok, eos = _demo_tokenizer()
        if (tok.get_vocab_size(), eos) != (geometry.vocab_size, geometry.eos_token_id):
            raise SidecarError(
                f"the demo tokenizer (vocab {tok.get_vocab_size()}, EOS {eos}) does not match the "
                f"table's geometry (vocab {geometry.vocab_size}, EOS {geometry.eos_token_id}): "
                "pass --tokenizer with the model's tokenizer.json"
            )
        return tok, {"kind": "demo", "vocab_size": tok.get_vocab_size()}
    path = Path(spec)
    if path.is_dir():
        path = path / "tokenizer.json"
    if path.is_file():
        kind = "file"
    else:
        cached = (
            _cached_tokenizer(spec) if "/" in spec and not spec.startswith(("/", ".")) else None
        )
        if cached is None:
            raise SidecarError(
                f"--tokenizer {spec}: not a tokenizer.json, a directory with one, or a model in "
                f"the local Hugging Face cache ({', '.join(map(str, hub_cache.cache_dirs()))}); "
                "nothing is downloaded: fetch the model's tokenizer.json and pass its path"
            )
        path, kind = cached, "hub-cache"
    try:
        tok = tokenizers.Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises its own Exception subclasses
        raise SidecarError(f"{path}: not a tokenizers tokenizer.json ({exc})") from None
    if tok.get_vocab_size() > geometry.vocab_size:
        raise SidecarError(
            f"{path}: the tokenizer has {tok.get_vocab_size()} tokens but the table's geometry "
            f"only {geometry.vocab_size}; is it this model's tokenizer?"
        )
    return tok, {"kind": kind, "path": str(path), "vocab_size": tok.get_vocab_size()}


def _tokenized(
    tokenizer: Any, files: Sequence[Path], corpus: list[dict[str, Any]]
) -> Iterator[np.ndarray]:
    """Token ids of each file (one document each); appends each file's record to ``corpus``."""
    for path in files:
        data = read_user_file(path, "a --text file")
        text = data.decode("utf-8", errors="replace")
        ids = np.asarray(tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.int64)
        corpus.append(
            {
                "path": str(path),
                "sha256": hashlib.sha256(data).hexdigest(),
                "bytes": len(data),
                "tokens": int(ids.size),
            }
        )
        yield ids


def profile_text_files(
    geometry: PLEGeometry,
    files: Sequence[str | os.PathLike[str]],
    tokenizer: Any,
    tokenizer_meta: Mapping[str, Any],
    rows: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> RowProfile:
    """Tokenize each file, hash it through ``geometry`` (a fresh request per file) and count rows.

    ``progress(nbytes)`` is called after each file. The record names every file with its
    sha256, bytes and tokens, the tokenizer and the layer.

    Raises:
        SidecarError: a file cannot be read.
        GeometryError: the tokenizer produced a token outside the geometry's vocabulary.
    """
    paths = [Path(f) for f in files]
    corpus: list[dict[str, Any]] = []

    def documents() -> Iterator[np.ndarray]:
        for path, ids in zip(paths, _tokenized(tokenizer, paths, corpus)):
            yield ids
            if progress is not None:
                progress(path.stat().st_size)

    try:
        meta = {"tokenizer": dict(tokenizer_meta), "layer": geometry.layer_ordinal}
        profile = build_profile(geometry, documents(), rows=rows, meta=meta)
    except OSError as exc:
        raise SidecarError(f"{exc.filename}: cannot read the text file ({exc.strerror})") from None
    full_meta = {**profile.meta, "corpus": corpus, "tokens": sum(c["tokens"] for c in corpus)}
    return RowProfile(profile.row_ids, profile.counts, profile.total_lookups, full_meta)


def profile_sidecar(
    sidecar_dir: str | os.PathLike[str],
    texts: Sequence[str | os.PathLike[str]],
    target: str | os.PathLike[str],
    *,
    tokenizer: str | None = None,
    layer: int | None = None,
    rows: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> tuple[Sidecar, RowProfile]:
    """Profile ``texts`` for the sidecar at ``sidecar_dir`` (layer ordinal ``layer`` of its
    recorded geometry) and write the profile to the file ``target``, holding ``target``'s
    :class:`~flashnext.store.destination.DestinationLock` from before the work: a second
    writer of the same file is refused at once. ``tokenizer`` and ``progress`` are as for
    :func:`load_tokenizer` and :func:`profile_text_files`.

    Returns:
        The sidecar and the profile written.

    Raises:
        SidecarError: another process is writing ``target``; the sidecar records no geometry,
            or ``layer``'s table has another shape; or as :func:`write_profile`.
    """
    out = Path(target)
    with DestinationLock(out) as lock:
        sidecar = open_sidecar(sidecar_dir)
        if sidecar.geometry is None:
            raise SidecarError(
                f"{sidecar_dir}: META.json records no geometry, so its row ids cannot be "
                "computed; re-create the sidecar with `flashnext ple quantize` from the checkpoint"
            )
        geometry = ordinal_geometry(sidecar.geometry, layer)
        if (geometry.num_rows, geometry.width) != (sidecar.num_rows, sidecar.width):
            raise SidecarError(
                f"--layer {layer}: that layer's table has {geometry.num_rows} x {geometry.width} "
                f"rows, {sidecar_dir} has {sidecar.num_rows} x {sidecar.width}: profile it with "
                "its own layer"
            )
        tok, tok_meta = load_tokenizer(tokenizer, geometry)
        found = profile_text_files(geometry, texts, tok, tok_meta, rows, progress=progress)
        out.parent.mkdir(parents=True, exist_ok=True)
        write_profile(out, found, lock)
    return sidecar, found


def ordinal_geometry(geometry: PLEGeometry, layer: int | None) -> PLEGeometry:
    """``geometry`` of another PLE layer ordinal (same config fields; buffers not carried over).

    Raises:
        GeometryError: ``layer`` is negative.
    """
    if layer is None or layer == geometry.layer_ordinal:
        return geometry
    config = {
        "vocab_size": geometry.vocab_size,
        "eos_token_id": geometry.eos_token_id,
        "ngram_size": geometry.ngram_size,
        "heads_per_ngram": geometry.heads_per_ngram,
        "ngram_vocab_size_base": geometry.base,
        "make_ngram_vocab_size_divisible_by": geometry.divisible_by,
        "seed": geometry.seed,
        "split_ngram_parts": geometry.split_ngram_parts,
        "ple_embed_dim": geometry.width * geometry.num_heads,
    }
    return PLEGeometry.from_config(config, layer_ordinal=layer)

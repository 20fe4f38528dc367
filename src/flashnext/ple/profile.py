"""Hot-row profiles: which rows of a PLE table real text reads most, in priority order.

Spec (schema version 1): a safetensors file, by default ``hot_rows.safetensors`` beside the
sidecar's shards, holding

- ``row_ids`` int64 [N]: global row ids, sorted by count descending, ties by id ascending;
- ``counts`` int64 [N]: how many lookups of the profiled text hit each row (all > 0);
- ``__metadata__`` ``{"record": <JSON text of a flashnext.ple.profile record>}``: the corpus
  files (path, sha256, tokens), the tokenizer, the table geometry, the layer and
  ``total_lookups`` (tokens x heads, every lookup of the text, profiled rows or not).

Consumers (the CPU hot tier of :func:`flashnext.ple.table.open_table`, the GPU row cache) take
the ``row_ids`` in order, or a prefix of them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from flashnext.errors import SidecarError
from flashnext.ple.geometry import PLEGeometry
from flashnext.ple.hashing import ngram_ids
from flashnext.records import RecordError, check_record, dumps, make_record
from flashnext.safetensors_file import SafetensorsError, read_header, read_tensor, write_file

PROFILE_NAME = "hot_rows.safetensors"
PROFILE_KIND = "flashnext.ple.profile"
SCHEMA_VERSION = 1


@dataclass(frozen=True)
class HotRowProfile:
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


def build_profile(
    geometry: PLEGeometry,
    token_arrays: Iterable[object],
    rows: int | None = None,
    meta: Mapping[str, Any] | None = None,
) -> HotRowProfile:
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
    if rows is not None:
        order = order[:rows]
    payload = {"geometry": geometry.to_dict(), "total_lookups": total, **(meta or {})}
    return HotRowProfile(ids_seen[order], counts[order], total, payload)


def _merge_counts(
    ids_seen: np.ndarray, counts: np.ndarray, new_ids: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    uniq, cnt = np.unique(new_ids, return_counts=True)
    all_ids = np.concatenate([ids_seen, uniq])
    all_counts = np.concatenate([counts, cnt.astype(np.int64)])
    merged, inverse = np.unique(all_ids, return_inverse=True)
    return merged, np.bincount(inverse, weights=all_counts, minlength=merged.size).astype(np.int64)


def write_profile(path: str | os.PathLike[str], profile: HotRowProfile) -> Path:
    """Write ``profile`` to ``path`` (a file, or a sidecar directory: ``PROFILE_NAME`` in it),
    atomically. Returns the file written."""
    target = Path(path)
    if target.is_dir():
        target = target / PROFILE_NAME
    payload = {**profile.meta, "total_lookups": int(profile.total_lookups), "rows": len(profile)}
    record = make_record(PROFILE_KIND, payload, schema_version=SCHEMA_VERSION)
    write_file(
        target,
        {
            "row_ids": np.ascontiguousarray(profile.row_ids, dtype=np.int64),
            "counts": np.ascontiguousarray(profile.counts, dtype=np.int64),
        },
        metadata={"record": dumps(record, indent=None)},
    )
    return target


def load_profile(path: str | os.PathLike[str]) -> HotRowProfile:
    """Read a profile file (or ``PROFILE_NAME`` in a directory) and check it.

    Raises:
        SidecarError: the file is missing, not a profile, or its tensors disagree with the spec
            (the message names the file and the field).
    """
    target = Path(path)
    if target.is_dir():
        target = target / PROFILE_NAME
    if not target.is_file():
        raise SidecarError(
            f"{target}: no hot-row profile; build one with `flashnext ple profile SIDECAR "
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
        raise SidecarError(f"{target}: not a hot-row profile ({exc})") from None
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
    return HotRowProfile(ids, counts, int(record.get("total_lookups", 0)), meta)

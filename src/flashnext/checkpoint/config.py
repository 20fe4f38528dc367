"""Read a checkpoint's config.json; change ``layer_types`` entries with the reason recorded.

Some runtimes reject a layer type the checkpoint declares (the Flash-Next deployment notes:
twelve ``qwen_sparse_attention`` entries where the runtime expected ``full_attention``). A
local override lets the runtime load; it does NOT show that the two settings compute the same
thing. Every override written here says so, next to the list of entries it changed:

- ``--out DIR2``: ``DIR2/config.json`` is a patched copy with a ``_flashnext_overrides``
  entry, ``DIR2/FLASHNEXT_OVERRIDES.json`` repeats the record, and every other top-level
  file of the snapshot is symlinked into DIR2 (no weights are copied), so DIR2 can be served.
- ``--hf-overrides``: the JSON to pass to vLLM's ``--hf-overrides`` (only the changed field).

The original config.json is never modified.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flashnext.atomic import write_json
from flashnext.errors import CheckpointError, GeometryError
from flashnext.ple.geometry import PLEGeometry, ple_layer_ids
from flashnext.records import CHECKPOINT_OVERRIDE, make_record

CONFIG_NAME = "config.json"
OVERRIDES_KEY = "_flashnext_overrides"
OVERRIDES_FILE = "FLASHNEXT_OVERRIDES.json"
CAVEAT = (
    "This change lets the runtime load the checkpoint. It is NOT shown to be computationally "
    "equivalent to the original configuration: no comparison of outputs or attention behaviour "
    "before and after the override has been made. Validate output quality before relying on it."
)


def read_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The parsed config.json of a checkpoint directory (or of a config.json path).

    Raises:
        CheckpointError: the file is missing or not a JSON object.
    """
    p = Path(path)
    if p.is_dir():
        p = p / CONFIG_NAME
    try:
        doc = json.loads(p.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{p}: missing; a model snapshot needs config.json") from None
    except OSError as exc:
        raise CheckpointError(f"{p}: cannot read ({exc.strerror or exc}); check its mode") from None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise CheckpointError(f"{p}: not valid JSON ({exc}); re-download it") from None
    if not isinstance(doc, dict):
        raise CheckpointError(
            f"{p}: a JSON {_json_type(doc)}, expected an object of config fields; re-download it"
        )
    return doc


def _json_type(value: Any) -> str:
    names = {list: "array", str: "string", bool: "boolean", type(None): "null"}
    return names.get(type(value), "number")


def config_error(path: str | os.PathLike[str], exc: GeometryError) -> GeometryError:
    """``exc`` (raised for a config's PLE fields) with the config file and the fix named."""
    return GeometryError(
        f"{path}: {exc}; correct the field in config.json (compare with the model's published "
        "config) or re-download it"
    )


def check_ple_config(config: Mapping[str, Any], source: str | os.PathLike[str]) -> None:
    """Check that ``config`` (read from ``source``) describes a valid geometry for every PLE
    layer it lists, before any tensor is looked at.

    Raises:
        GeometryError: a PLE field is missing or out of range; the message names ``source``,
            the field and the fix.
    """
    try:
        for layer_id in ple_layer_ids(config):
            PLEGeometry.from_config(config, layer_id=layer_id)
    except GeometryError as exc:
        raise config_error(source, exc) from None


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
    places = [("", patched)]
    if isinstance(patched.get("text_config"), dict):
        places.append(("text_config.", patched["text_config"]))
    found_any = False
    seen: set[str] = set()
    for where, cfg in places:
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


OVERRIDE_KIND = CHECKPOINT_OVERRIDE
OVERRIDE_SCHEMA = 1


def override_record(
    mapping: Mapping[str, str], changes: list[Change], source: Path, reason: str | None
) -> dict[str, Any]:
    """The record stored with a patched config (a ``flashnext.checkpoint.override`` record):
    what changed, why, the source config's sha256, and the caveat."""
    src_bytes = source.read_bytes() if source.exists() else b""
    payload = {
        "source_config": str(source.resolve()),
        "source_sha256": hashlib.sha256(src_bytes).hexdigest(),
        "layer_type_mapping": dict(mapping),
        "changes": [{"field": c.field, "old": c.old, "new": c.new} for c in changes],
        "reason": reason
        or "runtime compatibility: the runtime does not accept the original layer type",
        "equivalence": "not shown",
        "caveat": CAVEAT,
    }
    return make_record(OVERRIDE_KIND, payload, schema_version=OVERRIDE_SCHEMA)


@dataclass(frozen=True)
class OverridePlan:
    """A ``layer_types`` override worked out but not yet written (see :func:`plan_override`)."""

    root: Path  # the snapshot directory the config comes from
    patched: dict[str, Any]  # the whole patched config
    changes: list[Change]
    record: dict[str, Any]  # the override record

    @property
    def hf_overrides(self) -> dict[str, Any]:
        """The JSON for vLLM ``--hf-overrides``."""
        return hf_overrides(self.patched, self.changes)

    def write(self, out: str | os.PathLike[str]) -> list[str]:
        """Write the servable patched copy (:func:`write_overridden_snapshot`)."""
        return write_overridden_snapshot(self.root, out, self.patched, self.record)


def plan_override(
    path: str | os.PathLike[str], specs: list[str] | tuple[str, ...], reason: str | None
) -> OverridePlan:
    """Work out the override ``specs`` (``OLD=NEW`` strings) of the snapshot at ``path``.

    Raises:
        CheckpointError: ``path`` is no snapshot, its config.json is missing or not an object,
            a spec is malformed, or no ``layer_types`` entry matches.
    """
    from flashnext.checkpoint.snapshot import resolve_snapshot

    root, _layout = resolve_snapshot(path)
    mapping = parse_mapping(specs)
    patched, changes = override_layer_types(read_config(root), mapping)
    return OverridePlan(
        root, patched, changes, override_record(mapping, changes, root / CONFIG_NAME, reason)
    )


def hf_overrides(patched: Mapping[str, Any], changes: list[Change]) -> dict[str, Any]:
    """The JSON for vLLM ``--hf-overrides``: only the changed ``layer_types`` list(s)."""
    out: dict[str, Any] = {}
    if any(not c.field.startswith("text_config.") for c in changes):
        out["layer_types"] = patched["layer_types"]
    if any(c.field.startswith("text_config.") for c in changes):
        out["text_config"] = {"layer_types": patched["text_config"]["layer_types"]}
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
        CheckpointError: ``out`` is ``src`` or inside it, or holds a config.json that is not ours.
    """
    src_p, out_p = Path(src).resolve(), Path(out)
    if out_p.resolve() == src_p or src_p in out_p.resolve().parents:
        raise CheckpointError(
            f"--out {out_p} is the checkpoint or inside it; the original checkpoint is never "
            "edited in place: choose a directory outside it"
        )
    out_p.mkdir(parents=True, exist_ok=True)
    existing = out_p / CONFIG_NAME
    if existing.exists() and not existing.is_symlink():
        try:
            ours = OVERRIDES_KEY in json.loads(existing.read_text())
        except (OSError, ValueError):
            ours = False
        if not ours:
            raise CheckpointError(
                f"{existing} exists and was not written by flashnext; refusing to overwrite it"
            )
    linked = []
    for entry in sorted(src_p.iterdir()):
        if entry.name in (CONFIG_NAME, OVERRIDES_FILE, ".cache"):
            continue
        link = out_p / entry.name
        if link.is_symlink() or link.exists():
            if link.is_symlink() and Path(os.readlink(link)) == entry:
                linked.append(entry.name)
            continue
        link.symlink_to(entry)
        linked.append(entry.name)
    if existing.is_symlink():
        existing.unlink()
    doc = dict(patched)
    doc[OVERRIDES_KEY] = dict(record)
    write_json(existing, doc)
    write_json(out_p / OVERRIDES_FILE, dict(record))
    return linked

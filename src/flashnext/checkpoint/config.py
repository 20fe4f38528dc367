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

from flashnext import __version__
from flashnext.atomic import write_json
from flashnext.errors import CheckpointError

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
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{p}: not valid JSON ({exc}); re-download it") from None
    if not isinstance(doc, dict):
        raise CheckpointError(f"{p}: expected a JSON object, found {type(doc).__name__}")
    return doc


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


def override_record(
    mapping: Mapping[str, str], changes: list[Change], source: Path, reason: str | None
) -> dict[str, Any]:
    """The record stored with a patched config: what changed, why, and the caveat."""
    src_bytes = source.read_bytes() if source.exists() else b""
    return {
        "flashnext_version": __version__,
        "source_config": str(source.resolve()),
        "source_sha256": hashlib.sha256(src_bytes).hexdigest(),
        "layer_type_mapping": dict(mapping),
        "changes": [{"field": c.field, "old": c.old, "new": c.new} for c in changes],
        "reason": reason
        or "runtime compatibility: the runtime does not accept the original layer type",
        "equivalence": "not shown",
        "caveat": CAVEAT,
    }


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

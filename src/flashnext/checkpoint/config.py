"""Read a checkpoint's config.json and check its PLE fields.

The override of config entries (``flashnext checkpoint override``) lives in
:mod:`flashnext.checkpoint.override`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from flashnext.errors import CheckpointError, GeometryError
from flashnext.ple.geometry import PLEGeometry, ple_layer_ids
from flashnext.user_files import JSON_LIMIT, read_user_text

CONFIG_NAME = "config.json"


def read_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The parsed config.json of a checkpoint directory (or of a config.json path).

    Raises:
        CheckpointError: the file is missing or not a JSON object.
    """
    p = Path(path)
    if p.is_dir() and p.name != CONFIG_NAME:  # a config.json that is a directory is refused
        p = p / CONFIG_NAME
    try:
        doc = json.loads(read_user_text(p, "config.json", JSON_LIMIT))
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

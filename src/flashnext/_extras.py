"""Lazy imports of optional dependencies with a one-line install hint."""

from __future__ import annotations

import importlib
from types import ModuleType

from flashnext.errors import MissingExtraError


def require(module: str, extra: str, purpose: str) -> ModuleType:
    """Import ``module`` or raise :class:`MissingExtraError` naming the extra to install.

    ``purpose`` completes the sentence "<purpose> needs <module>".
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingExtraError(
            f"{purpose} needs the '{module}' package: pip install 'flashnext[{extra}]'"
        ) from exc

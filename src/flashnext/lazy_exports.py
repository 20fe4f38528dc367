"""A package's public names, imported from its submodules on first use.

``host``, ``store`` and ``ple`` export names whose modules load numba kernels or tables; a
module-level ``__getattr__`` (PEP 562) lets ``import flashnext.host.preflight`` skip them.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(
    package: str, exports: Mapping[str, str], namespace: dict[str, Any]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: name ``n`` of ``exports`` (name -> submodule)
    is ``package.<exports[n]>.n``, imported at its first lookup and then kept in ``namespace``
    (the package's ``globals()``), so later lookups skip ``__getattr__``.
    """

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{exports[name]}"), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__

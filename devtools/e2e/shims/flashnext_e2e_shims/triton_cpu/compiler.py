"""The backend's compiler: it refuses to compile (kernels run in the interpreter)."""

from __future__ import annotations

from typing import Any

from triton.backends.compiler import BaseBackend, GPUTarget


class CpuInterpreterOnlyBackend(BaseBackend):
    """Claims the ``cpu`` target and compiles nothing."""

    @staticmethod
    def supports_target(target: GPUTarget) -> bool:
        return target.backend == "cpu"

    def hash(self) -> str:
        return "flashnext-e2e-cpu-interpreter-only"

    def parse_options(self, options: dict[str, Any]) -> object:
        raise RuntimeError("flashnext e2e cpu backend compiles nothing: set TRITON_INTERPRET=1")

    def add_stages(self, stages: dict[str, Any], options: object, language: Any) -> None:
        raise RuntimeError("flashnext e2e cpu backend compiles nothing: set TRITON_INTERPRET=1")

    def load_dialects(self, context: Any) -> None:
        return None

    def get_module_map(self) -> dict[str, Any]:
        return {}

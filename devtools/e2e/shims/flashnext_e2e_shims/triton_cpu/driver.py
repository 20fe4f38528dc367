"""The backend's driver: active everywhere, targets ``cpu``, runs nothing itself."""

from __future__ import annotations

from typing import Any

from triton.backends.compiler import GPUTarget
from triton.backends.driver import DriverBase


class CpuInterpreterOnlyDriver(DriverBase):
    """The ``cpu`` driver vLLM looks for; kernels reach the interpreter, never this."""

    @classmethod
    def is_active(cls) -> bool:
        return True

    def map_python_to_cpp_type(self, ty: str) -> str:
        raise RuntimeError("flashnext e2e cpu backend launches nothing: set TRITON_INTERPRET=1")

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cpu", 0, 0)

    def get_active_torch_device(self) -> Any:
        import torch

        return torch.device("cpu")

    def get_benchmarker(self) -> Any:
        raise RuntimeError("flashnext e2e cpu backend benchmarks nothing")

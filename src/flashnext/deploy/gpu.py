"""The GPU a deployment will run on: from NVML (``auto``) or from a spec like ``sm120,96GiB``."""

from __future__ import annotations

import re
from dataclasses import dataclass

from flashnext.errors import FlashnextError
from flashnext.plan.sizes import parse_size


class GpuSpecError(FlashnextError, ValueError):
    """A ``--gpu`` value that is not ``auto`` or ``smXY[,MEMORY][,cudaN.M]``."""


@dataclass(frozen=True)
class GpuSpec:
    """What the checks know about the GPU; ``None`` = unknown."""

    name: str | None
    capability: tuple[int, int] | None
    memory_bytes: int | None
    cuda: tuple[int, int] | None  # the driver's CUDA version
    source: str  # "nvml", "given" or "unknown"

    @property
    def sm(self) -> str | None:
        return None if self.capability is None else f"sm{self.capability[0]}{self.capability[1]}"


def parse_gpu(spec: str) -> GpuSpec:
    """``auto`` reads NVML; otherwise comma-separated ``smXY``, a size (``96GiB``), ``cudaN.M``.

    Raises:
        GpuSpecError: naming the part that is not understood.
    """
    if spec == "auto":
        return detect_gpu()
    capability = memory = cuda = None
    parts = [p.strip() for p in spec.split(",")]
    if "" in parts:  # "sm120,,96GiB" or a trailing comma: a typo, not a part to drop
        raise GpuSpecError(
            f"--gpu {spec!r}: empty item at position {parts.index('') + 1}; expected "
            "comma-separated smXY (sm120), a size (96GiB) and cudaN.M"
        )
    for part in parts:
        if m := re.fullmatch(r"sm_?(\d+)(\d)a?", part, re.IGNORECASE):
            capability = (int(m.group(1)), int(m.group(2)))
        elif m := re.fullmatch(r"cuda(\d+)(?:\.(\d+))?", part, re.IGNORECASE):
            cuda = (int(m.group(1)), int(m.group(2) or 0))
        else:
            try:
                memory = parse_size(part)
            except ValueError:
                raise GpuSpecError(
                    f"--gpu {spec!r}: {part!r} is not smXY (sm120), a size (96GiB) or cudaN.M"
                ) from None
    return GpuSpec(None, capability, memory, cuda, "given")


def detect_gpu(index: int = 0) -> GpuSpec:
    """GPU ``index`` through NVML; an unknown GPU when NVML or a GPU is missing."""
    try:
        import pynvml  # type: ignore[import-not-found]
    except ImportError:
        return GpuSpec(None, None, None, None, "unknown")
    try:
        pynvml.nvmlInit()
    except Exception:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...: no GPU here
        return GpuSpec(None, None, None, None, "unknown")
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        name = pynvml.nvmlDeviceGetName(handle)
        cap = tuple(pynvml.nvmlDeviceGetCudaComputeCapability(handle))
        mem = int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
        drv = int(pynvml.nvmlSystemGetCudaDriverVersion())
        return GpuSpec(
            name.decode() if isinstance(name, bytes) else str(name),
            (int(cap[0]), int(cap[1])),
            mem,
            (drv // 1000, drv % 1000 // 10),
            "nvml",
        )
    except Exception:
        return GpuSpec(None, None, None, None, "unknown")
    finally:
        pynvml.nvmlShutdown()

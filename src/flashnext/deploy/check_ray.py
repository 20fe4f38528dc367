"""``flashnext check`` on a Ray deployment: will the plugin's switches reach every worker?

A Ray worker has neither the driver's command line nor (the legacy executor,
``VLLM_USE_RAY_V2_EXECUTOR_BACKEND=0``) the driver's ``FLASHNEXT_*`` unless
``VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY`` lists ``FLASHNEXT_``. The plugin, loaded in the
driver, carries both (:mod:`flashnext.integrations.vllm.ranks`); this rule refuses what it cannot
carry: a driver that does not load the plugin (``VLLM_PLUGINS`` without ``flashnext``), and a
relative sidecar or profile path (a Ray worker runs in its own directory).
"""

from __future__ import annotations

from typing import Any

from flashnext.deploy.serve_args import ServeArgs
from flashnext.errors import FlashnextError
from flashnext.status import Status

#: The plugin's name in ``vllm.general_plugins`` (what ``VLLM_PLUGINS`` must list).
ENTRY_NAME = "flashnext"
PATH_SETTINGS = {"ple_sidecar": "FLASHNEXT_PLE_SIDECAR", "ple_profile": "FLASHNEXT_PLE_PROFILE"}


def check_ray_reach(args: ServeArgs) -> tuple[Status, str, str]:
    """(status, why, fix) of the rule ``ray-switches`` for ``args`` (flags and environment).

    ``skip`` without ``--distributed-executor-backend ray`` or with the plugin off; ``fail``
    where a switch would not reach the workers; ``pass`` otherwise, saying how it travels.
    """
    if args.get("--distributed-executor-backend") != "ray":
        return "skip", "not a Ray deployment (--distributed-executor-backend ray)", ""
    try:
        section = args.json_flag("--additional-config").get("flashnext") or {}
    except FlashnextError:
        section = {}  # the other rules report a malformed --additional-config
    env = args.env
    switched = {k: v for k, v in env.items() if k.startswith("FLASHNEXT_") and v}
    if not switched and not section:
        return "skip", "the plugin is off (no FLASHNEXT_* and no --additional-config flashnext)", ""
    plugins = env.get("VLLM_PLUGINS")
    if plugins is not None and ENTRY_NAME not in [p.strip() for p in plugins.split(",")]:
        return (
            "fail",
            f"VLLM_PLUGINS={plugins!r} leaves {ENTRY_NAME} out: the driver does not load the "
            "plugin, so nothing carries the switches to the Ray workers or checks them",
            f"add {ENTRY_NAME} to VLLM_PLUGINS (or unset it)",
        )
    for name, var in PATH_SETTINGS.items():
        value: Any = env.get(var) or (section.get(name) if isinstance(section, dict) else None)
        if value and not str(value).startswith(("/", "~")):
            return (
                "fail",
                f"{var} / {name} = {value!r} is relative: a Ray worker runs in its own directory "
                "on its node, so it would not find it",
                "give an absolute path (or ~/...), the same on every node",
            )
    legacy = env.get("VLLM_USE_RAY_V2_EXECUTOR_BACKEND", "1").strip() == "0"
    how = [
        "the driver's plugin writes --additional-config flashnext switches into FLASHNEXT_*"
        if section
        else "FLASHNEXT_* from the driver's environment",
        "adds FLASHNEXT_ to VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY for the legacy executor"
        if legacy
        else "the V2 executor copies the driver's environment (a node's own FLASHNEXT_* wins)",
        "and refuses the boot, naming rank and node, when a rank did not apply them "
        "(flashnext missing, another version or sidecar)",
    ]
    return "pass", "; ".join(how), "install flashnext of one version on every node"

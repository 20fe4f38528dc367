"""flashnext's vLLM general plugin (entry point group ``vllm.general_plugins``).

Inert unless switched on (``FLASHNEXT_PLE_SIDECAR=DIR``, ``FLASHNEXT_MOE_GUARD=1``,
``FLASHNEXT_PLE_LOADER_FIX=1``, ``FLASHNEXT_DROP_INDEXER=1`` or the equivalent ``--additional-config`` keys; see
:mod:`.settings`): with nothing switched on, :func:`register` registers and patches nothing.
vLLM calls :func:`register` in every process it starts, so registering twice is harmless.

Parts (each a module with ``check() -> None``, which verifies what it would patch without
patching, and ``install() -> str``, idempotent, which patches and returns its one log line):

- ``ple_sidecar`` (:mod:`.ple_layer`): replaces vLLM's PLE table layers by class name with a layer
  that serves rows from a flashnext sidecar (the policy: :mod:`flashnext.serve.serving`).
- ``ple_loader_fix`` (``.loader``), ``moe_guard`` (``.b12x``) and ``drop_indexer`` (``.indexer``).

:func:`register` checks the vLLM version and every enabled part's preconditions first, then
installs, so a patch is never half-applied. Every line the plugin logs starts with
``flashnext plugin: `` and names the part and the versions (logger ``flashnext.integrations.vllm``,
written through vLLM's own log handlers).
"""

from __future__ import annotations

import importlib
import logging
import sys
import threading
from types import ModuleType
from typing import Any

from flashnext import __version__ as FLASHNEXT_VERSION
from flashnext.errors import PluginError
from flashnext.integrations.vllm import ranks
from flashnext.integrations.vllm.engram import command_line_engram, refuse_sidecar_with_disk_offload
from flashnext.integrations.vllm.settings import PluginSettings, command_line_config
from flashnext.integrations.vllm.versions import installed_vllm_version, require_checked

__all__ = ["LOG_PREFIX", "PluginSettings", "logger", "plugin_line", "register"]

LOG_PREFIX = "flashnext plugin: "
logger = logging.getLogger("flashnext.integrations.vllm")

#: Part name -> module implementing check() and install().
PART_MODULES = {
    "ple_sidecar": "flashnext.integrations.vllm.ple_layer",
    "ple_loader_fix": "flashnext.integrations.vllm.loader",
    "moe_guard": "flashnext.integrations.vllm.b12x",
    "drop_indexer": "flashnext.integrations.vllm.indexer",
}
_installed: set[str] = set()
_lock = threading.Lock()


def plugin_line(part: str, what: str) -> str:
    """One log line: ``flashnext plugin: <part>: <what> (vllm X, flashnext Y)``."""
    return f"{LOG_PREFIX}{part}: {what} (vllm {installed_vllm_version()}, flashnext {FLASHNEXT_VERSION})"


def register() -> None:
    """The entry point vLLM calls in every process (``vllm.general_plugins``).

    Reads the switches visible at start-up (:meth:`PluginSettings.at_startup`: the environment
    and the command line's ``--additional-config``). With no part switched on it registers and
    patches nothing (one debug line). Otherwise it refuses an unchecked vLLM version, then
    checks every part switched on and installs them all. The sidecar with vLLM's
    ``--engram-config`` disk_offload on the command line is refused (:mod:`.engram`).

    Raises:
        PluginError: a bad setting, the sidecar with disk_offload, an unchecked vLLM version
            with a part switched on, or a part whose preconditions do not hold (then nothing
            at all was applied).
    """
    _use_vllm_log_handlers()
    settings = PluginSettings.at_startup()
    if not settings.parts:
        logger.debug(
            plugin_line("off", "no part switched on (FLASHNEXT_* or --additional-config flashnext)"
                        "; nothing registered")
        )  # fmt: skip
        return
    # With disk_offload vLLM 0.34 builds a layer class the sidecar does not replace: refuse here,
    # where the command line is visible, rather than serve without the sidecar.
    refuse_sidecar_with_disk_offload(settings.ple_sidecar is not None, _disk_offload_on_argv())
    require_checked(installed_vllm_version(), settings.allow_untested_vllm)
    apply_parts(settings.parts, settings)
    _reach_every_rank(settings)


def _reach_every_rank(settings: PluginSettings) -> None:
    """Carry the switches to workers without our command line (Ray), and have the driver
    check every rank once its executor is up (:mod:`.ranks`)."""
    carried = ranks.carry_to_workers(command_line_config(sys.argv))
    if carried:
        logger.debug(plugin_line("ranks", f"set {', '.join(carried)} for the workers"))
    ranks.install_rank_check(settings.parts, lambda line: logger.info(plugin_line("ranks", line)))


def _disk_offload_on_argv() -> bool:
    """``disk_offload`` in this process's ``--engram-config`` (or its YAML ``--config``).

    A command line this reader cannot parse is left to vLLM, which reports it itself (or is not
    vLLM's: a worker launcher's own ``--config``), as ``command_line_config`` does.
    """
    try:
        return command_line_engram(sys.argv).get("disk_offload") is True
    except PluginError:
        return False


def apply_parts(parts: tuple[str, ...] | list[str], settings: PluginSettings) -> list[str]:
    """Check every part not yet installed, then install them all; returns the new log lines.

    Raises:
        PluginError: a part's module cannot be imported or its check fails (nothing installed).
    """
    with _lock:
        todo = [p for p in dict.fromkeys(parts) if p not in _installed]
        modules = [(part, _part_module(part)) for part in todo]
        for _, module in modules:
            module.check()
        lines = []
        for part, module in modules:
            line = module.install()
            _installed.add(part)
            ranks.PARTS.add(part)
            if not line.startswith(LOG_PREFIX):
                line = plugin_line(part, line)
            logger.info(line)
            lines.append(line)
        return lines


def settings_for_model(vllm_config: Any) -> PluginSettings:
    """Settings from the environment and ``vllm_config.additional_config``, read at model build.

    Parts switched on only in ``--additional-config`` are checked and installed here.

    Raises:
        PluginError: as :meth:`PluginSettings.resolve` and :func:`apply_parts`.
    """
    settings = PluginSettings.resolve(
        additional_config=getattr(vllm_config, "additional_config", None)
    )
    missing = [p for p in settings.parts if p not in _installed]
    if missing:
        require_checked(installed_vllm_version(), settings.allow_untested_vllm)
        apply_parts(missing, settings)
    return settings


def _part_module(part: str) -> ModuleType:
    name = PART_MODULES[part]
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise PluginError(
            f"{part}: cannot import {name} on vLLM {installed_vllm_version()} ({exc}); "
            "nothing was applied"
        ) from exc


class _ThroughVllm(logging.Handler):
    """Hands our records to vLLM's logger (its handlers, format and level) once vLLM has
    configured it; before that, INFO and above go to stderr as plain lines."""

    def __init__(self) -> None:
        super().__init__()
        self._early = logging.StreamHandler()

    def emit(self, record: logging.LogRecord) -> None:
        vllm_logger = logging.getLogger("vllm")
        if vllm_logger.handlers:
            if record.levelno >= vllm_logger.getEffectiveLevel():
                vllm_logger.handle(record)
        elif record.levelno >= logging.INFO:
            self._early.handle(record)


def _use_vllm_log_handlers() -> None:
    """Route our logger through vLLM's (vLLM configures only ``vllm.*``, possibly later)."""
    if not any(isinstance(h, _ThroughVllm) for h in logger.handlers):  # registering twice
        logger.addHandler(_ThroughVllm())
        logger.setLevel(logging.DEBUG)  # vLLM's level decides, at emit time
        logger.propagate = False

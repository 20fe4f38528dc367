"""What the user switched on: :class:`PluginSettings` from the environment and ``--additional-config``.

Two sources, read at different times:

- **Environment** (read by :func:`flashnext.integrations.vllm.register`, which vLLM calls in every
  process before any config exists, and again when each PLE layer is built):

  ===============================  =================================================================
  ``FLASHNEXT_PLE_SIDECAR=DIR``    serve the PLE tables from sidecars: ``DIR/layer_{L}`` per PLE
                                   layer (``L`` = the 0-based decoder index of the checkpoint's tensor
                                   names), or ``DIR`` itself when it is one sidecar
  ``FLASHNEXT_PLE_PLACEMENT=P``    ``auto`` (default), ``device``, ``pinned`` or ``staged``
  ``FLASHNEXT_PLE_DEVICE_CACHE=SIZE``  device cache of a profile's rows in front of a pinned or
                                   staged placement (``2GiB``, ``512MiB``; ``0`` = off, the
                                   default); ``FLASHNEXT_PLE_CACHE`` is its old spelling
  ``FLASHNEXT_PLE_PROFILE=PATH``   the profile that fills the device cache (``flashnext ple
                                   profile``); default: the sidecar's ``profile.safetensors``
  ``FLASHNEXT_MOE_GUARD=1``        sanitize B12x top-k ids, share MoE workspaces
  ``FLASHNEXT_PLE_LOADER_FIX=1``   load a table the checkpoint keeps (empty shard index, both
                                   prefixes, FP8 ``weight_scale``)
  ``FLASHNEXT_DROP_INDEXER=1``     skip QSA indexer tensors while the config has no indexer
                                   (``flashnext checkpoint override --dense-attention``)
  ``FLASHNEXT_ALLOW_UNTESTED_VLLM=1``  apply on a vLLM version the patches were not checked against
  ===============================  =================================================================

- **``--additional-config``** (``vllm serve ... --additional-config '{"flashnext": {...}}'``, keys
  ``ple_sidecar``, ``ple_placement``, ``ple_device_cache``, ``ple_profile``, ``moe_guard``,
  ``ple_loader_fix``, ``drop_indexer``, ``allow_untested_vllm``; ``ple_cache`` is the old
  spelling of ``ple_device_cache``):
  read when the model is built (the first PLE layer's construction, from vLLM's current config),
  because a general plugin is called before vLLM has parsed its config. Parts switched on only
  here are applied at that point, still checked before they are applied.

Nothing is registered in a process unless a part is switched on when vLLM calls
:func:`~flashnext.integrations.vllm.register`: in the environment, or in an
``--additional-config`` JSON on the command line that started the process (the form
``--additional-config '{"flashnext": {...}}'`` or ``--additional-config={...}``;
:meth:`PluginSettings.at_startup`). vLLM's ``mp`` workers see the same command line (fork
inherits it, spawn copies it); Ray workers do not, so the driver writes those switches into its
``FLASHNEXT_*`` variables for them (:mod:`.ranks`). A config given another way (``LLM(additional_config=...)``, a
YAML ``--config``, the dotted ``--additional-config.flashnext.x`` form) is read at model build
only when a part is already switched on; switch the sidecar on through the environment there.

A switch set in both sources must agree (:class:`~flashnext.errors.PluginError` otherwise). Bad
values are refused with the variable or key named.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flashnext.errors import PluginError
from flashnext.placement import PLACEMENT_SETTINGS, PlacementSetting
from flashnext.serve.cache_plan import parse_cache_size
from flashnext.words import say_renamed

#: The plugin's logger (:mod:`flashnext.integrations.vllm` routes it through vLLM's).
_log = logging.getLogger("flashnext.integrations.vllm")
#: The ``--additional-config`` section the plugin reads.
CONFIG_SECTION = "flashnext"
#: Setting name -> environment variable.
ENV_NAMES = {
    "ple_sidecar": "FLASHNEXT_PLE_SIDECAR",
    "ple_placement": "FLASHNEXT_PLE_PLACEMENT",
    "ple_device_cache": "FLASHNEXT_PLE_DEVICE_CACHE",
    "ple_profile": "FLASHNEXT_PLE_PROFILE",
    "moe_guard": "FLASHNEXT_MOE_GUARD",
    "ple_loader_fix": "FLASHNEXT_PLE_LOADER_FIX",
    "drop_indexer": "FLASHNEXT_DROP_INDEXER",
    "allow_untested_vllm": "FLASHNEXT_ALLOW_UNTESTED_VLLM",
}
#: Old spellings (environment and ``--additional-config`` key) -> the setting they still set,
#: each with one deprecation line per process.
OLD_ENV_NAMES = {"FLASHNEXT_PLE_CACHE": "ple_device_cache"}
OLD_KEYS = {"ple_cache": "ple_device_cache"}
_PATHS_AND_WORDS = ("ple_sidecar", "ple_placement", "ple_device_cache", "ple_profile")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


@dataclass(frozen=True)
class PluginSettings:
    """The plugin's switches; every part is off by default.

    Attributes:
        ple_sidecar: directory of the sidecar(s) serving the PLE tables, or None (off).
        ple_placement: where a GPU reads the rows (:mod:`flashnext.placement`; ``auto`` lets
            :func:`flashnext.serve.serving.choose_placement` decide).
        ple_device_cache: bytes per layer for the device cache (0 = off); used by the pinned and
            staged placements only.
        ple_profile: the profile file that fills it, or None (the sidecar's ``profile.safetensors``
            when it has one).
        moe_guard: the B12x guard (route sanitizer, shared workspaces).
        ple_loader_fix: the loader fix for checkpoints that keep the table.
        drop_indexer: skip QSA indexer tensors a dense-attention config has no place for.
        allow_untested_vllm: apply on a vLLM version not in :data:`.versions.CHECKED`.
    """

    ple_sidecar: Path | None = None
    ple_placement: PlacementSetting = "auto"
    ple_device_cache: int = 0
    ple_profile: Path | None = None
    moe_guard: bool = False
    ple_loader_fix: bool = False
    drop_indexer: bool = False
    allow_untested_vllm: bool = False

    @property
    def parts(self) -> tuple[str, ...]:
        """Names of the parts switched on: ``ple_sidecar``, ``ple_loader_fix``, ``moe_guard``,
        ``drop_indexer``."""
        on = {
            "ple_sidecar": self.ple_sidecar is not None,
            "ple_loader_fix": self.ple_loader_fix,
            "moe_guard": self.moe_guard,
            "drop_indexer": self.drop_indexer,
        }
        return tuple(name for name, enabled in on.items() if enabled)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> PluginSettings:
        """Settings from ``FLASHNEXT_*`` variables (``os.environ`` by default).

        Raises:
            PluginError: a value is not understood (the variable is named).
        """
        return cls.resolve(env=os.environ if env is None else env)

    @classmethod
    def at_startup(
        cls, env: Mapping[str, str] | None = None, argv: Sequence[str] | None = None
    ) -> PluginSettings:
        """Settings visible when vLLM calls the plugin: the environment and the command line's
        ``--additional-config`` JSON (``sys.argv`` by default).

        Raises:
            PluginError: as :meth:`resolve`.
        """
        line = command_line_config(sys.argv if argv is None else argv)
        return cls.resolve(env=os.environ if env is None else env, additional_config=line)

    @classmethod
    def resolve(
        cls,
        env: Mapping[str, str] | None = None,
        additional_config: Any = None,
    ) -> PluginSettings:
        """Settings from both sources; a switch given in both must agree.

        Args:
            env: environment variables (``os.environ`` when None).
            additional_config: vLLM's ``additional_config`` (a dict; its ``"flashnext"`` section
                is read, anything else in it is vLLM's or another plugin's).

        Raises:
            PluginError: a bad value, an unknown key in the ``flashnext`` section, the two
                sources disagreeing, a sidecar together with the loader fix, or a cache or
                profile without a sidecar (or with the device placement).
        """
        from_env = _parse_env(os.environ if env is None else env)
        from_config = _parse_section(additional_config)
        merged: dict[str, Any] = {}
        for name in ENV_NAMES:
            a, b = from_env.get(name), from_config.get(name)
            if a is not None and b is not None and a != b:
                raise PluginError(
                    f"{ENV_NAMES[name]}={a} and --additional-config "
                    f"{CONFIG_SECTION}.{name}={b} disagree; set it in one place"
                )
            value = a if a is not None else b
            if value is not None:
                merged[name] = value
        settings = cls(**merged)
        settings._check_combination()
        return settings

    def _check_combination(self) -> None:
        if self.ple_sidecar is not None and self.ple_loader_fix:
            raise PluginError(
                "ple_sidecar and ple_loader_fix are both on: a sidecar replaces the checkpoint's "
                "table, the loader fix loads it; switch one off"
            )
        if self.ple_sidecar is None and (self.ple_device_cache or self.ple_profile is not None):
            raise PluginError(
                "FLASHNEXT_PLE_DEVICE_CACHE / FLASHNEXT_PLE_PROFILE set without "
                "FLASHNEXT_PLE_SIDECAR: "
                "the device cache serves a sidecar's rows; set the sidecar or drop the cache"
            )
        if self.ple_device_cache and self.ple_placement == "device":
            raise PluginError(
                f"FLASHNEXT_PLE_DEVICE_CACHE={self.ple_device_cache} with "
                "FLASHNEXT_PLE_PLACEMENT=device: the "
                "device placement holds every row on the GPU already; the cache serves pinned "
                "and staged (set FLASHNEXT_PLE_DEVICE_CACHE=0 or another placement)"
            )


def command_line_config(argv: Sequence[str]) -> dict[str, Any] | None:
    """The ``--additional-config`` JSON object of a command line, or None.

    A value that is not a JSON object is left to vLLM, which reports it itself.
    """
    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        if name not in ("--additional-config", "--additional_config"):
            continue
        if not eq:
            value = argv[i + 1] if i + 1 < len(argv) else ""
        try:
            parsed = json.loads(value)
        except ValueError:
            return None
        return parsed if isinstance(parsed, dict) else None
    return None


def _parse_env(env: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, var in ENV_NAMES.items():
        raw = _env_value(env, name, var)
        if raw is None or (raw.strip() == "" and name in _PATHS_AND_WORDS):
            continue
        out[name] = _value(name, raw, var)
    return out


def _env_value(env: Mapping[str, str], name: str, var: str) -> str | None:
    """``env[var]``, or the old spelling of ``var`` (one deprecation line) when only it is set."""
    old = next((o for o, new in OLD_ENV_NAMES.items() if new == name and o in env), None)
    if old is None:
        return env.get(var)
    if var in env and env[var] != env[old]:
        raise PluginError(f"{var}={env[var]} and its old spelling {old}={env[old]} disagree")
    say_renamed(old, var, _log.warning)
    return env[old]


def _new_keys(section: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``section`` with old keys renamed (one deprecation line each)."""
    out = dict(section)
    for old, new in OLD_KEYS.items():
        if old not in out:
            continue
        if new in out and out[new] != out[old]:
            raise PluginError(f"{where}.{new} and its old spelling {where}.{old} disagree")
        say_renamed(f"{where}.{old}", f"{where}.{new}", _log.warning)
        out[new] = out.pop(old)
    return out


def _parse_section(additional_config: Any) -> dict[str, Any]:
    if not additional_config:
        return {}
    if not isinstance(additional_config, Mapping):
        return {}  # a SupportsHash object of another plugin: nothing of ours in it
    section = additional_config.get(CONFIG_SECTION)
    if section is None:
        return {}
    where = f"--additional-config {CONFIG_SECTION}"
    if not isinstance(section, Mapping):
        raise PluginError(
            f"{where} must be an object like {{'ple_sidecar': DIR}}, found {section!r}"
        )
    section = _new_keys(section, where)
    unknown = sorted(set(section) - set(ENV_NAMES))
    if unknown:
        raise PluginError(f"{where}: unknown key(s) {unknown}; known: {sorted(ENV_NAMES)}")
    return {
        name: _value(name, value, f"{where}.{name}")
        for name, value in section.items()
        if value is not None
    }


def _value(name: str, raw: Any, where: str) -> Any:
    """One setting's value from text (environment) or JSON (additional config)."""
    if name == "ple_sidecar":
        if not isinstance(raw, str | os.PathLike) or not str(raw).strip():
            raise PluginError(f"{where} must be a sidecar directory, found {raw!r}")
        return Path(raw).expanduser()
    if name == "ple_profile":
        if not isinstance(raw, str | os.PathLike) or not str(raw).strip():
            raise PluginError(f"{where} must be a profile file, found {raw!r}")
        return Path(raw).expanduser()
    if name == "ple_device_cache":
        return _cache_bytes(raw, where)
    if name == "ple_placement":
        if raw not in PLACEMENT_SETTINGS:
            raise PluginError(f"{where}={raw!r}: expected one of {', '.join(PLACEMENT_SETTINGS)}")
        return raw
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise PluginError(f"{where}={raw!r}: expected 1 or 0 (true/false)")


def _cache_bytes(raw: Any, where: str) -> int:
    """The cache size with its unit (``2GiB``); ``0`` (text or JSON number) turns it off."""
    return parse_cache_size(raw, where)

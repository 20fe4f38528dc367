"""vLLM's ``--engram-config`` as the plugin and ``flashnext check`` read it (no vLLM import).

vLLM 0.34 (vllm/config/engram.py) picks the Qwen4Exp PLE storage class from it:
``disk_offload`` -> ``Qwen4ExpPLEDiskOffloadEmbedding`` (rows read from the checkpoint files
each step, CUDA only), else ``cpu_offload`` (default true) -> ``Qwen4ExpPLEPinnedHostEmbedding``
(pinned table, UVA), else ``Qwen4ExpPLEDeviceEmbedding``. The sidecar replaces the pinned and
device classes only: with ``disk_offload`` vLLM builds a class the plugin does not replace, so
the sidecar would be dropped without a word. :func:`refuse_sidecar_with_disk_offload` refuses
that combination instead (the plugin at start-up, and ``flashnext check``, through this one
function).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from flashnext.errors import PluginError

#: 0.34's keys and their defaults (``dp_shared_memory`` None: vLLM resolves it from the DP size).
ENGRAM_KEYS: dict[str, bool | None] = {
    "cpu_offload": True,
    "disk_offload": False,
    "embedding_across_dp": False,
    "dp_shared_memory": None,
    "use_thp": False,
}
#: The keys vLLM 0.32 and 0.33 know (their wheels' vllm/config/engram.py): 0.34 added disk_offload.
KEYS_BEFORE_034 = ("cpu_offload", "embedding_across_dp", "dp_shared_memory", "use_thp")
FLAG = "--engram-config"
PlePath = Literal["disk_offload", "pinned", "device", "sidecar"]
PATH_TEXT: dict[str, str] = {
    "disk_offload": "vLLM's disk offload (Qwen4ExpPLEDiskOffloadEmbedding: no table, rows read "
    "from the checkpoint files each step)",
    "pinned": "vLLM's pinned host table with UVA (Qwen4ExpPLEPinnedHostEmbedding)",
    "device": "vLLM's table on the GPU (Qwen4ExpPLEDeviceEmbedding)",
    "sidecar": "the flashnext sidecar (FLASHNEXT_PLE_SIDECAR), in place of vLLM's table layer",
}


@dataclass(frozen=True)
class EngramSettings:
    """The ``--engram-config`` keys as given; absent keys hold vLLM's defaults.

    Attributes:
        given: the keys the user set (for messages).
        dp_shared_memory: None means vLLM decides (on when DP > 1 and cpu_offload).
    """

    cpu_offload: bool = True
    disk_offload: bool = False
    embedding_across_dp: bool = False
    dp_shared_memory: bool | None = None
    use_thp: bool = False
    given: tuple[str, ...] = ()

    @classmethod
    def from_mapping(cls, config: Mapping[str, Any] | None, where: str = FLAG) -> EngramSettings:
        """Settings from a parsed ``--engram-config`` object.

        Raises:
            PluginError: an unknown key or a value that is not a JSON boolean (the key named).
        """
        config = config or {}
        unknown = sorted(set(config) - set(ENGRAM_KEYS))
        if unknown:
            raise PluginError(
                f"{where}: unknown key(s) {unknown}; vLLM 0.34 knows {list(ENGRAM_KEYS)}"
            )
        for key, value in config.items():
            if not isinstance(value, bool) and not (key == "dp_shared_memory" and value is None):
                raise PluginError(f"{where}.{key}={value!r}: expected true or false")
        return cls(**dict(config), given=tuple(config))

    def contradiction(self, vllm_version: str | None, cuda: bool | None) -> str | None:
        """The one line vLLM (or its version) would refuse these keys with, or None.

        Args:
            vllm_version: the release that will serve (None: unknown, not judged).
            cuda: whether the serving platform is CUDA (None: unknown, not judged).
        """
        newer = [k for k in self.given if k not in KEYS_BEFORE_034]
        if vllm_version is not None and _release_tuple(vllm_version) < (0, 34) and newer:
            return (
                f"{FLAG} {', '.join(newer)}: vLLM {vllm_version} has no such key (0.34.0 added it)"
            )
        if self.disk_offload and cuda is False:
            return (
                f"{FLAG} disk_offload: vLLM reads the rows on CUDA only; this platform is not CUDA"
            )
        if self.dp_shared_memory and not self.cpu_offload:
            return f"{FLAG} dp_shared_memory requires cpu_offload=true (vLLM refuses it)"
        if self.use_thp and (not self.cpu_offload or self.dp_shared_memory):
            return f"{FLAG} use_thp requires cpu_offload=true and dp_shared_memory=false (vLLM refuses it)"
        return None

    def vllm_path(self) -> PlePath:
        """The storage vLLM builds (disk_offload wins over cpu_offload, as in 0.34)."""
        if self.disk_offload:
            return "disk_offload"
        return "pinned" if self.cpu_offload else "device"

    def shared_host_copy(self, data_parallel_size: int) -> bool:
        """Whether the DP replicas of a node share one pinned table (vLLM's default rule)."""
        if self.dp_shared_memory is not None:
            return self.dp_shared_memory and data_parallel_size > 1
        return self.cpu_offload and not self.use_thp and data_parallel_size > 1


def ple_path(engram: EngramSettings, sidecar_on: bool) -> PlePath:
    """Which PLE path serves: the sidecar when switched on (after the refusal), else vLLM's."""
    refuse_sidecar_with_disk_offload(sidecar_on, engram.disk_offload)
    return "sidecar" if sidecar_on else engram.vllm_path()


def refuse_sidecar_with_disk_offload(sidecar_on: bool, disk_offload: bool) -> None:
    """Refuse the flashnext sidecar together with vLLM's disk offload.

    With ``disk_offload`` vLLM builds ``Qwen4ExpPLEDiskOffloadEmbedding``, which the sidecar does
    not replace; serving on would silently drop the sidecar, and letting the sidecar win would
    silently drop a switch the user set, so neither yields.

    Raises:
        PluginError: both are on.
    """
    if sidecar_on and disk_offload:
        raise PluginError(
            "FLASHNEXT_PLE_SIDECAR (ple_sidecar) and --engram-config disk_offload=true are both "
            "on: vLLM would build its disk-offload layer and the sidecar would not serve; "
            "switch one off"
        )


def command_line_engram(argv: Sequence[str]) -> dict[str, Any]:
    """The ``--engram-config`` keys of a ``vllm serve`` command line, as vLLM 0.34 resolves them.

    Read as vllm/utils/argparse_utils.py does: a YAML ``--config FILE``'s ``engram-config``
    becomes a JSON ``--engram-config`` placed before the command line's; the dotted form
    (``--engram-config.disk_offload true`` or ``...=true``; the value is the next argument,
    read as JSON) is collected into one JSON object appended last; argparse keeps the last
    ``--engram-config``, whole (objects are replaced, not merged).

    Raises:
        PluginError: the JSON form is not a JSON object; the config file cannot be read.
    """
    args = list(argv)
    last: dict[str, Any] = _config_file_engram(args)
    dotted: dict[str, Any] = {}
    skip = False
    for i, arg in enumerate(args):
        if skip:
            skip = False
            continue
        name, eq, value = arg.partition("=")
        head, dot, key = name.partition(".")
        if head.replace("_", "-") != FLAG:
            continue
        if not eq:
            value = args[i + 1] if i + 1 < len(args) else ""
            skip = True
        if dot:
            dotted[key] = _json_value(value)
            continue
        try:
            parsed = json.loads(value)
        except ValueError:
            raise PluginError(f"{FLAG}: not valid JSON: {value!r}") from None
        if not isinstance(parsed, dict):
            raise PluginError(f"{FLAG}: expected a JSON object, found {value!r}")
        last = parsed
    return dotted or last


def _config_file_engram(args: list[str]) -> dict[str, Any]:
    """The engram keys of ``--config FILE`` (YAML), or none when no file is given."""
    path = None
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        if name == "--config":
            path = value if eq else (args[i + 1] if i + 1 < len(args) else None)
    if path is None:
        return {}
    try:
        import yaml  # vLLM's own dependency: it reads --config with it

        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh) or {}
    except Exception as exc:  # OSError, ImportError, yaml.YAMLError: one line either way
        raise PluginError(f"--config {path}: cannot read it for engram-config ({exc})") from None
    if not isinstance(data, dict):
        raise PluginError(f"--config {path}: expected a YAML mapping of vLLM arguments")
    section = data.get("engram-config", data.get("engram_config"))
    if isinstance(section, str):
        section = _json_value(section)
    if section is None:
        return {}
    if not isinstance(section, dict):
        raise PluginError(f"--config {path}: engram-config must be a mapping, found {section!r}")
    return dict(section)


def _json_value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text  # kept as text: from_mapping names it as not a boolean


def _release_tuple(version: str) -> tuple[int, ...]:
    numbers = []
    for part in version.split("+", 1)[0].split(".")[:2]:
        digits = "".join(ch for ch in part if ch.isdigit())
        numbers.append(int(digits or 0))
    return tuple(numbers)

"""The words for the tiers a PLE row can sit in, defined once, and the one line for an old spelling.

- *hot tier*: rows copied into host RAM in front of a memory-mapped table
  (``open_table(hot_tier=)``, ``flashnext ple preflight --hot-tier``).
- *device cache*: rows kept on the GPU in front of a pinned or staged table
  (``set_device_cache``, ``FLASHNEXT_PLE_DEVICE_CACHE``, ``flashnext plan --ple-device-cache``).
- *profile*: the file that ranks a table's rows by use (``flashnext ple profile``); it fills
  either of the above.
- *slice*: a sidecar holding some tensor-parallel ranks' rows (``flashnext ple slice``).

"Hot rows" once meant the first three and a row count (now ``PLETable.hot_tier_rows``); its old
spellings still work and say so once per process (:func:`say_renamed`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

_said: set[str] = set()


def renamed_line(old: str, new: str) -> str:
    """The one deprecation line for ``old``, now spelled ``new``."""
    return f"warning: {old} is deprecated; it is now spelled {new}"


def say_renamed(old: str, new: str, emit: Callable[[str], object] | None = None) -> None:
    """Say :func:`renamed_line` once per process for ``old`` (a later use is silent).

    ``emit`` takes the line (default: a warning on the ``flashnext`` logger; the plugin passes
    its own, which vLLM's log shows).
    """
    if old in _said:
        return
    _said.add(old)
    (emit or logging.getLogger("flashnext").warning)(renamed_line(old, new))

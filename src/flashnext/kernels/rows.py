"""The one interface the serving layer looks rows up through (no torch at import).

``GpuTable`` (device or pinned), ``StagedTable`` and ``GraphStagedTable`` all satisfy
:class:`Rows`; the plugin's row server (``SidecarRows``) calls nothing else on them.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Rows(Protocol):
    """A table's rows on a device, looked up into bf16 and served from a device cache."""

    def rows_into(self, ids: Any, out: Any) -> None:
        """Fill ``out`` (torch bf16 ``[N, heads * width]``, on the table's device) with the rows
        of ``ids`` (torch or numpy int ``[N, heads]``, global rows; rows outside the table's
        range give zeros), enqueued on the current stream."""
        ...

    def set_device_cache(self, profile: Any, cache_bytes: int) -> Any:
        """Serve the first rows of ``profile`` that fit in ``cache_bytes`` from a device
        cache (``_layout.rows_that_fit``); returns the cache's ``CacheInfo``."""
        ...

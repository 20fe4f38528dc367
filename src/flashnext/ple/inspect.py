"""What ``flashnext ple info`` reports about a sidecar: layout, checksums, fit in host RAM."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from flashnext.ple.preflight import DEFAULT_HEADROOM, HostMemory, host_memory
from flashnext.ple.sidecar import META_NAME, Sidecar


@dataclass
class SidecarInfo:
    """A sidecar's description; :meth:`to_dict` is the ``ple info --json`` payload."""

    path: str
    format: str
    num_rows: int
    width: int
    num_shards: int
    rows_per_shard: int
    bytes_per_row: int
    size_bytes: int
    has_meta: bool
    checksums: str  # "ok" | "N mismatched" | "not recorded (...)" | "not checked (--no-verify)"
    problems: list[str]
    rel_rmse: float | None
    resident_bytes: int
    host_available_bytes: int
    resident_fits: bool
    geometry: dict[str, Any] | None
    memory: HostMemory = field(repr=False)
    #: A slice's rows (``[[start, end], ...]``, ``flashnext ple slice``); None: the whole table.
    rows_present: list[list[int]] | None = None

    def to_dict(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        out.pop("memory")
        return out


def checksum_bytes(sidecar: Sidecar) -> int:
    """Bytes :func:`inspect_sidecar` hashes when verifying (shards with a recorded sha256)."""
    expected = sidecar.expected_checksums()
    return sum(s.path.stat().st_size for s in sidecar.shards if s.index in expected)


def inspect_sidecar(
    sidecar: Sidecar,
    *,
    verify: bool = True,
    progress: Callable[[int], None] | None = None,
    memory: HostMemory | None = None,
) -> SidecarInfo:
    """Describe ``sidecar``; with ``verify`` re-hash its shards against META.json.

    ``progress(nbytes)`` is called while hashing; ``memory`` defaults to this host's.
    """
    expected = sidecar.expected_checksums()
    problems = sidecar.verify_checksums(progress) if verify and expected else []
    if not expected:
        checks = "not recorded (no META.json checksums)"
    elif not verify:
        checks = "not checked (--no-verify)"
    else:
        checks = "ok" if not problems else f"{len(problems)} mismatched"
    memory = memory or host_memory()
    bytes_per_row = sidecar.codec.bytes_per_row(sidecar.width)
    present = sidecar.rows_present or ((0, sidecar.num_rows),)
    resident = sum(hi - lo for lo, hi in present) * bytes_per_row  # a slice: its rows only
    quant = sidecar.meta.get("quantization")
    rmse = quant.get("rel_rmse") if isinstance(quant, dict) else None
    geometry = sidecar.geometry
    return SidecarInfo(
        path=str(sidecar.path),
        format=sidecar.format,
        num_rows=sidecar.num_rows,
        width=sidecar.width,
        num_shards=len(sidecar.shards),
        rows_per_shard=sidecar.rows_per_shard,
        bytes_per_row=bytes_per_row,
        size_bytes=sidecar.nbytes,
        has_meta=(sidecar.path / META_NAME).exists(),
        checksums=checks,
        problems=problems,
        rel_rmse=rmse if isinstance(rmse, (int, float)) else None,
        resident_bytes=resident,
        host_available_bytes=memory.available,
        resident_fits=resident + DEFAULT_HEADROOM <= memory.available,
        geometry=geometry.to_dict() if geometry is not None else None,
        memory=memory,
        rows_present=[list(r) for r in sidecar.rows_present] if sidecar.rows_present else None,
    )

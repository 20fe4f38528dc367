"""What was deployed, captured by functions the caller passes in.

Validate talks only HTTP, to any server, local or remote; reading a launch from /proc or a
container runtime is :mod:`flashnext.deploy`'s job, a layer above. So ``flashnext validate``
and ``flashnext validate ab`` take a :class:`DeploymentProbe` built by the CLI from deploy's
functions, and their results carry what it returned; validate never imports deploy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from flashnext.errors import FlashnextError

Record = dict[str, Any]


@dataclass(frozen=True)
class Deployment:
    """One server's deployment record (or ``{"error": why}``) and a line naming it."""

    record: Record
    summary: str


@dataclass(frozen=True)
class DeploymentProbe:
    """The caller's functions: ``capture(url)`` returns a deployment record of the server at
    ``url`` (raising :class:`~flashnext.errors.FlashnextError` or :class:`OSError` when it
    cannot), ``describe(record)`` one line naming a record (or an ``{"error": ...}``), and
    ``diff(a, b)`` the changes from record ``a`` to ``b`` as JSON-ready dicts."""

    capture: Callable[[str], Record]
    describe: Callable[[Record], str]
    diff: Callable[[Record, Record], list[dict[str, Any]]]

    def take(self, url: str) -> Deployment:
        """The server's deployment; never raises: a failed capture is recorded with its reason."""
        try:
            record = self.capture(url)
        except (FlashnextError, OSError) as exc:
            record = {"error": str(exc)}
        return Deployment(record, self.describe(record))

    def skipped(self, why: str) -> Deployment:
        """A deployment not captured, for the stated reason."""
        record = {"error": why}
        return Deployment(record, self.describe(record))

    def compare(self, base: Deployment, cand: Deployment) -> list[dict[str, Any]] | None:
        """What differs from ``base`` to ``cand``; None unless both were captured."""
        if "error" in base.record or "error" in cand.record:
            return None
        return self.diff(base.record, cand.record)

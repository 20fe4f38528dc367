"""Typed results: one :class:`StageResult` per stage, one :class:`ValidationResult` per run.

A :class:`ValidationResult` holds data only (the probes' timelines are copied out when the run
ends), so it can be kept, compared or turned into a report after the run's connections closed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from flashnext.status import STATUSES, Status
from flashnext.validate.deployment import Deployment
from flashnext.validate.stages.config import Config

# A stage's status is one of STATUSES (flashnext.status): ``pass``, ``fail``, ``skip`` (with a
# reason), or ``interrupted`` for the stage running when SIGINT/SIGTERM arrived; never ``warn``.
__all__ = ["STATUSES", "Interruption", "ServerEnvironment", "StageResult", "ValidationResult"]


@dataclass
class StageResult:
    """One stage's verdict. ``key`` holds the headline numbers shown in the Markdown table."""

    name: str
    status: Status = "pass"
    reason: str = ""
    t_start: float = 0.0
    t_end: float = 0.0
    key: dict[str, Any] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    evidence: dict[str, Any] = field(default_factory=dict)

    def fail(self, message: str) -> None:
        """Mark the stage failed and record why (several failures may accumulate)."""
        self.status = "fail"
        self.failures.append(message)
        if not self.reason:
            self.reason = message

    def skip(self, reason: str) -> None:
        """Mark the stage skipped for a stated reason (not a failure)."""
        self.status, self.reason = "skip", reason

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict, with ``duration_s``."""
        d = asdict(self)
        d["duration_s"] = round(self.t_end - self.t_start, 3)
        return d


@dataclass(frozen=True)
class ServerEnvironment:
    """What the server said about itself: version, model list, cache config, the GPU seen."""

    server_version: str | None = None
    served_model: str | None = None
    max_model_len: int | None = None
    models: Any = None  # the /v1/models payload as served
    cache_config_info: dict[str, str] = field(default_factory=dict)
    gpu: dict[str, Any] = field(default_factory=dict)  # NVML device, or {"status": why not}


@dataclass(frozen=True)
class Interruption:
    """A run stopped by a signal: which one, the stage it stopped, when (s since the start)."""

    signal: str  # "SIGINT" | "SIGTERM"
    stage: str | None
    t: float


@dataclass
class ValidationResult:
    """Everything one run found; :func:`flashnext.validate.report.build_report` turns it into
    the report record.

    ``metrics`` and ``nvml`` are the probes' records (``MetricsProbe.to_dict()``,
    ``NvmlSampler.to_dict()``); ``container`` is {} without ``--container``; ``deployment`` is
    what the caller's :class:`~flashnext.validate.deployment.DeploymentProbe` captured after the
    stages, or None when none was given.
    """

    config: Config
    stages: list[StageResult]
    server: ServerEnvironment
    metrics: dict[str, Any]
    nvml: dict[str, Any]
    container: dict[str, Any] = field(default_factory=dict)
    duration_s: float = 0.0
    interrupted: Interruption | None = None
    deployment: Deployment | None = None

    @property
    def failed_stages(self) -> list[str]:
        """Names of the stages that failed."""
        return [s.name for s in self.stages if s.status == "fail"]

    @property
    def passed(self) -> bool:
        """No selected stage failed and the run was not interrupted."""
        return self.interrupted is None and not self.failed_stages

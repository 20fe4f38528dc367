"""What a validation run needs: the stage names in run order and the :class:`Config`."""

from __future__ import annotations

from dataclasses import dataclass

#: Every stage, in run order.
STAGES = ("ready", "short", "long", "multimodal", "concurrency", "prefix-cache", "sustained")


@dataclass
class Config:
    """Everything a validation run needs; the CLI builds it from flags.

    ``url`` is the server root (see :func:`flashnext.validate.client.server_root`).
    Concurrency defaults follow the deployment notes: 3 rounds of 16 concurrent requests,
    a ~300-word essay prompt, max_tokens 700, temperature 0.8, a 180 s client timeout.
    """

    url: str
    model: str | None = None
    api_key: str | None = None
    stages: tuple[str, ...] = STAGES
    ready_timeout_s: float = 600.0
    request_timeout_s: float = 180.0
    recovery_timeout_s: float = 180.0
    short_max_tokens: int = 32
    long_fraction: float = 0.9
    long_max_tokens: int = 32
    rounds: int = 3
    concurrency: int = 16
    max_tokens: int = 700
    temperature: float = 0.8
    prefix_fraction: float = 0.5
    prefix_requests: int = 4
    prefix_max_tokens: int = 16
    sustained_s: float = 60.0
    sustained_concurrency: int = 8
    sustained_max_tokens: int = 128
    sustained_max_requests: int = 10_000
    probe_interval_s: float = 0.5
    gpu_index: int = 0
    nvml: bool = True
    container: str | None = None

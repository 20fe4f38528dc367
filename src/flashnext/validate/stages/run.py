"""The state the stages of one run share: clients, probes, what the server said, progress."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.parse
from collections.abc import Callable
from typing import Any

from flashnext.records import redact_url
from flashnext.validate.client import Client, RequestResult
from flashnext.validate.probes import MetricsProbe, NvmlSampler
from flashnext.validate.stages.config import Config

#: ``progress(stage, message, fraction or None)``: how a run reports progress to its caller.
ProgressFn = Callable[[str, str, "float | None"], None]

#: Seconds between "still waiting" progress messages while a server does not answer.
WAIT_NOTICE_S = 5.0
#: A server answering 404 on both /health and /v1/models this long is no server root (vLLM's
#: HTTP server only listens once it can answer /health).
NOT_FOUND_GIVE_UP_S = 10.0
_BOTH_404 = "HTTP 404 on /health and on /v1/models"


class Run:
    """State shared by the stages of one run: client, probes, served model facts, progress.

    Lives only while the run does; its findings leave it as a
    :class:`~flashnext.validate.stages.result.ValidationResult`.
    """

    def __init__(self, cfg: Config, progress: ProgressFn | None = None) -> None:
        self.cfg = cfg
        self.t0 = time.monotonic()
        self.client = Client(cfg.url, cfg.api_key, cfg.request_timeout_s)
        # The probe has its own connection pool so that scrapes never wait behind the load.
        self.probe_client = Client(cfg.url, cfg.api_key, timeout_s=10.0, max_connections=4)
        self.metrics = MetricsProbe(self.probe_client, self.t0, cfg.probe_interval_s)
        self.nvml = NvmlSampler(self.t0, cfg.gpu_index, cfg.probe_interval_s)
        if not cfg.nvml:
            self.nvml.status = "not available: disabled with --no-nvml"
        self.model: str | None = cfg.model
        self.max_model_len: int | None = None
        self.models_payload: Any = None
        self.down_since: str | None = None  # stage during which the server was lost for good
        self.hung_since: str | None = None  # stage after which it counted as hung
        self.server_version: str | None = None  # read while the server is up, not at the end
        self.event_cursor = 0  # probe events up to here belong to stages already reported
        self._progress = progress

    def now(self) -> float:
        """Seconds since the run started (the time axis of every timeline)."""
        return round(time.monotonic() - self.t0, 3)

    def progress(self, stage: str, message: str, fraction: float | None = None) -> None:
        """Report progress to the caller (no-op when run as a library without a callback)."""
        if self._progress is not None:
            self._progress(stage, message, fraction)

    def _why_401(self) -> str:
        """What was sent, for an unauthorized answer: the URL's credentials, when it has them,
        go as HTTP Basic auth and take the place of --api-key's bearer token."""
        parts = urllib.parse.urlsplit(self.cfg.url)
        if parts.username is not None or parts.password is not None:
            if self.cfg.api_key:
                return (
                    "unauthorized: the URL's user:password@ was sent as HTTP Basic auth in place "
                    "of --api-key; drop it from --url"
                )
            return "unauthorized: the URL's user:password@ was sent as HTTP Basic auth and refused"
        key = "a wrong --api-key" if self.cfg.api_key else "no --api-key"
        return f"unauthorized: {key} was sent"

    async def discover(self) -> str | None:
        """Read ``/v1/models``: the served model and ``max_model_len``. Returns an error or None."""
        status, text, _ = await self.client.get("/v1/models", timeout_s=10.0)
        if status in (401, 403):
            return f"GET {redact_url(self.cfg.url)}/v1/models: HTTP {status} ({self._why_401()})"
        try:
            data = json.loads(text) if status == 200 else None
        except ValueError:
            data = None
        if not isinstance(data, dict) or not data.get("data"):
            seen = f"HTTP {status}" if status is not None else text
            return f"GET {self.cfg.url}/v1/models gave no model list ({seen})"
        await self.read_server_version()
        self.models_payload = data
        cards = data["data"]
        ids = [c.get("id") for c in cards]
        if self.model is None:
            self.model = ids[0]
        card = next((c for c in cards if c.get("id") == self.model), None)
        if card is None:
            return f"--served-model {self.model!r} is not served at {self.cfg.url}; served: {ids}"
        mml = card.get("max_model_len") or card.get("context_length")
        self.max_model_len = int(mml) if mml else None
        return None

    async def read_server_version(self) -> None:
        """Read ``/version`` once (vLLM has it; others may not: the version stays None)."""
        if self.server_version is None:
            version = await self.client.get_json("/version")
            if isinstance(version, dict) and version.get("version"):
                self.server_version = str(version["version"])

    async def chat(
        self, messages: list[dict[str, Any]], max_tokens: int, temperature: float = 0.0
    ) -> RequestResult:
        """One streamed chat completion against the served model."""
        if self.model is None:  # discover() runs before any stage; this is a programming error
            raise RuntimeError("no served model known: /v1/models was not read")
        return await self.client.chat(self.model, messages, max_tokens, temperature)

    async def wait_healthy(self, deadline_s: float, stage: str) -> tuple[bool, str]:
        """Poll ``/health`` until HTTP 200 or the deadline: (healthy, last observation).

        Says what it waits for, and how long it has waited every :data:`WAIT_NOTICE_S`, through
        the progress callback: a waiting run is never silent.
        """
        start = time.monotonic()
        end = start + deadline_s
        where = f"{redact_url(self.cfg.url)}/health"
        self.progress(stage, f"waiting up to {deadline_s:g} s for {where}", 0.0)
        notice = start + WAIT_NOTICE_S
        not_found_since: float | None = None
        while True:
            ok, last = await self._health_once()
            if ok:
                return True, last
            now = time.monotonic()
            if now >= end:
                return False, last
            # Waiting cannot help a URL that is not a server root or not TLS: say so now.
            if "WRONG_VERSION_NUMBER" in last or "CERTIFICATE_VERIFY_FAILED" in last:
                return False, f"{last}: TLS failed (is the server plain http? then use http://)"
            if last == _BOTH_404:
                not_found_since = not_found_since or now
                if now - not_found_since >= NOT_FOUND_GIVE_UP_S:
                    return False, (
                        f"{last} for {NOT_FOUND_GIVE_UP_S:g} s: not an OpenAI-compatible server "
                        "root; --url is the root (e.g. http://host:8000), not a route"
                    )
            else:
                not_found_since = None
            if now >= notice:
                waited = now - start
                self.progress(
                    stage,
                    f"waiting for {where}: {waited:.0f} of {deadline_s:g} s (last: {last})",
                    min(1.0, waited / deadline_s),
                )
                notice = now + WAIT_NOTICE_S
            await asyncio.sleep(min(0.5, max(0.0, end - now)))

    async def _health_once(self) -> tuple[bool, str]:
        status, text, _ = await self.client.get("/health", timeout_s=5.0)
        if status == 200:
            return True, "HTTP 200"
        if status == 404:
            # Not every OpenAI-compatible server has /health: a model list means ready.
            m_status, _, _ = await self.client.get("/v1/models", timeout_s=5.0)
            if m_status == 200:
                return True, "no /health (HTTP 404); /v1/models answered HTTP 200"
            if m_status == 404:
                return False, _BOTH_404
        return False, f"HTTP {status}" if status is not None else text

    def cache_config(self) -> dict[str, str]:
        """The labels of ``vllm:cache_config_info`` from the last scrape ({} if absent)."""
        series = (self.metrics.last.get("metrics") or {}).get("vllm:cache_config_info")
        return dict(series[0][0]) if series else {}

    async def close(self) -> None:
        """Stop the probes and close both connection pools."""
        await self.metrics.stop()
        self.nvml.stop()
        await self.client.aclose()
        await self.probe_client.aclose()

"""Probes that run through every stage: server metrics, restarts, GPU memory.

- :class:`MetricsProbe` scrapes ``/metrics`` (Prometheus text) at a fixed interval, keeps a
  timeline of the scheduler gauges and records *events*: the server becoming unreachable, coming
  back, and restarting (``process_start_time_seconds`` changed).
- :class:`NvmlSampler` samples GPU memory through NVML in a thread at a fixed interval for the
  whole run. Without a GPU, NVML or ``nvidia-ml-py`` it reports ``"not available: <reason>"``.
- :func:`container_restart_count` reads a docker/podman container's RestartCount.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import shutil
import subprocess
import threading
import time
from typing import Any

from flashnext.validate.client import Client

# Gauge/counter names per server family; the first present wins. vLLM first, then SGLang.
METRIC_NAMES: dict[str, tuple[str, ...]] = {
    "running": ("vllm:num_requests_running", "sglang:num_running_reqs"),
    "waiting": ("vllm:num_requests_waiting", "sglang:num_queue_reqs"),
    "kv_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage"),
    "preemptions": ("vllm:num_preemptions_total",),
    "prefix_hits": ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
    "prefix_queries": ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"),
    "start_time": ("process_start_time_seconds",),
}

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)")
#: A label name starts a word: searched from inside a long word it would rescan it per letter.
_LABEL = re.compile(r'(?<![a-zA-Z0-9_])([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Parse Prometheus text exposition into ``{name: [(labels, value), ...]}``.

    Comment lines and lines without a numeric value are skipped.
    """
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        name, _, labels, value = m.groups()
        try:
            v = float(value)  # also parses the exposition format's NaN, +Inf, -Inf
        except ValueError:
            continue
        out.setdefault(name, []).append((dict(_LABEL.findall(labels or "")), v))
    return out


def metric_value(metrics: dict[str, list[tuple[dict[str, str], float]]], key: str) -> float | None:
    """Sum over label sets of the first known name for ``key`` (see METRIC_NAMES); None if absent.

    Summing is right for the scheduler gauges and counters (one series per model/engine);
    for ``start_time`` the minimum is taken, the oldest process of the server.
    """
    for name in METRIC_NAMES[key]:
        series = metrics.get(name)
        if series:
            values = [v for _, v in series]
            return min(values) if key == "start_time" else sum(values)
    return None


class MetricsProbe:
    """Scrape ``/metrics`` every ``interval_s`` in the background; keep samples and events.

    Each sample: ``{"t": seconds since the run started, "ok": bool, <METRIC_NAMES keys>}``.
    Events: ``{"t", "kind": "unreachable" | "reachable" | "restart" | "slow", "detail"}``;
    ``slow`` (a scrape timed out) is evidence only. ``client`` should be the probe's own, so
    that its connections do not queue behind the load the stages generate.
    """

    def __init__(self, client: Client, t0: float, interval_s: float = 0.5) -> None:
        self.client = client
        self.t0 = t0
        self.interval_s = interval_s
        self.samples: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self.available: bool | None = None  # None until the first successful scrape
        self.reachable = True
        self.timing_out = False
        self.scrape_timeout_s = 10.0
        self.start_time: float | None = None
        self.last: dict[str, Any] = {}
        self._task: asyncio.Task[None] | None = None

    def _event(self, kind: str, detail: str) -> None:
        self.events.append(
            {"t": round(time.monotonic() - self.t0, 3), "kind": kind, "detail": detail}
        )

    async def scrape(self) -> dict[str, Any]:
        """Take one sample now (also used by stages for before/after counter deltas)."""
        status, text, err = await self.client.get("/metrics", timeout_s=self.scrape_timeout_s)
        t = round(time.monotonic() - self.t0, 3)
        if err == "timeout":
            # A busy server (or a starved client) answering late is evidence, not an outage:
            # only a refused or reset connection counts as unreachable.
            if not self.timing_out:
                self.timing_out = True
                self._event(
                    "slow",
                    f"GET {self.client.base_url}/metrics: no answer within "
                    f"{self.scrape_timeout_s:g} s ({text})",
                )
            sample = {"t": t, "ok": False, "error": "timeout"}
            self.samples.append(sample)
            return sample
        self.timing_out = False
        if status is None:
            if self.reachable:
                self.reachable = False
                self._event("unreachable", f"GET {self.client.base_url}/metrics: {text}")
            sample = {"t": t, "ok": False}
            self.samples.append(sample)
            return sample
        if not self.reachable:
            self.reachable = True
            self._event("reachable", f"{self.client.base_url} answers again (HTTP {status})")
        if status != 200:
            if self.available is None:
                self.available = False
            sample = {"t": t, "ok": False, "status": status}
            self.samples.append(sample)
            return sample
        self.available = True
        metrics = parse_prometheus(text)
        sample = {"t": t, "ok": True}
        for key in METRIC_NAMES:
            sample[key] = metric_value(metrics, key)
        st = metric_value(metrics, "start_time")
        if st is not None:
            if self.start_time is not None and abs(st - self.start_time) > 0.5:
                self._event(
                    "restart",
                    f"process_start_time_seconds changed {self.start_time:.3f} -> {st:.3f}",
                )
            self.start_time = st
        self.last = {"metrics": metrics, "sample": sample}
        self.samples.append(sample)
        return sample

    async def _loop(self) -> None:
        while True:
            started = time.monotonic()
            await self.scrape()
            await asyncio.sleep(max(0.0, self.interval_s - (time.monotonic() - started)))

    def start(self) -> None:
        """Start the background scraping task (call inside the running event loop)."""
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        """Stop the background task."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready record of the probe."""
        return {
            "interval_s": self.interval_s,
            "available": bool(self.available),
            "samples": self.samples,
            "events": self.events,
        }


class NvmlSampler:
    """Sample GPU memory through NVML every ``interval_s`` in a daemon thread.

    ``status`` is ``"ok"`` or ``"not available: <reason>"``; the sampler never raises for a
    missing GPU, so the validator runs the same on a client without one.
    """

    def __init__(self, t0: float, gpu_index: int = 0, interval_s: float = 0.5) -> None:
        self.t0 = t0
        self.gpu_index = gpu_index
        self.interval_s = interval_s
        self.samples: list[dict[str, Any]] = []
        self.device: dict[str, Any] = {}
        self.status = "not started"
        self._nvml: Any = None
        self._handle: Any = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _init(self) -> None:
        try:
            import pynvml
        except ImportError:
            self.status = (
                "not available: the 'nvidia-ml-py' package is not installed "
                "(pip install 'flashnext[nvml]')"
            )
            return
        try:
            pynvml.nvmlInit()
        except Exception as exc:  # NVMLError subclasses carry the library's reason text
            self.status = f"not available: {exc}"
            return
        try:
            count = pynvml.nvmlDeviceGetCount()
            if not 0 <= self.gpu_index < count:
                self.status = (
                    f"not available: --gpu-index {self.gpu_index} but NVML sees {count} GPU(s)"
                )
                pynvml.nvmlShutdown()
                return
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(self.gpu_index)
            name = pynvml.nvmlDeviceGetName(self._handle)
            driver = pynvml.nvmlSystemGetDriverVersion()
            total = pynvml.nvmlDeviceGetMemoryInfo(self._handle).total
        except Exception as exc:
            self.status = f"not available: {exc}"
            pynvml.nvmlShutdown()
            return
        self._nvml = pynvml
        self.device = {
            "index": self.gpu_index,
            "name": name.decode() if isinstance(name, bytes) else name,
            "driver": driver.decode() if isinstance(driver, bytes) else driver,
            "total_bytes": int(total),
        }
        self.status = "ok"

    def sample(self) -> dict[str, Any] | None:
        """Take one sample now; None when NVML is not available."""
        if self._nvml is None:
            return None
        nv = self._nvml
        t = round(time.monotonic() - self.t0, 3)
        try:
            mem = nv.nvmlDeviceGetMemoryInfo(self._handle)
        except Exception as exc:
            s = {"t": t, "error": str(exc)}
            self.samples.append(s)
            return s
        procs: dict[str, int] = {}
        try:
            for p in nv.nvmlDeviceGetComputeRunningProcesses(self._handle):
                # usedGpuMemory is None where the driver hides it (containers, no permission)
                if p.usedGpuMemory is not None:
                    procs[str(p.pid)] = int(p.usedGpuMemory)
        except Exception:
            pass  # per-process accounting is optional evidence
        s = {"t": t, "used": int(mem.used), "free": int(mem.free), "procs": procs}
        self.samples.append(s)
        return s

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)

    def start(self) -> None:
        """Initialise NVML and start sampling (or record why it is not available)."""
        self._init()
        if self._nvml is not None:
            self._thread = threading.Thread(target=self._run, name="nvml-sampler", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop sampling and shut NVML down."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._nvml is not None:
            # Shutting down twice or after a driver reset is harmless here.
            with contextlib.suppress(Exception):
                self._nvml.nvmlShutdown()

    def summary(self, t_start: float | None = None, t_end: float | None = None) -> dict[str, Any]:
        """Peak used, minimum free and per-process peaks, over a window or the whole run."""
        if self._nvml is None and not self.samples:
            return {"status": self.status}
        rows = [
            s
            for s in self.samples
            if "used" in s
            and (t_start is None or s["t"] >= t_start)
            and (t_end is None or s["t"] <= t_end)
        ]
        if not rows:
            return {"status": self.status, "samples": 0}
        peaks: dict[str, int] = {}
        for s in rows:
            for pid, used in s["procs"].items():
                peaks[pid] = max(peaks.get(pid, 0), used)
        return {
            "status": self.status,
            "samples": len(rows),
            "peak_used_bytes": max(s["used"] for s in rows),
            "min_free_bytes": min(s["free"] for s in rows),
            "per_process_peak_bytes": peaks,
        }

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready record: status, device, whole-run summary and the timeline."""
        return {
            "status": self.status,
            "interval_s": self.interval_s,
            "device": self.device,
            "summary": self.summary(),
            "samples": self.samples,
        }


def container_restart_count(name: str) -> tuple[int | None, str]:
    """RestartCount of a docker or podman container: (count or None, how/why).

    Tries ``docker`` then ``podman``; the second item names the runtime used or the failure.
    """
    errors = []
    for runtime in ("docker", "podman"):
        exe = shutil.which(runtime)
        if exe is None:
            errors.append(f"{runtime}: not installed")
            continue
        try:
            out = subprocess.run(
                [exe, "inspect", "--format", "{{.RestartCount}}", name],
                capture_output=True,
                text=True,
                timeout=15,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            errors.append(f"{runtime}: {exc}")
            continue
        if out.returncode == 0 and out.stdout.strip().isdigit():
            return int(out.stdout.strip()), runtime
        errors.append(f"{runtime}: {(out.stderr or out.stdout).strip()[:200]}")
    return None, "; ".join(errors)

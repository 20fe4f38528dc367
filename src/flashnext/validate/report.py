"""The validation report: ``report.json`` (versioned), ``report.md`` (one screen), ``report.png``.

``report.json`` schema, version 1 (every key always present; absent facts are ``null``):

- ``schema_version`` (int, 1), ``tool`` {``name``, ``version``}, ``created`` (UTC ISO 8601),
  ``command`` (argv list), ``python``, ``platform``, ``client_host``;
- ``target`` {``url``, ``model``, ``max_model_len``};
- ``config``: the :class:`~flashnext.validate.stages.Config` used, the API key redacted;
- ``passed`` (bool: no selected stage failed), ``failed_stages`` (names), ``duration_s``;
- ``stages``: list of {``name``, ``status`` (pass | fail | skipped), ``reason``, ``t_start``,
  ``t_end``, ``duration_s``, ``key`` (headline numbers), ``failures`` (messages),
  ``evidence`` (stage specific; always ``probes`` {``server``, ``gpu``} for stages that ran)};
- ``probes``: ``metrics`` {``interval_s``, ``available``, ``samples`` [{``t``, ``ok``,
  ``running``, ``waiting``, ``kv_usage``, ``preemptions``, ``prefix_hits``, ``prefix_queries``,
  ``start_time``}], ``events`` [{``t``, ``kind`` (unreachable | reachable | restart | slow),
  ``detail``}]}, ``nvml`` {``status``,
  ``interval_s``, ``device``, ``summary``, ``samples`` [{``t``, ``used``, ``free``, ``procs``}]},
  ``container`` {``name``, ``runtime``, ``restart_count_start``, ``restart_count_end``} or {};
- ``environment`` {``server_version``, ``served_model``, ``max_model_len``, ``models``,
  ``cache_config_info`` (label dict), ``gpu`` (NVML device or its status)}.

Times ``t`` are seconds since the run started. Every file is written to a temporary name
and renamed when complete.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import math
import platform
import socket
import sys
import urllib.parse
from pathlib import Path
from typing import Any

from flashnext import __version__
from flashnext._extras import require
from flashnext.atomic import atomic_write
from flashnext.errors import ValidationError

SCHEMA_VERSION = 1


REDACTED = "<redacted>"


def redact_url(url: str) -> str:
    """``url`` with any ``user:password@`` replaced by ``<redacted>@``."""
    parts = urllib.parse.urlsplit(url)
    if "@" not in parts.netloc:
        return url
    host = parts.netloc.rsplit("@", 1)[1]
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{REDACTED}@{host}"))


def redact_argv(argv: list[str], secrets: list[str]) -> list[str]:
    """The command line with the API key and URL credentials removed."""
    out = []
    hide_next = False
    for arg in argv:
        if hide_next:
            out.append(REDACTED)
            hide_next = False
            continue
        if arg == "--api-key":
            out.append(arg)
            hide_next = True
            continue
        if arg.startswith("--api-key="):
            out.append(f"--api-key={REDACTED}")
            continue
        if "://" in arg:
            arg = redact_url(arg)
        for secret in secrets:
            if secret:
                arg = arg.replace(secret, REDACTED)
        out.append(arg)
    return out


def _clean(value: Any, secrets: list[str]) -> Any:
    """Secrets out of every string (messages quote URLs); NaN and infinities, which a server
    may export, become None so that report.json is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, str):
        for secret in secrets:
            value = value.replace(secret, REDACTED)
        return value
    if isinstance(value, dict):
        return {k: _clean(v, secrets) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v, secrets) for v in value]
    return value


def build_report(raw: dict[str, Any], argv: list[str]) -> dict[str, Any]:
    """Assemble the JSON-ready report from :func:`~flashnext.validate.stages.run_validation`.

    Secrets never reach the report: the API key and any credentials in the URL are redacted,
    in the config and in the recorded command line alike.
    """
    run = raw["run"]
    cfg = dataclasses.asdict(run.cfg)
    if cfg.get("api_key"):
        cfg["api_key"] = REDACTED
    cfg["url"] = redact_url(cfg["url"])
    secrets = [run.cfg.api_key or ""]
    userinfo = urllib.parse.urlsplit(run.cfg.url).netloc.rpartition("@")[0]
    if userinfo:
        secrets += [userinfo, *userinfo.split(":")]
    # Longest first, so that "user:pw" goes before its parts; short fragments would mangle text.
    secrets = sorted({x for x in secrets if len(x) >= 3}, key=len, reverse=True)
    cfg["stages"] = list(cfg["stages"])
    stages = [s.to_dict() for s in raw["stages"]]
    failed = [s["name"] for s in stages if s["status"] == "fail"]
    return _clean(
        {
            "schema_version": SCHEMA_VERSION,
            "tool": {"name": "flashnext", "version": __version__},
            "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "command": redact_argv(list(argv), secrets),
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            "client_host": socket.gethostname(),
            "target": {
                "url": redact_url(run.cfg.url),
                "model": run.model,
                "max_model_len": run.max_model_len,
            },
            "config": cfg,
            "passed": not failed,
            "failed_stages": failed,
            "duration_s": raw["duration_s"],
            "stages": stages,
            "probes": {
                "metrics": run.metrics.to_dict(),
                "nvml": run.nvml.to_dict(),
                "container": raw["container"],
            },
            "environment": raw["environment"],
        },
        secrets,
    )


def _atomic_write(path: Path, data: bytes) -> None:
    with atomic_write(path) as fh:
        fh.write(data)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def key_text(key: dict[str, Any]) -> str:
    """A stage's key numbers as one line: ``name value, name value``."""
    return ", ".join(f"{k} {_fmt(v)}" for k, v in key.items() if v is not None)


def render_markdown(report: dict[str, Any]) -> str:
    """One screen: a stage table with the key numbers, then failures with evidence."""
    t = report["target"]
    env = report["environment"]
    verdict = "PASSED" if report["passed"] else f"FAILED ({', '.join(report['failed_stages'])})"
    lines = [
        f"# flashnext validate: {verdict}",
        "",
        f"{t['url']} · model `{t['model']}` · max_model_len {t['max_model_len']} · "
        f"server {env.get('server_version')} · GPU {_gpu_text(report)} · "
        f"{report['duration_s']:.0f} s · flashnext {report['tool']['version']}",
        "",
        "| stage | status | time (s) | key numbers |",
        "|---|---|---|---|",
    ]
    for s in report["stages"]:
        status = s["status"] if s["status"] != "skipped" else f"skipped: {s['reason']}"
        status = status.replace("|", "/")
        lines.append(
            f"| {s['name']} | {status} | {s['duration_s']:.1f} | "
            f"{key_text(s['key']).replace('|', '/')} |"
        )
    failures = [s for s in report["stages"] if s["status"] == "fail"]
    events = report["probes"]["metrics"]["events"]
    if failures:
        lines += ["", "## Failures", ""]
        for s in failures:
            lines.append(f"- **{s['name']}**")
            lines.extend(f"  - {m}" for m in s["failures"][:6])
            gauges = (s["evidence"].get("probes") or {}).get("server") or {}
            if gauges.get("preemptions"):
                lines.append(f"  - preemptions during the stage: {gauges['preemptions']:g}")
    if events:
        lines += ["", "## Server events", ""]
        lines.extend(f"- t={e['t']:.1f}s {e['kind']}: {e['detail']}" for e in events[:10])
    lines += ["", f"Command: `{' '.join(report['command'])}`", ""]
    return "\n".join(lines)


def _gpu_text(report: dict[str, Any]) -> str:
    gpu = report["environment"].get("gpu") or {}
    return gpu.get("name") or gpu.get("status") or "unknown"


def render_png(report: dict[str, Any]) -> bytes:
    """GPU memory, KV usage and running requests over time, stage spans shaded."""
    matplotlib = require("matplotlib", "validate", "the report.png plot")
    matplotlib.use("Agg")  # no display; must precede pyplot
    import io

    import matplotlib.pyplot as plt

    samples = [s for s in report["probes"]["metrics"]["samples"] if s.get("ok")]
    gpu = [s for s in report["probes"]["nvml"]["samples"] if "used" in s]
    fig, axes = plt.subplots(3, 1, figsize=(10, 7), sharex=True)
    ax_gpu, ax_kv, ax_run = axes
    if gpu:
        ax_gpu.plot([s["t"] for s in gpu], [s["used"] / 2**30 for s in gpu], label="used")
        ax_gpu.set_ylabel("GPU memory (GiB)")
    else:
        ax_gpu.text(
            0.5,
            0.5,
            f"GPU: {report['probes']['nvml']['status']}",
            ha="center",
            va="center",
            transform=ax_gpu.transAxes,
        )
        ax_gpu.set_ylabel("GPU memory")
    ts = [s["t"] for s in samples]
    ax_kv.plot(ts, [100 * (s.get("kv_usage") or 0) for s in samples], color="tab:orange")
    ax_kv.set_ylabel("KV cache used (%)")
    ax_run.plot(ts, [s.get("running") or 0 for s in samples], label="running")
    ax_run.plot(ts, [s.get("waiting") or 0 for s in samples], label="waiting")
    ax_run.set_ylabel("requests")
    ax_run.set_xlabel("seconds since start")
    ax_run.legend(loc="upper right")
    colours = {"pass": "tab:green", "fail": "tab:red", "skipped": "tab:gray"}
    for s in report["stages"]:
        if s["t_end"] <= s["t_start"]:
            continue
        for ax in axes:
            ax.axvspan(s["t_start"], s["t_end"], color=colours[s["status"]], alpha=0.12)
        ax_gpu.annotate(
            s["name"],
            (s["t_start"], 1.0),
            xycoords=("data", "axes fraction"),
            fontsize=7,
            va="bottom",
            rotation=20,
        )
    for e in report["probes"]["metrics"]["events"]:
        for ax in axes:
            colour = {"reachable": "green", "slow": "orange"}.get(e["kind"], "red")
            ax.axvline(e["t"], color=colour, lw=0.8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return buf.getvalue()


def write_report(report: dict[str, Any], out_dir: Path, png: bool = True) -> list[Path]:
    """Write report.json, report.md and (when ``png``) report.png into ``out_dir``."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValidationError(f"--out {out_dir}: cannot create the directory ({exc})") from exc
    paths = [out_dir / "report.json", out_dir / "report.md"]
    _atomic_write(
        paths[0], (json.dumps(report, indent=1, default=str, allow_nan=False) + "\n").encode()
    )
    _atomic_write(paths[1], render_markdown(report).encode())
    if png:
        paths.append(out_dir / "report.png")
        _atomic_write(paths[2], render_png(report))
    return paths


def load_report(path: Path) -> dict[str, Any]:
    """Read a report.json, checking that it is one and that its schema version is known."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValidationError(f"{path}: cannot read a report.json ({exc})") from exc
    if not isinstance(data, dict) or "schema_version" not in data:
        raise ValidationError(f"{path}: not a flashnext validate report (no schema_version)")
    if data["schema_version"] != SCHEMA_VERSION:
        raise ValidationError(
            f"{path}: schema_version {data['schema_version']!r}, expected {SCHEMA_VERSION}; "
            "re-run flashnext validate with this version to compare"
        )
    missing = [k for k in ("environment", "stages", "target", "passed") if k not in data]
    if missing:
        raise ValidationError(f"{path}: not a flashnext validate report (no {', '.join(missing)})")
    return data


def compare(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """What changed from report ``a`` to ``b``: environment, stage status and key numbers."""
    env_changes = {}
    for k in ("server_version", "served_model", "max_model_len"):
        if a["environment"].get(k) != b["environment"].get(k):
            env_changes[k] = [a["environment"].get(k), b["environment"].get(k)]
    if _gpu_text(a) != _gpu_text(b):
        env_changes["gpu"] = [_gpu_text(a), _gpu_text(b)]
    ca, cb = (
        a["environment"].get("cache_config_info") or {},
        b["environment"].get("cache_config_info") or {},
    )
    for k in sorted(set(ca) | set(cb)):
        if ca.get(k) != cb.get(k):
            env_changes[f"cache_config_info.{k}"] = [ca.get(k), cb.get(k)]
    sa = {s["name"]: s for s in a["stages"]}
    sb = {s["name"]: s for s in b["stages"]}
    stages = []
    for name in list(sa) + [n for n in sb if n not in sa]:
        x, y = sa.get(name), sb.get(name)
        row: dict[str, Any] = {
            "name": name,
            "status": [x["status"] if x else None, y["status"] if y else None],
            "changed": {},
        }
        kx, ky = (x or {}).get("key", {}), (y or {}).get("key", {})
        for k in list(kx) + [k for k in ky if k not in kx]:
            va, vb = kx.get(k), ky.get(k)
            if va == vb:
                continue
            entry: dict[str, Any] = {"a": va, "b": vb}
            if isinstance(va, (int, float)) and isinstance(vb, (int, float)) and va:
                entry["ratio"] = round(vb / va, 3)
            row["changed"][k] = entry
        stages.append(row)
    return {
        "a": {"created": a.get("created"), "url": a["target"]["url"], "passed": a["passed"]},
        "b": {"created": b.get("created"), "url": b["target"]["url"], "passed": b["passed"]},
        "environment": env_changes,
        "stages": stages,
    }


def render_compare(diff: dict[str, Any]) -> str:
    """Plain text of :func:`compare` for a terminal."""
    lines = [
        f"A: {diff['a']['url']} {diff['a']['created']} passed={diff['a']['passed']}",
        f"B: {diff['b']['url']} {diff['b']['created']} passed={diff['b']['passed']}",
    ]
    if diff["environment"]:
        lines.append("environment:")
        lines.extend(f"  {k}: {v[0]} -> {v[1]}" for k, v in diff["environment"].items())
    lines.append("stages:")
    for row in diff["stages"]:
        a, b = row["status"]
        status = f"{a}" if a == b else f"{a} -> {b}"
        lines.append(f"  {row['name']}: {status}")
        for k, e in row["changed"].items():
            ratio = f" (x{e['ratio']})" if "ratio" in e else ""
            lines.append(f"    {k}: {_fmt(e['a'])} -> {_fmt(e['b'])}{ratio}")
    return "\n".join(lines)

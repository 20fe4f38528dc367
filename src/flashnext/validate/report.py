"""The validation report: ``report.json`` (a record), ``report.md`` (one screen), ``report.png``.

``report.json`` is a :mod:`flashnext.records` record of kind ``flashnext.validate.report``,
``schema_version`` 2. Every key is always present; absent facts are ``null``:

- the envelope: ``schema_version`` (2), ``kind``, ``environment`` {``flashnext``, ``python``,
  ``platform``, ``command`` (argv, secrets redacted), ``created`` (UTC ISO 8601)};
- ``client_host``; ``target`` {``url``, ``model``, ``max_model_len``};
- ``config``: the :class:`~flashnext.validate.stages.Config` used, the API key redacted;
- ``passed`` (bool: not interrupted and no selected stage failed), ``failed_stages`` (names),
  ``interrupted`` ({``signal``, ``stage``, ``t``} or null), ``duration_s``;
- ``stages``: list of {``name``, ``status`` (pass | fail | skip | interrupted, from
  :mod:`flashnext.status`), ``reason``,
  ``t_start``, ``t_end``, ``duration_s``, ``key`` (headline numbers), ``failures`` (messages),
  ``evidence`` (stage specific; always ``probes`` {``server``, ``gpu``} for stages that ran)};
- ``probes``: ``metrics`` {``interval_s``, ``available``, ``samples`` [{``t``, ``ok``,
  ``running``, ``waiting``, ``kv_usage``, ``preemptions``, ``prefix_hits``, ``prefix_queries``,
  ``start_time``}], ``events`` [{``t``, ``kind`` (unreachable | reachable | restart | slow),
  ``detail``}]}, ``nvml`` {``status``, ``interval_s``, ``device``, ``summary``, ``samples``
  [{``t``, ``used``, ``free``, ``procs``}]}, ``container`` {``name``, ``runtime``,
  ``restart_count_start``, ``restart_count_end``} or {};
- ``server`` {``server_version``, ``served_model``, ``max_model_len``, ``models``,
  ``cache_config_info`` (label dict), ``gpu`` (NVML device or its status)};
- ``deployment``: the deployment record captured after the stages by the caller's function
  (``{"error": why}`` when it could not be, null when none was given) and
  ``deployment_summary``, the one line naming it.

Version 1 (before records) kept the host block at the top level (``tool``, ``created``,
``command``, ``python``, ``platform``) and the server's block under ``environment``;
:func:`load_report` reads it into the version 2 shape. Times ``t`` are seconds since the run
started. Older reports wrote ``skipped`` for ``skip``: :func:`load_report` reads it as ``skip``.
Every file is written to a temporary name and renamed when complete.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import urllib.parse
from pathlib import Path
from typing import Any

from flashnext._extras import require
from flashnext.errors import ValidationError
from flashnext.records import (
    REDACTED,
    VALIDATE_COMPARE,
    VALIDATE_REPORT,
    RecordError,
    check_fields,
    check_record,
    dumps,
    make_record,
    redact_text,
    redact_url,
    to_jsonable,
)
from flashnext.status import STYLES, read_status
from flashnext.user_files import JSON_LIMIT, UserFileError, read_user_text
from flashnext.validate.output import Render, Written, check_writable, write_files
from flashnext.validate.stages.result import ValidationResult

REPORT_KIND = VALIDATE_REPORT
SCHEMA_VERSION = 2
COMPARE_KIND = VALIDATE_COMPARE
REPORT_FILES = ("report.json", "report.md", "report.png")


def _secrets(cfg_url: str, api_key: str | None) -> list[str]:
    """The strings that must not reach a report: the API key and URL credentials."""
    secrets = [api_key or ""]
    userinfo = urllib.parse.urlsplit(cfg_url).netloc.rpartition("@")[0]
    if userinfo:
        secrets += [userinfo, *userinfo.split(":")]
    return [x for x in secrets if len(x) >= 3]  # short fragments would mangle text


def _redact_deep(value: Any, secrets: list[str]) -> Any:
    """``redact_text`` over every string of a JSON-ready value (messages quote URLs)."""
    if isinstance(value, str):
        return redact_text(value, secrets)
    if isinstance(value, dict):
        return {k: _redact_deep(v, secrets) for k, v in value.items()}
    if isinstance(value, list):
        return [_redact_deep(v, secrets) for v in value]
    return value


def build_report(result: ValidationResult, argv: list[str]) -> dict[str, Any]:
    """The report record of a run (see the module docstring for its fields).

    Secrets never reach the report: the API key and any credentials in the URL are redacted,
    in the config, every message and the recorded command line alike. NaN and infinities
    (which a server may export) become null.
    """
    cfg = result.config
    secrets = _secrets(cfg.url, cfg.api_key)
    config = dataclasses.asdict(cfg)
    if config.get("api_key"):
        config["api_key"] = REDACTED
    config["url"] = redact_url(cfg.url)
    payload = {
        "client_host": socket.gethostname(),
        "target": {
            "url": redact_url(cfg.url),
            "model": result.server.served_model,
            "max_model_len": result.server.max_model_len,
        },
        "config": config,
        "passed": result.passed,
        "failed_stages": result.failed_stages,
        "interrupted": result.interrupted,
        "duration_s": result.duration_s,
        "stages": [s.to_dict() for s in result.stages],
        "probes": {"metrics": result.metrics, "nvml": result.nvml, "container": result.container},
        "server": result.server,
        "deployment": result.deployment.record if result.deployment else None,
        "deployment_summary": result.deployment.summary if result.deployment else None,
    }
    body = _redact_deep(to_jsonable(payload), secrets)
    return make_record(REPORT_KIND, body, schema_version=SCHEMA_VERSION, argv=argv, secrets=secrets)


def check_out_dir(out_dir: Path, png: bool = True) -> None:
    """Make sure the report can be written into ``out_dir`` before a run starts (see
    :func:`flashnext.validate.output.check_out_dir`).

    Raises:
        ValidationError: one line naming ``--out`` and what is in the way.
    """
    check_writable(out_dir, REPORT_FILES if png else REPORT_FILES[:2])


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def key_text(key: dict[str, Any]) -> str:
    """A stage's key numbers as one line: ``name value, name value``."""
    return ", ".join(f"{k} {_fmt(v)}" for k, v in key.items() if v is not None)


def _verdict(report: dict[str, Any]) -> str:
    stop = report.get("interrupted")
    if stop:
        return f"INTERRUPTED ({stop['signal']} during {stop['stage'] or 'start-up'})"
    return "PASSED" if report["passed"] else f"FAILED ({', '.join(report['failed_stages'])})"


def render_markdown(report: dict[str, Any]) -> str:
    """One screen: a stage table with the key numbers, then failures with evidence."""
    t, server = report["target"], report["server"]
    lines = [
        f"# flashnext validate: {_verdict(report)}",
        "",
        f"{t['url']} · model `{t['model']}` · max_model_len {t['max_model_len']} · "
        f"server {server.get('server_version')} · GPU {_gpu_text(report)} · "
        f"{report['duration_s']:.0f} s · flashnext {report['environment']['flashnext']}",
        "",
        "| stage | status | time (s) | key numbers |",
        "|---|---|---|---|",
    ]
    for s in report["stages"]:
        status = s["status"] if s["status"] != "skip" else f"skip: {s['reason']}"
        status = status.replace("|", "/")
        lines.append(
            f"| {s['name']} | {status} | {s['duration_s']:.1f} | "
            f"{key_text(s['key']).replace('|', '/')} |"
        )
    stop = report.get("interrupted")
    if stop:
        lines += [
            "",
            f"Interrupted by {stop['signal']} at t={stop['t']:.1f}s: the stages before it are "
            "complete, the later ones were not run.",
        ]
    metrics = (report.get("probes") or {}).get("metrics") or {}
    if metrics and not metrics.get("available"):
        lines += [
            "",
            "No `/metrics` on this server: restarts (process_start_time_seconds), KV cache use "
            "and preemptions were not watched; a stage can pass here and still have restarted.",
        ]
    lines += _failure_lines(report)
    lines += _deployment_lines(report)
    lines += ["", f"Command: `{' '.join(report['environment']['command'])}`", ""]
    return "\n".join(lines)


def _deployment_lines(report: dict[str, Any]) -> list[str]:
    """The launch this report belongs to (the line the capture function gave for it)."""
    record, summary = report.get("deployment"), report.get("deployment_summary")
    if not record or not summary:
        return []
    label = "Deployment record" if "error" in record else "Deployment"
    lines = ["", f"{label}: {summary}"]
    restarts = [e for e in report["probes"]["metrics"]["events"] if e["kind"] == "restart"]
    if restarts and "error" not in record:  # captured after the run: the process since then
        lines.append(
            f"(captured after the run: it describes the process that started at "
            f"t={restarts[-1]['t']:.1f}s, not the one before that restart)"
        )
    return lines


def _failure_lines(report: dict[str, Any]) -> list[str]:
    lines: list[str] = []
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
    return lines


def _gpu_text(report: dict[str, Any]) -> str:
    gpu = report["server"].get("gpu") or {}
    return str(gpu.get("name") or gpu.get("status") or "unknown")


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
    for s in report["stages"]:
        if s["t_end"] <= s["t_start"]:
            continue
        colour = STYLES[read_status(s["status"])].plot
        for ax in axes:
            ax.axvspan(s["t_start"], s["t_end"], color=colour, alpha=0.12)
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


def write_report(report: dict[str, Any], out_dir: Path, png: bool = True) -> Written:
    """Write report.json, report.md and (when ``png``) report.png into ``out_dir``, each on its
    own: one that cannot be written is named in the result, the others are still written."""
    files: dict[str, Render] = {
        "report.json": lambda: dumps(report, indent=1),
        "report.md": lambda: render_markdown(report),
    }
    if png:
        files["report.png"] = lambda: render_png(report)
    return write_files(out_dir, files)


def _from_v1(data: dict[str, Any]) -> dict[str, Any]:
    """A version 1 report in the version 2 shape (host block in the envelope, ``server``)."""
    moved = ("schema_version", "tool", "created", "command", "python", "platform", "environment")
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": REPORT_KIND,
        "environment": {
            "flashnext": (data.get("tool") or {}).get("version"),
            "python": data.get("python"),
            "platform": data.get("platform"),
            "command": data.get("command") or [],
            "created": data.get("created"),
        },
        **{k: v for k, v in data.items() if k not in moved},
        "server": data["environment"],
        "interrupted": None,
        "read_from_schema_version": 1,
    }


def load_report(path: Path) -> dict[str, Any]:
    """Read a report.json (schema version 2, or 1 converted to the version 2 shape).

    Raises:
        ValidationError: unreadable, not JSON, not a validate report, or an unknown version.
    """
    try:
        data = json.loads(read_user_text(path, "a report.json", JSON_LIMIT))
    except UserFileError as exc:
        raise ValidationError(str(exc)) from None
    except (OSError, ValueError) as exc:
        why = getattr(exc, "strerror", None) or exc
        raise ValidationError(f"{path}: cannot read a report.json ({why})") from None
    if not isinstance(data, dict) or "schema_version" not in data:
        raise ValidationError(f"{path}: not a flashnext validate report (no schema_version)")
    version = data["schema_version"]
    if version not in (1, SCHEMA_VERSION):
        raise ValidationError(
            f"{path}: schema_version {version!r}, expected 1 or {SCHEMA_VERSION}; "
            "re-run flashnext validate with this version to compare"
        )
    if version == 1:
        missing = [k for k in ("environment", "stages", "target", "passed") if k not in data]
        if missing:
            raise ValidationError(
                f"{path}: not a flashnext validate report (no {', '.join(missing)})"
            )
        return _read_statuses(_checked_fields(_from_v1(data), path), path)
    try:
        check_record(data, kind=REPORT_KIND, source=str(path))
    except RecordError as exc:
        raise ValidationError(str(exc)) from None
    missing = [k for k in ("server", "stages", "target", "passed", "probes") if k not in data]
    if missing:
        raise ValidationError(f"{path}: not a flashnext validate report (no {', '.join(missing)})")
    return _read_statuses(_checked_fields(data, path), path)


def _read_statuses(report: dict[str, Any], path: Path) -> dict[str, Any]:
    """``report`` (its fields checked) with every stage's status in today's words (older
    reports wrote ``skipped``).

    Raises:
        ValidationError: a status is not a status word.
    """
    for i, stage in enumerate(report["stages"]):
        try:
            stage["status"] = read_status(stage.get("status"))
        except ValueError as exc:
            raise ValidationError(f"{path}: stages[{i}]: {exc}") from None
    return report


_OPT = type(None)
#: The fields :func:`compare` reads, and their types (checked when a report is read).
REPORT_FIELDS: dict[str, type | tuple[type, ...]] = {
    "environment": dict,
    "environment.created": (str, _OPT),
    "target": dict,
    "target.url": str,
    "passed": bool,
    "interrupted": (dict, _OPT),
    "interrupted.signal": (str, int, _OPT),
    "server": dict,
    "server.gpu": (dict, _OPT),
    "server.cache_config_info": (dict, _OPT),
    "stages": list,
    "stages[]": dict,
    "stages[].name": str,
    "stages[].status": str,
    "stages[].key": (dict, _OPT),
}


def _checked_fields(report: dict[str, Any], path: Path) -> dict[str, Any]:
    try:
        check_fields(report, REPORT_FIELDS, str(path))
    except RecordError as exc:
        raise ValidationError(str(exc)) from None
    return report


def _server_changes(a: dict[str, Any], b: dict[str, Any]) -> dict[str, list[Any]]:
    sa, sb = a["server"], b["server"]
    changes = {}
    for k in ("server_version", "served_model", "max_model_len"):
        if sa.get(k) != sb.get(k):
            changes[k] = [sa.get(k), sb.get(k)]
    if _gpu_text(a) != _gpu_text(b):
        changes["gpu"] = [_gpu_text(a), _gpu_text(b)]
    ca, cb = sa.get("cache_config_info") or {}, sb.get("cache_config_info") or {}
    for k in sorted(set(ca) | set(cb)):
        if ca.get(k) != cb.get(k):
            changes[f"cache_config_info.{k}"] = [ca.get(k), cb.get(k)]
    return changes


def _key_changes(kx: dict[str, Any], ky: dict[str, Any]) -> dict[str, dict[str, Any]]:
    changed: dict[str, dict[str, Any]] = {}
    for k in list(kx) + [k for k in ky if k not in kx]:
        va, vb = kx.get(k), ky.get(k)
        if va == vb:
            continue
        entry: dict[str, Any] = {"a": va, "b": vb}
        numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (va, vb))
        if numbers and va:
            entry["ratio"] = round(vb / va, 3)
        changed[k] = entry
    return changed


def _side(r: dict[str, Any]) -> dict[str, Any]:
    return {
        "created": r["environment"].get("created"),
        "url": r["target"]["url"],
        "passed": r["passed"],
        "interrupted": r.get("interrupted"),
    }


def compare(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """What changed from report ``a`` to ``b`` (both as :func:`load_report` returns them).

    Returns ``a`` and ``b`` ({created, url, passed, interrupted}), ``server`` (changed facts:
    {name: [a, b]}), ``stages`` ([{name, status [a, b], changed {key: {a, b, ratio?}}}]) and
    ``regressions`` (the stages that passed in A and fail in B); the payload of a
    ``flashnext.validate.compare`` record.
    """
    sa = {s["name"]: s for s in a["stages"]}
    sb = {s["name"]: s for s in b["stages"]}
    stages = []
    for name in list(sa) + [n for n in sb if n not in sa]:
        x, y = sa.get(name), sb.get(name)
        stages.append(
            {
                "name": name,
                "status": [x["status"] if x else None, y["status"] if y else None],
                "changed": _key_changes((x or {}).get("key", {}), (y or {}).get("key", {})),
            }
        )
    # a stage that passed in A and fails in B: what a CI gate on `compare` is for
    regressions = [r["name"] for r in stages if r["status"] == ["pass", "fail"]]
    return {"a": _side(a), "b": _side(b), "server": _server_changes(a, b), "stages": stages,
            "regressions": regressions}  # fmt: skip


def compare_record(diff: dict[str, Any], argv: list[str] | None = None) -> dict[str, Any]:
    """:func:`compare`'s result as a ``flashnext.validate.compare`` record (schema 1)."""
    return make_record(COMPARE_KIND, diff, schema_version=1, argv=argv)


def render_compare(diff: dict[str, Any]) -> str:
    """Plain text of :func:`compare` for a terminal."""
    lines = [
        f"{side.upper()}: {diff[side]['url']} {diff[side]['created']} "
        f"passed={diff[side]['passed']}"
        + (
            f" interrupted={diff[side]['interrupted']['signal']}"
            if diff[side]["interrupted"]
            else ""
        )
        for side in ("a", "b")
    ]
    if diff["server"]:
        lines.append("server:")
        lines.extend(f"  {k}: {v[0]} -> {v[1]}" for k, v in diff["server"].items())
    lines.append("stages:")
    for row in diff["stages"]:
        a, b = row["status"]
        status = f"{a}" if a == b else f"{a} -> {b}"
        lines.append(f"  {row['name']}: {status}")
        for k, e in row["changed"].items():
            ratio = f" (x{e['ratio']})" if "ratio" in e else ""
            lines.append(f"    {k}: {_fmt(e['a'])} -> {_fmt(e['b'])}{ratio}")
    if diff.get("regressions"):
        lines.append(f"REGRESSED (passed in A, failed in B): {', '.join(diff['regressions'])}")
    return "\n".join(lines)

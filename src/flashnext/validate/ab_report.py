"""Files of ``flashnext validate ab``: ``ab.json`` (the record), ``ab.md``, ``ab.png``, and
the baseline's answers (``baseline-answers.jsonl``, :mod:`flashnext.validate.ab_answers`).

``ab.md`` is one page: the verdict with each check, both servers, the pooled numbers, a table
of every prompt, both deployment records and what differs between them, and the worst prompts
with both continuations side by side. ``ab.png`` plots,
per generated position, the teacher-forced KL (mean and max over prompts) and the share of
prompts whose free-running outputs have gone apart by then. Every file is written to a
temporary name and renamed when complete.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from flashnext._extras import require
from flashnext.records import dumps
from flashnext.validate.ab_answers import ANSWERS_FILE
from flashnext.validate.output import Render, Written, write_files

WORST = 3
AB_FILES = ("ab.json", "ab.md", "ab.png")
_SNIPPET = 400


def _f(v: Any, spec: str = ".4g") -> str:
    return "-" if v is None else format(v, spec)


def worst_prompts(record: dict[str, Any], n: int = WORST) -> list[dict[str, Any]]:
    """The ``n`` compared prompts that differ most: highest mean teacher-forced KL, then
    lowest token agreement; identical prompts are never listed."""
    rows = [
        r for r in record["prompts"] if not r.get("error") and r["first_difference"] is not None
    ]
    rows.sort(
        key=lambda r: (
            -((r.get("tf") or {}).get("kl") or {}).get("mean", 0.0) or 0.0,
            r["token_agreement"],
        )
    )
    return rows[:n]


def _side_line(name: str, s: dict[str, Any]) -> str:
    tf = s["teacher_forcing"] or "not tried"
    note = f" ({s['teacher_forcing_note']})" if s.get("teacher_forcing_note") else ""
    down = f"; **down**: {s['down']}" if s.get("down") else ""
    asked = (
        f"recorded answers ({s['recorded']})" if s.get("recorded") else f"{s['requests']} requests"
    )
    return (
        f"- {name}: {s['url']} · model `{s['model']}` · vLLM {s['version']} · "
        f"max_model_len {s['max_model_len']} · teacher forcing: {tf}{note} · {asked}{down}"
    )


def render_markdown(record: dict[str, Any]) -> str:
    """The one-page report (see the module docstring)."""
    v, s, cost = record["verdict"], record["summary"], record["cost"]
    stop = record.get("interrupted")
    title = v["status"].upper() + (f" ({stop['signal']})" if stop else "")
    lines = [f"# flashnext validate ab: {title}", ""]
    lines += [f"- {r}" for r in v["reasons"]] + ([""] if v["reasons"] else [])
    lines += [
        _side_line("baseline", record["baseline"]),
        _side_line("candidate", record["candidate"]),
    ]
    lines += [
        "",
        f"{s['compared']} of {s['prompts']} prompts compared, {s['identical']} identical, "
        f"{s['differing']} differing (first difference: earliest {_f(s['first_difference']['min'])}, "
        f"median {_f(s['first_difference']['median'])}); token agreement "
        f"{_f(s['token_agreement'], '.3f')}; teacher-forced over {s['tf_positions']} positions: "
        f"top-1 agreement {_f(s['top1_agreement'], '.4f')}, KL mean {_f(s['kl']['mean'])} max "
        f"{_f(s['kl']['max'])} nats, TV mean {_f(s['tv']['mean'])} max {_f(s['tv']['max'])} "
        f"(lower bounds over the top-{record['config']['top_logprobs']} support). "
        f"{sum(cost['requests'].values())} requests in {cost['wall_s']:.1f} s.",
        "",
        "| check | limit | measured | ok |",
        "|---|---|---|---|",
    ]
    lines += [f"| {c['name']} | {c['limit']} | {_f(c['value'])} | {c['ok']} |" for c in v["checks"]]
    lines += [
        "",
        "| prompt | category | tokens | first diff | token agr. | top-1 | KL mean | KL max |",
    ]
    lines.append("|---|---|---|---|---|---|---|---|")
    for r in record["prompts"]:
        if r.get("error"):
            e = r["error"]
            lines.append(f"| {r['id']} | {r['category']} | error: {e['side']} {e['kind']} ||||||")
            continue
        tf = r.get("tf") or {}
        lines.append(
            f"| {r['id']} | {r['category']} | {r['prompt_tokens']} | {_f(r['first_difference'])} | "
            f"{r['token_agreement']:.3f} | {_f(tf.get('top1_agreement'), '.3f')} | "
            f"{_f((tf.get('kl') or {}).get('mean'))} | {_f((tf.get('kl') or {}).get('max'))} |"
        )
    lines += _deployment_section(record.get("deployments"))
    lines += _worst_section(record)
    errors = [r for r in record["prompts"] if r.get("error")]
    if errors or record.get("setup_error"):
        lines += ["", "## Failures", ""]
        if record.get("setup_error"):
            e = record["setup_error"]
            lines.append(f"- at start: {e['side']} {e['kind']}: {e['message']}")
        lines += [
            f"- {r['id']}: {r['error']['side']} {r['error']['kind']}: {r['error']['message']}"
            for r in errors
        ]
    lines += ["", f"Command: `{' '.join(record['environment']['command'])}`", ""]
    return "\n".join(lines)


def _deployment_section(deployments: dict[str, Any] | None) -> list[str]:
    """Both servers' deployment records in a line each, then what differs between them."""
    if not deployments:
        return []
    summaries = deployments.get("summaries") or {}
    lines = ["", "## Deployments", ""]
    lines += [
        f"- {side}: {summaries.get(side) or 'no summary recorded'}"
        for side in ("baseline", "candidate")
    ]
    diff = deployments.get("differences")
    if diff is None:
        return [*lines, "", "Differences: unknown (a record is missing)."]
    if not diff:
        return [*lines, "", "Differences: none (same launch, same checkpoint)."]
    lines += ["", "Differences (baseline -> candidate; *observed* = reported by the server):", ""]
    lines += [
        f"- {c['group']}: {c['name']}: {c['before']!r} -> {c['after']!r}"
        + ("" if c["variable"] else " (*observed*)")
        for c in diff
    ]
    return lines


def _quote(text: str) -> str:
    text = text if len(text) <= _SNIPPET else text[:_SNIPPET] + " …"
    return "<br>".join(text.replace("|", "\\|").splitlines()) or "(empty)"


def _worst_section(record: dict[str, Any]) -> list[str]:
    worst = worst_prompts(record)
    if not worst:
        return []
    lines = ["", "## Worst prompts", ""]
    for r in worst:
        lines += [
            f"### {r['id']} (first difference at token {r['first_difference']})",
            "",
            "| baseline | candidate |",
            "|---|---|",
            f"| {_quote(r['baseline']['text'])} | {_quote(r['candidate']['text'])} |",
            "",
        ]
    return lines


def per_position(record: dict[str, Any]) -> dict[str, list[float]]:
    """Per generated position: mean and max teacher-forced KL over prompts, and the share of
    compared prompts whose free-running outputs differ at or before it."""
    rows = [r for r in record["prompts"] if not r.get("error")]
    kls = [r["tf"]["per_position"]["kl"] for r in rows if r.get("tf")]
    width = max([len(k) for k in kls] + [record["config"]["max_tokens"]])
    mean, peak, diverged = [], [], []
    for i in range(width):
        here = [k[i] for k in kls if i < len(k)]
        mean.append(sum(here) / len(here) if here else float("nan"))
        peak.append(max(here) if here else float("nan"))
        gone = [r for r in rows if r["first_difference"] is not None and r["first_difference"] <= i]
        diverged.append(len(gone) / len(rows) if rows else float("nan"))
    return {"kl_mean": mean, "kl_max": peak, "diverged": diverged}


def render_png(record: dict[str, Any]) -> bytes:
    """The per-position divergence plot (needs matplotlib)."""
    matplotlib = require("matplotlib", "validate", "the ab.png plot")
    matplotlib.use("Agg")  # no display; must precede pyplot
    import matplotlib.pyplot as plt

    pp = per_position(record)
    xs = list(range(len(pp["kl_mean"])))
    fig, (ax_kl, ax_div) = plt.subplots(2, 1, figsize=(9, 5.5), sharex=True)
    ax_kl.plot(xs, pp["kl_mean"], label="mean over prompts")
    ax_kl.plot(xs, pp["kl_max"], label="max over prompts", alpha=0.7)
    ax_kl.set_ylabel("teacher-forced KL (nats)")
    ax_kl.legend(loc="upper right")
    ax_kl.set_title(f"flashnext validate ab: {record['verdict']['status']}")
    ax_div.step(xs, pp["diverged"], where="post", color="tab:red")
    ax_div.set_ylim(-0.02, 1.02)
    ax_div.set_ylabel("prompts diverged")
    ax_div.set_xlabel("generated token position")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return buf.getvalue()


def write_ab(
    record: dict[str, Any], out_dir: Path, png: bool = True, answers: str | None = None
) -> Written:
    """Write ab.json, ab.md, (when ``png`` and matplotlib is there) ab.png and (when given) the
    baseline's ``answers`` text into ``out_dir``, each on its own: one that cannot be written is
    named in the result, the others are still written; a plot left out for want of matplotlib
    is a note."""
    files: dict[str, Render] = {
        "ab.json": lambda: dumps(record),
        "ab.md": lambda: render_markdown(record),
    }
    if png:
        files["ab.png"] = lambda: render_png(record)
    if answers is not None:
        text = answers
        files[ANSWERS_FILE] = lambda: text
    return write_files(out_dir, files)

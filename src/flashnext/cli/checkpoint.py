"""``flashnext checkpoint``: verify a download, show its PLE tables, override config entries.

Thin: each command parses flags, calls :mod:`flashnext.checkpoint`, prints. Data to stdout
(``--json`` for scripts), progress and diagnostics to stderr.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from flashnext.cli._common import (
    OutputDir,
    cell,
    human_bytes,
    json_option,
    note,
    old_spelling,
    print_record,
    progress,
    say,
    show,
)
from flashnext.cli._destination import check_output
from flashnext.errors import CheckpointError
from flashnext.records import CHECKPOINT_OVERRIDE, CHECKPOINT_PLE, CHECKPOINT_VERIFY

if TYPE_CHECKING:
    from rich.text import Text

    from flashnext.checkpoint.snapshot import FileCheck, VerifyReport


@click.group("checkpoint")
def checkpoint() -> None:
    """Verify a downloaded checkpoint, find its PLE tables, override config entries."""


@checkpoint.command("verify")
@click.argument("directory", type=click.Path(path_type=Path))
@click.option(
    "--hash", "do_hash", is_flag=True, help="Also sha256 every file with a recorded hash."
)
@old_spelling("--workers", "--threads", "workers", type=click.IntRange(min=1, max=256))
@click.option(
    "--threads",
    "workers",
    type=click.IntRange(min=1, max=256),
    default=None,
    help="Hashing threads (default: CPUs, max 8).",
)
@json_option(CHECKPOINT_VERIFY)
def verify(directory: Path, do_hash: bool, workers: int | None, as_json: bool) -> None:
    """Check that the snapshot in DIRECTORY is complete; exit 0 only if it is.

    Checks: every file the index names exists; no *.incomplete leftovers; every safetensors
    header parses and matches the file size; the index and the headers agree. With --hash,
    each file's sha256 (git-sha1 for small files) is compared with the value recorded by
    `hf download --local-dir` (.cache/huggingface/download/*.metadata) or the cache blob name.
    """
    from flashnext.checkpoint.snapshot import RECORD_KIND, SCHEMA_VERSION, verify_snapshot

    if do_hash:
        with progress(disable=as_json) as bar:
            task = bar.add_task("sha256", total=None, bytes_per_unit=1, unit="B")

            def on_bytes(done: int, total: int) -> None:
                bar.update(task, completed=done, total=total)

            report = verify_snapshot(directory, hash=True, workers=workers, progress=on_bytes)
    else:
        report = verify_snapshot(directory)

    if as_json:
        print_record(RECORD_KIND, report.to_dict(), SCHEMA_VERSION)
    else:
        _print_report(report)
    if not report.ok:
        first = report.errors[0]
        more = f" (and {len(report.errors) - 1} more)" if len(report.errors) > 1 else ""
        raise CheckpointError(f"{report.root}: incomplete: {first.file}: {first.message}{more}")


def _hash_cell(f: FileCheck) -> Text:
    if f.hash_ok is True:
        return cell(f"ok {f.algorithm}", "green")
    if f.hash_ok is False:
        return cell("MISMATCH", "red")
    return cell(f"recorded ({f.algorithm})" if f.expected else "-")


def _print_report(report: VerifyReport) -> None:
    from rich.table import Table

    table = Table(
        title=cell(f"{report.root} ({report.layout}, weights: {report.weights})"),
        title_justify="left",
    )
    for name, justify in (
        ("file", "left"),
        ("size", "right"),
        ("tensors", "right"),
        ("hash", "left"),
    ):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for f in report.files:
        tensors = "" if f.tensors is None else str(f.tensors)
        table.add_row(cell(f.file), human_bytes(f.size), tensors, _hash_cell(f))
    if len(report.files) <= 40:
        show(table)
    for finding in report.findings:
        colour = "red" if finding.severity == "error" else "yellow"
        say(f"{finding.severity} {finding.file}: {finding.message}", colour)
    total = human_bytes(sum(f.size for f in report.files))
    if report.ok:
        hashed = sum(1 for f in report.files if f.hash_ok)
        how = (
            f", {hashed} hashes match" if report.hashed else " (headers and sizes; --hash to hash)"
        )
        say(f"complete: {len(report.files)} files, {total}{how} ({report.seconds:.1f} s)", "green")
    else:
        bad_files = len({e.file for e in report.errors})
        say(
            f"INCOMPLETE: {len(report.errors)} problem(s) in {bad_files} file(s); "
            f"{len(report.files)} files, {total} on disk",
            "red",
        )


@checkpoint.command("ple")
@click.argument("directory", type=click.Path(path_type=Path))
@click.option(
    "--tp",
    type=click.IntRange(min=1, max=4096),
    default=None,
    help="Also show each rank's row copies for this TP size.",
)
@json_option(CHECKPOINT_PLE)
def checkpoint_ple(directory: Path, tp: int | None, as_json: bool) -> None:
    """Find each PLE layer's n-gram table in DIRECTORY: layout, prefix, format, shapes checked."""
    from flashnext.checkpoint.ple_report import (
        RECORD_KIND,
        SCHEMA_VERSION,
        report_ple_tables,
        row_copy_text,
    )

    reports = report_ple_tables(directory, tp)
    if as_json:
        tables = [{**r.to_dict(), **_slice_command(r.table.layer_index, tp)} for r in reports]
        print_record(RECORD_KIND, {"tables": tables}, SCHEMA_VERSION)
        return
    for r in reports:
        t = r.table
        say(
            f"layer {t.layer_id} (index {t.layer_index}, ordinal {t.ordinal}): {t.format}, "
            f"layout {t.layout}, {t.prefix} prefix {t.name_prefix}, {t.num_rows:,} rows x "
            f"{t.width}, {len(t.weights)} tensor(s) in {len({p.file for p in t.parts})} file(s), "
            f"{human_bytes(t.nbytes)}"
            + "".join(f", {name} {value:g}" for name, value in t.scalars.items())
            + (f", buffers {sorted(t.buffers)}" if t.buffers else "")
        )
        for text in r.notes:
            say(f"  note: {text}")
        for rank, copies in enumerate(r.ranks):
            say(f"  rank {rank}: " + "; ".join(row_copy_text(c) for c in copies))
        for command in _slice_command(t.layer_index, tp).values():
            say(f"  a node's ranks only: {command}")


def _slice_command(layer_index: int, tp: int | None) -> dict[str, str]:
    """``flashnext ple slice`` for this layer's quantized sidecar (empty without ``--tp``)."""
    if tp is None:
        return {}
    layer = f"layer_{layer_index}"
    return {
        "slice_command": f"flashnext ple slice SIDECAR/{layer} DST/{layer} --tp {tp} "
        "--ranks R[,R...]"
    }


@checkpoint.command("override")
@click.argument("directory", type=click.Path(path_type=Path))
@click.option(
    "--layer-type",
    "layer_types",
    multiple=True,
    help="OLD=NEW: every layer_types entry equal to OLD becomes NEW (repeatable).",
)
@click.option(
    "--dense-attention",
    "dense",
    is_flag=True,
    help="Make every QSA layer dense attention: null the indexer_* fields (what vLLM reads).",
)
@click.option("--out", type=OutputDir(), default=None, help="Write a servable copy here.")
@click.option("--hf-overrides", "hf", is_flag=True, help="Print JSON for vLLM --hf-overrides.")
@click.option("--reason", default=None, help="Why the override is needed (recorded).")
@json_option(CHECKPOINT_OVERRIDE)
def override(
    directory: Path,
    layer_types: tuple[str, ...],
    dense: bool,
    out: Path | None,
    hf: bool,
    reason: str | None,
    as_json: bool,
) -> None:
    """Change config entries of DIRECTORY's config.json, recording why.

    --layer-type renames layer_types entries; --dense-attention turns QSA layers into dense
    attention (vLLM builds QSA exactly when indexer_n_heads is set). Never edits config.json
    in place: --out DIR2 writes a patched copy (other files are symlinked), --hf-overrides
    prints the JSON for vLLM. The checkpoint's indexer tensors stay where they are: serve with
    FLASHNEXT_DROP_INDEXER=1 so the flashnext plugin skips them. The record says the change
    lets the runtime load but is not shown to be computationally equivalent. --json prints the
    record (with --hf-overrides: the record, whose ``hf_overrides`` field is the JSON for vLLM).
    """
    from flashnext.checkpoint.override import CAVEAT, override_holds, plan_override
    from flashnext.records import dumps

    if (out is None) == (not hf):
        raise click.UsageError("choose exactly one of --out DIR2 and --hf-overrides")
    if not layer_types and not dense:
        raise click.UsageError("give --layer-type OLD=NEW, --dense-attention, or both")
    check_output(out, [directory], hint="--out", holds=override_holds)
    plan = plan_override(directory, layer_types, reason, dense=dense)
    hf_json = plan.hf_overrides if hf else None
    if out is not None:
        plan.write(out)
    # stdout carries data when there is some (the record, or the JSON for vLLM); the list of
    # changes is then a diagnostic on stderr, otherwise it is the summary on stdout.
    tell = note if as_json or hf else say
    for c in plan.changes:
        tell(f"changed {c.field}: {c.old!r} -> {c.new!r}")
    if out is not None:
        tell(f"wrote {out / 'config.json'} (+ FLASHNEXT_OVERRIDES.json; other files symlinked)")
    for line in plan.warnings:
        note(f"warning: {line}")
    tell(f"{len(plan.changes)} entries changed. {CAVEAT}")
    if as_json:
        extra = {"hf_overrides": hf_json} if hf else {"out": str(out)}
        sys.stdout.write(dumps({**plan.record, **extra}))
    elif hf:
        click.echo(json.dumps(hf_json))


def _attach_plan() -> None:
    from flashnext.cli.checkpoint_plan import checkpoint_plan

    checkpoint.add_command(checkpoint_plan)


_attach_plan()

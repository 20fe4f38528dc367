"""``flashnext checkpoint``: verify a download, show its PLE tables, override config entries.

Thin: each command parses flags, calls :mod:`flashnext.checkpoint`, prints. Data to stdout
(``--json`` for scripts), progress and diagnostics to stderr.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from flashnext.cli._common import err_console, human_bytes, out_console, print_json, progress


@click.group("checkpoint")
def checkpoint() -> None:
    """Verify a downloaded checkpoint, find its PLE tables, override config entries."""


@checkpoint.command("verify")
@click.argument("directory", type=click.Path(path_type=Path))
@click.option(
    "--hash", "do_hash", is_flag=True, help="Also sha256 every file with a recorded hash."
)
@click.option("--workers", type=int, default=None, help="Hashing threads (default: CPUs, max 8).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON on stdout.")
def verify(directory: Path, do_hash: bool, workers: int | None, as_json: bool) -> None:
    """Check that the snapshot in DIRECTORY is complete; exit 0 only if it is.

    Checks: every file the index names exists; no *.incomplete leftovers; every safetensors
    header parses and matches the file size; the index and the headers agree. With --hash,
    each file's sha256 (git-sha1 for small files) is compared with the value recorded by
    `hf download --local-dir` (.cache/huggingface/download/*.metadata) or the cache blob name.
    """
    from flashnext.checkpoint.snapshot import verify_snapshot

    if do_hash:
        with progress(disable=as_json) as bar:
            task = bar.add_task("sha256", total=None, bytes_per_unit=1, unit="B")

            def on_bytes(done: int, total: int) -> None:
                bar.update(task, completed=done, total=total)

            report = verify_snapshot(directory, hash=True, workers=workers, progress=on_bytes)
    else:
        report = verify_snapshot(directory)

    if as_json:
        print_json(report.to_dict())
    else:
        _print_report(report)
    if not report.ok:
        sys.exit(1)


def _print_report(report) -> None:
    from rich.table import Table

    out = out_console
    table = Table(
        title=f"{report.root} ({report.layout}, weights: {report.weights})", title_justify="left"
    )
    table.add_column("file")
    table.add_column("size", justify="right")
    table.add_column("tensors", justify="right")
    table.add_column("hash")
    for f in report.files:
        if f.hash_ok is True:
            h = f"[green]ok[/] {f.algorithm}"
        elif f.hash_ok is False:
            h = "[red]MISMATCH[/]"
        elif f.expected:
            h = f"recorded ({f.algorithm})"
        else:
            h = "-"
        table.add_row(f.file, human_bytes(f.size), "" if f.tensors is None else str(f.tensors), h)
    if len(report.files) <= 40:
        out.print(table)
    for finding in report.findings:
        color = "red" if finding.severity == "error" else "yellow"
        out.print(
            f"[{color}]{finding.severity}[/] {finding.file}: {finding.message}", highlight=False
        )
    total = sum(f.size for f in report.files)
    hashed = sum(1 for f in report.files if f.hash_ok)
    if report.ok:
        out.print(
            f"[green]complete[/]: {len(report.files)} files, {human_bytes(total)}"
            + (
                f", {hashed} hashes match"
                if report.hashed
                else " (headers and sizes; --hash to hash)"
            )
            + f" ({report.seconds:.1f} s)"
        )
    else:
        out.print(
            f"[red]INCOMPLETE[/]: {len(report.errors)} problem(s) in {len({e.file for e in report.errors})} "
            f"file(s); {len(report.files)} files, {human_bytes(total)} on disk"
        )


@checkpoint.command("ple")
@click.argument("directory", type=click.Path(path_type=Path))
@click.option(
    "--tp",
    type=click.IntRange(min=1),
    default=None,
    help="Also show each rank's row copies for this TP size.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the tables as JSON on stdout.")
def ple(directory: Path, tp: int | None, as_json: bool) -> None:
    """Find each PLE layer's n-gram table in DIRECTORY: layout, prefix, format, shapes checked."""
    from dataclasses import asdict

    from flashnext.checkpoint.ple_tensors import find_ple_tables

    tables = find_ple_tables(directory)
    if as_json:
        doc = []
        for t in tables:
            d = t.to_dict()
            if tp:
                d["tp"] = {
                    "size": tp,
                    "ranks": [[asdict(c) for c in t.tp_row_map(tp, r)] for r in range(tp)],
                }
            doc.append(d)
        print_json({"schema_version": 1, "tables": doc})
        return
    out = out_console
    for t in tables:
        out.print(
            f"layer {t.layer_id} (index {t.layer_index}, ordinal {t.ordinal}): {t.format}, "
            f"layout {t.layout}, {t.prefix} prefix {t.name_prefix}, {t.num_rows:,} rows x "
            f"{t.width}, {len(t.weights)} tensor(s) in {len({p.file for p in t.parts})} file(s), "
            f"{human_bytes(t.nbytes)}"
            + "".join(f", {name} {value:g}" for name, value in t.scalars.items())
            + (f", buffers {sorted(t.buffers)}" if t.buffers else ""),
            highlight=False,
        )
        if t.layout == "empty-shard":
            out.print(
                "  note: vLLM 0.33.0 rejects the empty shard index ('shard_.weight'); "
                "the flashnext loader accepts it after this shape check",
                highlight=False,
            )
        if tp:
            for r in range(tp):
                copies = t.tp_row_map(tp, r)
                out.print(
                    f"  rank {r}: "
                    + "; ".join(
                        f"{c.tensor.rsplit('.', 2)[-2]}.{c.tensor.rsplit('.', 1)[-1]}"
                        f"[{c.src_offset}:{c.src_offset + c.rows}] -> [{c.dst_offset}:"
                        f"{c.dst_offset + c.rows}]"
                        for c in copies
                    ),
                    highlight=False,
                )


@checkpoint.command("override")
@click.argument("directory", type=click.Path(path_type=Path))
@click.option(
    "--layer-type",
    "layer_types",
    multiple=True,
    required=True,
    help="OLD=NEW: every layer_types entry equal to OLD becomes NEW (repeatable).",
)
@click.option(
    "--out", type=click.Path(path_type=Path), default=None, help="Write a servable copy here."
)
@click.option("--hf-overrides", "hf", is_flag=True, help="Print JSON for vLLM --hf-overrides.")
@click.option("--reason", default=None, help="Why the override is needed (recorded).")
def override(
    directory: Path, layer_types: tuple[str, ...], out: Path | None, hf: bool, reason: str | None
) -> None:
    """Change layer_types entries of DIRECTORY's config.json, recording why.

    Never edits config.json in place: --out DIR2 writes a patched copy (other files are
    symlinked), --hf-overrides prints the JSON for vLLM. The record says the change lets the
    runtime load but is not shown to be computationally equivalent.
    """
    from flashnext.checkpoint.config import (
        CAVEAT,
        hf_overrides,
        override_layer_types,
        override_record,
        parse_mapping,
        read_config,
        write_overridden_snapshot,
    )
    from flashnext.checkpoint.snapshot import resolve_snapshot
    from flashnext.errors import CheckpointError

    if (out is None) == (not hf):
        raise CheckpointError("choose exactly one of --out DIR2 and --hf-overrides")
    root, _layout = resolve_snapshot(directory)
    mapping = parse_mapping(layer_types)
    patched, changes = override_layer_types(read_config(root), mapping)
    record = override_record(mapping, changes, root / "config.json", reason)
    err = err_console
    for c in changes:
        err.print(f"changed {c.field}: {c.old!r} -> {c.new!r}", highlight=False)
    if out is None:
        click.echo(json.dumps(hf_overrides(patched, changes)))
    else:
        write_overridden_snapshot(root, out, patched, record)
        err.print(
            f"wrote {out / 'config.json'} (+ FLASHNEXT_OVERRIDES.json; other files symlinked)"
        )
    err.print(f"{len(changes)} entries changed. {CAVEAT}", highlight=False)


def _attach_plan() -> None:
    from flashnext.cli.checkpoint_plan import plan

    checkpoint.add_command(plan)


_attach_plan()

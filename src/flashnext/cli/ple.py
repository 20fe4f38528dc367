"""``flashnext ple``: inspect, quantize and query PLE sidecar tables."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import click
import numpy as np
from rich.progress import Progress
from rich.table import Table

from flashnext.cli._common import (
    OutputDir,
    cell,
    human_bytes,
    note,
    out_console,
    print_record,
    progress,
    show,
)
from flashnext.errors import SidecarError
from flashnext.ple.formats import FORMATS, get_codec
from flashnext.ple.inspect import checksum_bytes, inspect_sidecar
from flashnext.ple.preflight import GIB
from flashnext.ple.quantize import quantize_table
from flashnext.ple.sidecar import open_sidecar
from flashnext.ple.table import open_table


@contextlib.contextmanager
def _bar(disable: bool) -> Iterator[Progress]:
    """A progress display that vanishes on an error, leaving the one ``error:`` line alone."""
    with progress(disable=disable) as bar:
        try:
            yield bar
        except BaseException:
            bar.live.transient = True
            raise


@click.group()
def ple() -> None:
    """Inspect, quantize and query PLE sidecar tables."""


@ple.command()
@click.argument("directory", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--no-verify", is_flag=True, help="Skip re-hashing the shards against META.json.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON record on stdout.")
def info(directory: Path, no_verify: bool, as_json: bool) -> None:
    """Format, rows, width, size and checksum status of the sidecar DIRECTORY.

    Exits 1 when a shard no longer matches its recorded sha256.
    """
    sidecar = open_sidecar(directory)
    with _bar(disable=as_json or no_verify) as bar:
        task = bar.add_task("sha256", total=checksum_bytes(sidecar), bytes_per_unit=1, unit="B")
        found = inspect_sidecar(
            sidecar, verify=not no_verify, progress=lambda n: bar.advance(task, n)
        )
    record = found.to_dict()
    problems = found.problems
    resident_bytes, memory = found.resident_bytes, found.memory
    if as_json:
        print_record("flashnext.ple.info", record)
    else:
        table = Table(show_header=False, box=None)
        for key in (
            "path",
            "format",
            "num_rows",
            "width",
            "num_shards",
            "rows_per_shard",
            "bytes_per_row",
            "checksums",
        ):
            value = record[key]
            table.add_row(key, cell(f"{value:,}" if isinstance(value, int) else value))
        table.add_row("size", human_bytes(record["size_bytes"]))
        fits = "fits" if record["resident_fits"] else "does NOT fit (serve it mmapped)"
        table.add_row(
            "resident copy",
            cell(f"{resident_bytes / GIB:.1f} GiB: {fits} ({memory.explain()})"),
        )
        if record["rel_rmse"] is not None:
            table.add_row("rel. RMSE", f"{record['rel_rmse']:.5f}")
        show(table)
        for line in problems:
            note(line, style="red")
    if problems:
        raise SystemExit(1)


@ple.command()
@click.argument("src", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("dst", type=OutputDir())
@click.option("--format", "fmt", type=click.Choice(FORMATS), required=True, help="Output format.")
@click.option(
    "--rows-per-shard",
    type=click.IntRange(min=1),
    default=None,
    help="Rows per output shard [default: the source's].",
)
@click.option(
    "--workers",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Processes quantizing shards in parallel.",
)
@click.option(
    "--layer",
    type=click.IntRange(min=0),
    default=None,
    help="PLE layer ordinal (checkpoint sources).",
)
@click.option(
    "--force",
    is_flag=True,
    help="Replace a DST that holds anything else (the old contents stay until the new "
    "table is complete).",
)
@click.option(
    "--ignore-source-checksums",
    is_flag=True,
    help="Quantize a sidecar SRC even if its shards fail the sha256 in its META.json.",
)
@click.option(
    "--requantize",
    is_flag=True,
    help="Quantize even when SRC already stores FORMAT exactly (by default such a table is "
    "copied: rel. RMSE 0).",
)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary on stdout.")
def quantize(
    src: Path,
    dst: Path,
    fmt: str,
    rows_per_shard: int | None,
    workers: int,
    layer: int | None,
    force: bool,
    ignore_source_checksums: bool,
    requantize: bool,
    as_json: bool,
) -> None:
    """Convert the table at SRC into a FORMAT sidecar at DST.

    DST must be new, empty, or this command's own output for the same SRC and settings (an
    interrupted run resumes: finished shards are kept, verified by sha256); anything else is
    refused unless --force. A sidecar SRC is hashed first and must match its own checksums.
    A checkpoint that stores FORMAT already (bf16, fp8, nvfp4) is copied byte for byte
    (exact, at disk speed) unless --requantize.
    """
    from flashnext.checkpoint.sources import open_row_source

    if dst.resolve() == src.resolve():
        raise click.BadParameter(
            "DST must differ from SRC (the sidecar is rewritten)", param_hint="DST"
        )
    with _bar(disable=as_json) as bar:
        task = bar.add_task("sha256 of SRC", total=None, bytes_per_unit=1, unit="B")
        source = open_row_source(
            src,
            layer,
            ignore_checksums=ignore_source_checksums,
            progress=lambda n: bar.advance(task, n),
        )
        bar.remove_task(task)
    if rows_per_shard is None:
        rows_per_shard = source.rows_per_shard
    bytes_in = source.width * 4
    with _bar(disable=as_json) as bar:
        task = bar.add_task(f"{fmt}", total=source.num_rows, bytes_per_unit=bytes_in, unit="rows")
        result = quantize_table(
            source,
            dst,
            fmt,
            rows_per_shard,
            workers=workers,
            geometry=getattr(source, "geometry", None),
            on_shard=lambda _res, rows: bar.advance(task, rows),
            force=force,
            requantize=requantize,
        )
    summary = result.summary(source, dst)
    if as_json:
        print_record("flashnext.ple.quantize", summary)
        return
    done = "copied" if summary["conversion"] == "copy" else "quantized"
    table = Table(
        title=cell(f"{done} to {summary['format']}: {summary['destination']}"),
        show_header=False,
        box=None,
    )
    table.add_row("rows", f"{summary['num_rows']:,} x {summary['width']}")
    table.add_row(
        "shards",
        f"{summary['num_shards']} ({summary['shards_written']} written, "
        f"{summary['shards_kept']} kept from an earlier run)",
    )
    table.add_row("size", human_bytes(summary["size_bytes"]))
    table.add_row(
        "rel. RMSE",
        f"{summary['rel_rmse']:.5f} (worst shard {summary['worst_shard_rel_rmse']:.5f})",
    )
    table.add_row("time", f"{summary['seconds']:.1f} s")
    show(table)


def _parse_ids(text: str) -> np.ndarray:
    try:
        values = [int(v) for v in text.replace(",", " ").split()]
    except ValueError:
        values = []
    if not values:
        raise click.BadParameter(
            f"expected integers separated by commas, found {text!r}", param_hint="--ids"
        )
    wide = [v for v in values if not -1 <= v <= np.iinfo(np.int64).max]
    if wide:
        raise click.BadParameter(
            f"row id {wide[0]} is not a row id (-1 pads, rows count from 0 and fit in int64)",
            param_hint="--ids",
        )
    return np.array(values, dtype=np.int64)


@ple.command()
@click.argument("directory", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--ids", required=True, help="Row ids, comma separated (-1 pads).")
@click.option(
    "--residency", type=click.Choice(["mmap", "resident"]), default="mmap", show_default=True
)
@click.option("--raw", is_flag=True, help="Also show the stored (quantized) tensors.")
@click.option("--json", "as_json", is_flag=True, help="Print full rows as JSON on stdout.")
def lookup(directory: Path, ids: str, residency: str, raw: bool, as_json: bool) -> None:
    """Print the dequantized rows of DIRECTORY for --ids (for debugging)."""
    row_ids = _parse_ids(ids)
    try:
        with open_table(directory, residency) as table:  # type: ignore[arg-type]
            rows = table.lookup(row_ids)
            stored = table.gather_raw(row_ids) if raw else {}
    except IndexError as exc:
        raise SidecarError(f"--ids: {exc}") from None
    if as_json:
        print_record(
            "flashnext.ple.lookup",
            {
                "format": table.format,
                "ids": row_ids.tolist(),
                "rows": rows.tolist(),
                **(
                    {
                        "raw": {
                            k: np.asarray(v).astype(np.float64).tolist() for k, v in stored.items()
                        }
                    }
                    if raw
                    else {}
                ),
            },
        )
        return
    codec = get_codec(table.format)
    np.set_printoptions(precision=5, linewidth=110, threshold=12, edgeitems=4)
    for i, row_id in enumerate(row_ids.tolist()):
        out_console.print(
            f"[bold]row {row_id}[/] ({codec.name}) norm {np.linalg.norm(rows[i]):.5f}"
        )
        out_console.print(f"  {rows[i]}", highlight=False)
        for name, value in stored.items():
            out_console.print(
                f"  {name}: {np.asarray(value[i]).astype(np.float32)}", highlight=False
            )

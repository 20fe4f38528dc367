"""``flashnext ple``: inspect, quantize and query PLE sidecar tables."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
import numpy as np
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
from flashnext.ple.preflight import DEFAULT_HEADROOM, GIB, host_memory
from flashnext.ple.quantize import RowSource, SidecarSource, quantize_table
from flashnext.ple.sidecar import META_NAME, open_sidecar
from flashnext.ple.table import open_table


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
    expected = sidecar.expected_checksums()
    problems: list[str] = []
    if not no_verify and expected:
        total = sum(s.path.stat().st_size for s in sidecar.shards if s.index in expected)
        with progress(disable=as_json) as bar:
            task = bar.add_task("sha256", total=total, bytes_per_unit=1, unit="B")
            problems = sidecar.verify_checksums(lambda n: bar.advance(task, n))
    if not expected:
        checks = "not recorded (no META.json checksums)"
    elif no_verify:
        checks = "not checked (--no-verify)"
    else:
        checks = "ok" if not problems else f"{len(problems)} mismatched"
    quant = sidecar.meta.get("quantization") or {}
    memory = host_memory()
    resident_bytes = sidecar.num_rows * sidecar.codec.bytes_per_row(sidecar.width)
    record: dict[str, Any] = {
        "path": str(sidecar.path),
        "format": sidecar.format,
        "num_rows": sidecar.num_rows,
        "width": sidecar.width,
        "num_shards": len(sidecar.shards),
        "rows_per_shard": sidecar.rows_per_shard,
        "bytes_per_row": sidecar.codec.bytes_per_row(sidecar.width),
        "size_bytes": sidecar.nbytes,
        "has_meta": (sidecar.path / META_NAME).exists(),
        "checksums": checks,
        "problems": problems,
        "rel_rmse": quant.get("rel_rmse"),
        "resident_bytes": resident_bytes,
        "host_available_bytes": memory.available,
        "resident_fits": resident_bytes + DEFAULT_HEADROOM <= memory.available,
        "geometry": sidecar.geometry,
    }
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


def open_row_source(src: Path, layer: int | None) -> RowSource:
    """The rows to quantize: a checkpoint directory (one with config.json, or a hub-cache
    repo folder) in any table layout and format, or a sidecar directory (any format).

    ``layer`` (a PLE layer ordinal) only applies to checkpoint sources.
    """
    if (src / "config.json").exists() or (src / "snapshots").is_dir():
        from flashnext.checkpoint import open_table_source

        return open_table_source(src, layer)
    if layer not in (None, 0):
        raise click.BadParameter("--layer applies to checkpoint sources only", param_hint="--layer")
    return SidecarSource(src)


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
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary on stdout.")
def quantize(
    src: Path,
    dst: Path,
    fmt: str,
    rows_per_shard: int | None,
    workers: int,
    layer: int | None,
    as_json: bool,
) -> None:
    """Convert the table at SRC into a FORMAT sidecar at DST.

    Streams shard by shard with bounded memory and resumes an interrupted run: run the same
    command again and finished shards are kept (verified by sha256), the rest redone.
    """
    if dst.resolve() == src.resolve():
        raise click.BadParameter(
            "DST must differ from SRC (the sidecar is rewritten)", param_hint="DST"
        )
    source = open_row_source(src, layer)
    if rows_per_shard is None:
        rows_per_shard = source.rows_per_shard
    bytes_in = source.width * 4
    with progress(disable=as_json) as bar:
        task = bar.add_task(f"{fmt}", total=source.num_rows, bytes_per_unit=bytes_in, unit="rows")
        result = quantize_table(
            source,
            dst,
            fmt,
            rows_per_shard,
            workers=workers,
            geometry=getattr(source, "geometry", None),
            on_shard=lambda _res, rows: bar.advance(task, rows),
        )
    summary = {
        "source": source.describe(),
        "destination": str(dst),
        "format": fmt,
        "num_rows": result.sidecar.num_rows,
        "width": result.sidecar.width,
        "num_shards": len(result.sidecar.shards),
        "shards_written": result.shards_written,
        "shards_kept": result.shards_kept,
        "size_bytes": result.sidecar.nbytes,
        "rel_rmse": result.rel_rmse,
        "worst_shard_rel_rmse": max(result.per_shard_rmse, default=0.0),
        "seconds": result.seconds,
        "input_mb_per_s": result.source_bytes / 1e6 / result.seconds if result.seconds else None,
    }
    if as_json:
        print_record("flashnext.ple.quantize", summary)
        return
    table = Table(title=cell(f"quantized to {fmt}: {dst}"), show_header=False, box=None)
    table.add_row("rows", f"{summary['num_rows']:,} x {summary['width']}")
    table.add_row(
        "shards",
        f"{summary['num_shards']} ({result.shards_written} written, "
        f"{result.shards_kept} kept from an earlier run)",
    )
    table.add_row("size", human_bytes(result.sidecar.nbytes))
    table.add_row(
        "rel. RMSE", f"{result.rel_rmse:.5f} (worst shard {summary['worst_shard_rel_rmse']:.5f})"
    )
    table.add_row("time", f"{result.seconds:.1f} s")
    show(table)


def _parse_ids(text: str) -> np.ndarray:
    try:
        ids = np.array([int(v) for v in text.replace(",", " ").split()], dtype=np.int64)
    except OverflowError:
        raise click.BadParameter(
            f"{text!r}: a row id is beyond int64; ids are 0 <= id < num_rows, -1 pads",
            param_hint="--ids",
        ) from None
    except ValueError:
        ids = np.empty(0, dtype=np.int64)
    if ids.size == 0:
        raise click.BadParameter(
            f"expected integers separated by commas, found {text!r}", param_hint="--ids"
        )
    return ids


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

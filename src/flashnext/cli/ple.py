"""``flashnext ple``: inspect, quantize and query PLE sidecar tables."""

from __future__ import annotations

import contextlib
import dataclasses
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
import numpy as np
from rich.progress import Progress
from rich.table import Table

from flashnext.cli._common import (
    FiniteRange,
    OutputDir,
    cell,
    human_bytes,
    json_option,
    note,
    old_spelling,
    out_console,
    print_record,
    progress,
    say,
    show,
    sidecar_argument,
)
from flashnext.cli._destination import check_output
from flashnext.cli._signals import Terminated, terminate_cleanly
from flashnext.errors import SidecarError
from flashnext.host.inspect import SidecarInfo, checksum_bytes, inspect_sidecar, value_bytes
from flashnext.host.pageout import page_cache_pageout
from flashnext.host.preflight import (
    COMMAND_LINE,
    GIB,
    Preflight,
    host_memory,
    page_cache_bytes,
    pageout_warning,
    preflight_table,
)
from flashnext.placement import RESIDENCIES
from flashnext.ple.formats import FORMATS, get_codec
from flashnext.records import (
    PLE_INFO,
    PLE_LOOKUP,
    PLE_PREFLIGHT,
    PLE_PROFILE_SUMMARY,
    PLE_QUANTIZE,
    PLE_SLICE,
    PLE_WARM,
)
from flashnext.store.destination import progress_kept
from flashnext.store.profile import (
    DEMO_TOKENIZER,
    PROFILE_NAME,
    RowProfile,
    default_profile_path,
    load_profile,
    profile_sidecar,
)
from flashnext.store.row_error import DEFAULT_MAX_ROW_ERROR
from flashnext.store.sidecar import Sidecar, open_sidecar

if TYPE_CHECKING:  # the lookup path loads numba (~0.2 s): info, slice and profile never need it
    from flashnext.host.table import PLETable, Warming


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
@sidecar_argument("directory")
@click.option(
    "--no-verify",
    is_flag=True,
    help="Skip re-hashing the shards against META.json and scanning their values.",
)
@json_option(PLE_INFO)
def info(directory: Path, no_verify: bool, as_json: bool) -> None:
    """Format, rows, width, size, checksum and value status of SIDECAR.

    Verifying re-hashes the shards against META.json's sha256 and reads every floating-point
    value (bf16/fp8 weights, scales) for inf and NaN. Exits 1 when a shard no longer matches
    its sha256 or holds such a value.
    """
    sidecar = open_sidecar(directory)
    total = 0 if no_verify else checksum_bytes(sidecar) + value_bytes(sidecar)
    with _bar(disable=as_json or not total) as bar:
        task = bar.add_task("verify", total=total, bytes_per_unit=1, unit="B")
        found = inspect_sidecar(
            sidecar, verify=not no_verify, progress=lambda n: bar.advance(task, n)
        )
    record = found.to_dict()
    if as_json:
        print_record(PLE_INFO, record)
    else:
        _show_info(record, found)
    if found.problems:
        raise SystemExit(1)


def _show_info(record: dict[str, Any], found: SidecarInfo) -> None:
    """The one-screen table of `ple info` (the --json record's fields), problems after it."""
    resident_bytes, memory = found.resident_bytes, found.memory
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
        "values",
    ):
        value = record[key]
        table.add_row(key, cell(f"{value:,}" if isinstance(value, int) else value))
    if record["rows_present"] is not None:
        held = ", ".join(f"{lo:,}..{hi:,}" for lo, hi in record["rows_present"])
        table.add_row("rows present", f"{held} (a slice: `flashnext ple slice`)")
    table.add_row("size", human_bytes(record["size_bytes"]))
    fits = "fits" if record["resident_fits"] else "does NOT fit (serve it mmapped)"
    table.add_row(
        "resident copy",
        cell(f"{resident_bytes / GIB:.1f} GiB: {fits} ({memory.explain()})"),
    )
    if record["rel_rmse"] is not None:
        table.add_row("rel. RMSE", f"{record['rel_rmse']:.5f}")
    rows_err = record["row_error"]
    if rows_err is not None:
        zeroed = rows_err["zeroed_rows"]
        table.add_row(
            "row error",
            f"worst {rows_err['worst']:.4f} (row {rows_err['worst_row']:,}), p99.9 "
            f"{rows_err['p99_9']:.4f}, {zeroed:,} rows zeroed"
            + ("" if rows_err["ok"] else f": above {rows_err['max_row_error']:g}"),
        )
    if record["source_checksums_ignored"]:
        table.add_row(
            "source",
            f"{len(record['source_checksums_ignored'])} shards failed their own checksum, "
            "taken with --ignore-source-checksums",
        )
    show(table)
    for line in found.problems:
        note(line, style="red")


@ple.command("quantize")
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
    help="Processes quantizing shards in parallel (capped at the shards and the CPUs).",
)
@click.option(
    "--layer",
    type=click.IntRange(min=0),
    default=None,
    help="PLE layer ordinal (checkpoint sources).",
)
@click.option(
    "--max-row-error",
    type=FiniteRange(min=0),
    default=DEFAULT_MAX_ROW_ERROR,
    show_default=True,
    help="Exit 1 when a row's relative error exceeds this (a row quantized to all-zero has 1).",
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
@json_option(PLE_QUANTIZE)
def quantize_sidecar(
    src: Path,
    dst: Path,
    fmt: str,
    rows_per_shard: int | None,
    workers: int,
    layer: int | None,
    max_row_error: float,
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
    (exact, at disk speed) unless --requantize. Exits 1 when a row's relative error exceeds
    --max-row-error (the table is written; the summary names the worst row).
    """
    # What DST holds is judged by the library, under the lock: its own earlier output for the
    # same source and settings resumes, anything else is refused there (or --force replaced).
    check_output(dst, [src], hint="DST")
    with terminate_cleanly():
        try:
            _quantize(src, dst, fmt, rows_per_shard, workers, layer, max_row_error, force,
                      ignore_source_checksums, requantize, as_json)  # fmt: skip
        except Terminated:
            click.echo(f"interrupted: {progress_kept(dst)}", err=True)
            raise
        except (KeyboardInterrupt, click.exceptions.Abort):
            click.echo(f"interrupted: {progress_kept(dst)}", err=True)
            sys.exit(130)  # this line says it all, not the CLI's bare "aborted"


def _quantize(
    src: Path, dst: Path, fmt: str, rows_per_shard: int | None, workers: int, layer: int | None,
    max_row_error: float, force: bool, ignore_source_checksums: bool, requantize: bool,
    as_json: bool,
) -> None:  # fmt: skip
    from flashnext.checkpoint.sources import open_row_source
    from flashnext.store.quantize import effective_workers, quantize_from, usable_cpus

    with _bar(disable=as_json) as bar:
        hashing = bar.add_task("sha256 of SRC", total=None, bytes_per_unit=1, unit="B")
        task = [hashing]  # the conversion's task, once the source says how many rows
        todo = [0]

        def open_source() -> Any:
            return open_row_source(src, layer, ignore_checksums=ignore_source_checksums,
                                   progress=lambda n: bar.advance(hashing, n))  # fmt: skip

        def on_source(source: Any) -> None:
            bar.remove_task(hashing)
            shards = -(-source.num_rows // (rows_per_shard or source.rows_per_shard))
            if effective_workers(workers, shards) < workers:
                note(
                    f"--workers {workers}: using {effective_workers(workers, shards)} "
                    f"({shards} shards, {usable_cpus()} usable CPUs)"
                )
            todo[0] = source.num_rows
            task[0] = bar.add_task(f"{fmt}", total=source.num_rows,
                                   bytes_per_unit=source.width * 4, unit="rows")  # fmt: skip

        def on_shard(res: Any, rows: int) -> None:
            if res is None:  # kept from an earlier run: less to do, not rows done (the rate)
                todo[0] -= rows
                bar.update(task[0], total=todo[0])
            else:
                bar.advance(task[0], rows)

        # The library takes DST's lock before hashing SRC: a second writer is refused at once.
        source, result = quantize_from(
            open_source, dst, fmt, rows_per_shard, on_source=on_source, workers=workers,
            on_shard=on_shard, force=force, requantize=requantize, max_row_error=max_row_error,
        )  # fmt: skip
    summary = result.summary(source, dst)
    if as_json:
        print_record(PLE_QUANTIZE, summary)
    else:
        _show_quantize_summary(summary)
    _note_lossy_source(summary)
    if not result.row_error["ok"]:
        raise SidecarError(_row_error_refusal(result.row_error, fmt, dst))


def _note_lossy_source(summary: dict[str, Any]) -> None:
    """Say that a quantized SRC's errors are against its own lossy rows, not the original."""
    fmt = summary["source"].get("format")
    if fmt in ("fp8", "int4", "nvfp4") and summary["conversion"] == "quantize":
        note(
            f"the errors above are against SRC, whose rows are {fmt} (lossy) already: against "
            "the original rows they are larger (quantize from the checkpoint or a bf16 sidecar "
            "to measure them)"
        )


def _row_error_refusal(found: dict[str, Any], fmt: str, dst: Path) -> str:
    zeroed = found["zeroed_rows"]
    lost = f"; {zeroed:,} rows quantized to all-zero from non-zero source rows" if zeroed else ""
    return (
        f"{dst}: row {found['worst_row']} has relative error {found['worst']:.3g}, above "
        f"--max-row-error {found['max_row_error']:g}{lost}: {fmt} cannot hold this table's range "
        "(an outlier?); check the source, choose another --format, or raise --max-row-error"
    )


def _show_quantize_summary(summary: dict) -> None:
    """The one-screen summary of `ple quantize` (the --json record's fields)."""
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
    rows = summary["row_error"]
    if rows.get("measured_shards") and rows["worst_row"] < 0:  # no row with an error (a copy)
        table.add_row("row error", "0 in every row")
    elif rows.get("measured_shards"):
        bad = not rows["ok"]
        table.add_row(
            "row error",
            cell(
                f"worst {rows['worst']:.4f} (row {rows['worst_row']}), 99.9th pct "
                f"{rows['p99_9']:.4f}, {rows['zeroed_rows']:,} rows zeroed"
                + (f": above --max-row-error {rows['max_row_error']:g}" if bad else ""),
                "red" if bad else None,
            ),
        )
    table.add_row("time", f"{summary['seconds']:.1f} s")
    show(table)


def _parse_ids(text: str) -> np.ndarray:
    items = [v.strip() for v in text.split(",")]
    # An empty item ("1,,2", "1,") is a typo, not a row to drop silently.
    bad = next((i for i, v in enumerate(items) if not re.fullmatch(r"[+-]?\d+", v)), None)
    if bad is not None:
        what = "an empty item" if not items[bad] else repr(items[bad])
        raise click.BadParameter(
            f"expected integers separated by commas, found {what} at position {bad + 1} of "
            f"{text!r}",
            param_hint="--ids",
        )
    values = [int(v) for v in items]
    wide = [v for v in values if not -1 <= v <= np.iinfo(np.int64).max]
    if wide:
        raise click.BadParameter(
            f"row id {wide[0]} is not a row id (-1 pads, rows count from 0 and fit in int64)",
            param_hint="--ids",
        )
    return np.array(values, dtype=np.int64)


@ple.command()
@sidecar_argument("directory")
@click.option("--ids", required=True, help="Row ids, comma separated (-1 pads).")
@click.option("--residency", type=click.Choice(RESIDENCIES), default="mmap", show_default=True)
@click.option("--raw", is_flag=True, help="Also show the stored (quantized) tensors.")
@click.option(
    "--warm", is_flag=True, help="Read the shard files into the page cache first (mmap only)."
)
@json_option(PLE_LOOKUP)
def lookup(directory: Path, ids: str, residency: str, raw: bool, warm: bool, as_json: bool) -> None:
    """Print the dequantized rows of SIDECAR for --ids (for debugging).

    SIDECAR may be a slice (`flashnext ple slice`): its rows are looked up where it holds
    them, and an id outside them is refused, naming the rows it holds.
    """
    from flashnext.host.table import open_table

    row_ids = _parse_ids(ids)
    if warm and residency == "resident":
        raise click.BadParameter("applies to --residency mmap (page cache)", param_hint="--warm")
    sidecar = open_sidecar(directory)
    row_range = None if sidecar.rows_present is None else _slice_span(sidecar, row_ids)
    try:
        with open_table(sidecar, residency, row_range=row_range) as table:  # type: ignore[arg-type]
            if warm:
                _warm(table, disable=as_json)
            rows = table.lookup(row_ids)
            stored = table.gather_raw(row_ids) if raw else {}
    except IndexError as exc:
        raise SidecarError(f"--ids: {exc}") from None
    if as_json:
        print_record(
            PLE_LOOKUP,
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
            # float64: a float32 dot of rows near 1e19 overflows (a warning and "norm inf")
            f"[bold]row {row_id}[/] ({codec.name}) norm "
            f"{np.linalg.norm(rows[i].astype(np.float64)):.5g}"
        )
        out_console.print(f"  {rows[i]}", highlight=False)
        for name, value in stored.items():
            out_console.print(
                f"  {name}: {np.asarray(value[i]).astype(np.float32)}", highlight=False
            )


def _slice_span(sidecar: Sidecar, row_ids: np.ndarray) -> tuple[int, int]:
    """The range of a slice's rows that holds every id of ``row_ids`` (-1 pads), refused by
    name when an id is not in the slice or the ids span two of its ranges."""
    ids = [i for i in row_ids.tolist() if i != -1]
    held = sidecar.rows_present or ()
    for i in ids:
        if not any(lo <= i < hi for lo, hi in held):
            raise SidecarError(
                f"--ids: row {i} is not in {sidecar.path}, a slice holding rows "
                f"{sidecar.present_text()}; look it up in the full sidecar or another node's slice"
            )
    first = ids[0] if ids else held[0][0]
    span = next(r for r in held if r[0] <= first < r[1])
    if any(not span[0] <= i < span[1] for i in ids):
        raise SidecarError(
            f"--ids: the ids lie in two ranges of the slice {sidecar.path} (rows "
            f"{sidecar.present_text()}); look them up one range at a time"
        )
    return span


def _warm(table: PLETable, disable: bool, populate: bool = True) -> Warming:
    """Read ``table``'s files into the page cache now, with a progress bar on stderr."""
    with _bar(disable=disable) as bar:
        total = sum(length for _, _, length in table.file_ranges())
        task = bar.add_task("warming", total=total, bytes_per_unit=1, unit="B")
        advance = lambda n: bar.advance(task, n)  # noqa: E731
        return table.warm(background=False, progress=advance, populate=populate)


@ple.command()
@sidecar_argument("directory")
@json_option(PLE_WARM)
def warm(directory: Path, as_json: bool) -> None:
    """Read the shard files of SIDECAR into the page cache (no anonymous copy).

    Large sequential reads after posix_fadvise(WILLNEED): the first lookups of a server that
    maps the table afterwards find their rows cached instead of reading them from disk. Warns
    when this host pages out page cache on its own (DAMON), and after how long.
    """
    from flashnext.host.table import open_table

    with open_table(directory, "mmap") as table:
        files = sorted({p for p, _, _ in table.file_ranges()})
        before = sum(page_cache_bytes(p) for p in files)
        t0 = time.perf_counter()
        warming = _warm(table, disable=as_json, populate=False)  # for another process
        seconds = time.perf_counter() - t0
    warming.wait()
    pageout = page_cache_pageout("/")
    rate = warming.bytes_read / seconds if seconds > 0 else 0.0
    file_bytes = sum(p.stat().st_size for p in files)
    after = sum(page_cache_bytes(p) for p in files)
    record = {
        "path": str(directory),
        "files": len(files),
        "bytes": warming.bytes_read,
        "seconds": seconds,
        "bytes_per_second": rate,
        "file_bytes": file_bytes,
        "cached_before_bytes": before,  # by mincore, whole shard files
        "cached_after_bytes": after,
        "pageout": [p.to_dict() for p in pageout],
    }
    if as_json:
        print_record(PLE_WARM, record)
        return
    say(
        f"warmed {directory}: read {human_bytes(warming.bytes_read)} in {seconds:.1f} s "
        f"({human_bytes(rate)}/s); page cache held {human_bytes(before)} of its "
        f"{human_bytes(file_bytes)} before, {human_bytes(after)} after"
    )
    for agent in pageout:
        note(pageout_warning(agent, str(directory)), style="yellow")


#: 2: ``hot_rows`` / ``hot_rows_profile`` became ``hot_tier_rows`` / ``hot_tier_profile``.
PREFLIGHT_SCHEMA = 2


def _hot_tier_option(value: str | None, num_rows: int) -> tuple[int, str | None]:
    """``--hot-tier`` as (rows, profile path): a count, or a profile file / directory."""
    if value is None:
        return 0, None
    if value.isdigit():
        return min(int(value), num_rows), None
    path = Path(value)
    if not path.exists():
        raise click.BadParameter(
            f"expected a row count or a profile, found {value!r} (no such file)",
            param_hint="--hot-tier",
        )
    profile = load_profile(path)
    return min(len(profile), num_rows), str(path)


#: A checkpoint's way to a memory-mapped table: the plugin serving a sidecar of it.
CHECKPOINT_MMAP = "flashnext ple quantize it to a sidecar for the plugin to map"


def _checkpoint_table_bytes(directory: Path) -> tuple[int, str]:
    """(bytes, format) of every PLE table in checkpoint ``directory``, as stored."""
    from flashnext.checkpoint.ple_tensors import find_ple_tables

    tables = find_ple_tables(directory)
    total = sum(t.geometry.num_rows * t.codec.bytes_per_row(t.geometry.width) for t in tables)
    return total, "/".join(sorted({t.format for t in tables}))


@ple.command()
@sidecar_argument("directory")
@click.option(
    "--residency",
    type=click.Choice(RESIDENCIES),
    default=None,
    help="How the table is held: mmap (a sidecar's default) or resident (a checkpoint's: stock "
    "vLLM copies its table into the weights).",
)
@old_spelling("--hot-rows", "--hot-tier", "hot_tier")
@click.option(
    "--hot-tier",
    metavar="N|PROFILE",
    default=None,
    help="mmap: a hot tier of N rows, or of the rows of a profile (flashnext ple profile).",
)
@click.option(
    "--host-root",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=Path("/"),
    show_default=True,
    help="Read proc/ and sys/ under this directory (a copy of another host's files).",
)
@click.option(
    "--memory-cgroup",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=None,
    help="Check against this memory cgroup's directory (v1 or v2), where the server will run, "
    "instead of this process's own cgroup; vLLM itself does not read the limit.",
)
@json_option(PLE_PREFLIGHT)
def preflight(
    directory: Path,
    residency: str | None,
    hot_tier: str | None,
    host_root: Path,
    memory_cgroup: Path | None,
    as_json: bool,
) -> None:
    """Will the table of SIDECAR fit in this host's memory when served with --residency?

    SIDECAR may also be a checkpoint (config.json, no META.json): the table stock vLLM
    would copy into its weights, always resident. Resident: the whole table is anonymous memory
    (MemAvailable, the memory cgroup's limit less its usage plus reclaimable page cache, the
    commit limit under vm.overcommit_memory=2). Memory-mapped: the hot tier is, and the table
    itself should stay in page cache (a warning when it cannot). Exits 1 when the table would
    be refused.
    """
    checkpoint = (directory / "config.json").exists() and not (directory / "META.json").exists()
    if checkpoint:
        if residency == "mmap" or hot_tier is not None:
            raise click.BadParameter(
                "a checkpoint's table is copied into vLLM's weights: it is served resident "
                "(quantize it to a sidecar to serve it memory-mapped)",
                param_hint="--residency/--hot-tier",
            )
        table_bytes, fmt = _checkpoint_table_bytes(directory)
        hot, profile_path, per_row, residency = 0, None, 0, "resident"
        fixes = dataclasses.replace(COMMAND_LINE, mmap=CHECKPOINT_MMAP)
    else:
        sidecar = open_sidecar(directory)
        residency, fmt = residency or "mmap", sidecar.format
        if residency == "resident" and hot_tier is not None:
            raise click.BadParameter(
                "a hot tier applies to --residency mmap", param_hint="--hot-tier"
            )
        per_row = sidecar.codec.bytes_per_row(sidecar.width)
        table_bytes = sidecar.num_rows * per_row
        hot, profile_path = _hot_tier_option(hot_tier, sidecar.num_rows)
        fixes = COMMAND_LINE
    verdict = preflight_table(
        table_bytes,
        residency,  # type: ignore[arg-type]
        f"{directory} ({fmt}{', checkpoint' if checkpoint else ''})",
        hot_bytes=hot * per_row,
        memory=host_memory(host_root, COMMAND_LINE, memory_cgroup),
        fixes=fixes,
    )
    if as_json:
        extra = {"format": fmt, "hot_tier_rows": hot, "hot_tier_profile": profile_path}
        print_record(PLE_PREFLIGHT, {**verdict.to_dict(), **extra}, PREFLIGHT_SCHEMA)
    else:
        _show_preflight(verdict, hot)
    if not verdict.ok:
        raise SystemExit(1)


def _show_preflight(verdict: Preflight, hot_tier_rows: int) -> None:
    mem = verdict.memory
    table = Table(title=cell(f"preflight: {verdict.what}"), show_header=False, box=None)
    table.add_row("residency", verdict.residency)
    table.add_row("table", human_bytes(verdict.table_bytes))
    if verdict.residency == "mmap":
        table.add_row("hot tier", f"{hot_tier_rows:,} rows, {human_bytes(verdict.hot_bytes)}")
    table.add_row("anonymous memory", human_bytes(verdict.anonymous_bytes))
    table.add_row("page cache", human_bytes(verdict.page_cache_bytes))
    table.add_row("can allocate", cell(f"{human_bytes(mem.available)} ({mem.explain()})"))
    table.add_row("can cache", human_bytes(mem.page_cache_room))
    verdict_text = "refused" if not verdict.ok else "warning" if verdict.warnings else "fits"
    table.add_row("verdict", cell(verdict_text, "red" if not verdict.ok else None))
    show(table)
    for line in verdict.refusals:
        note(line, style="red")
    for line in verdict.warnings:
        note(line, style="yellow")


@ple.command()
@sidecar_argument("sidecar_dir")
@click.option(
    "--text",
    "texts",
    multiple=True,
    required=True,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="A text file to profile (repeat the flag; each file is one request).",
)
@click.option(
    "--rows",
    type=click.IntRange(min=1),
    default=None,
    help="Keep the N most-used rows [default: every row seen].",
)
@click.option(
    "--tokenizer",
    default=None,
    metavar="PATH|NAME",
    help="tokenizer.json, a model directory, or a model in the local Hugging Face cache "
    f"[default: '{DEMO_TOKENIZER}', flashnext demo's BPE, when the table is the demo's].",
)
@click.option(
    "--layer",
    type=click.IntRange(min=0),
    default=None,
    help="PLE layer ordinal to hash for [default: the sidecar's geometry's].",
)
@old_spelling("--out", "--output", "out", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--output",
    "out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help=f"Profile file [default: SIDECAR.{PROFILE_NAME} beside SIDECAR].",
)
@json_option(PLE_PROFILE_SUMMARY)
def profile(
    sidecar_dir: Path,
    texts: tuple[Path, ...],
    rows: int | None,
    tokenizer: str | None,
    layer: int | None,
    out: Path | None,
    as_json: bool,
) -> None:
    """Count which rows of SIDECAR real text reads: a profile (for --hot-tier, a device cache).

    The text is tokenized and hashed exactly as the model does, through the geometry recorded
    in the sidecar's META.json. The profile is written beside SIDECAR (never inside an
    input); an existing file there is replaced only when it is a profile.
    """
    target = out or default_profile_path(sidecar_dir)
    tokenizer_file = Path(tokenizer) if tokenizer and Path(tokenizer).exists() else None
    check_output(
        target, [sidecar_dir, *texts, tokenizer_file], hint="--output", expect="file", owns=_is_profile
    )
    with terminate_cleanly(), _bar(disable=as_json) as bar:
        total = sum(p.stat().st_size for p in texts)
        task = bar.add_task("hashing text", total=total, bytes_per_unit=1, unit="B")
        # the library takes the profile's lock before the work: a second writer is refused
        sidecar, found = profile_sidecar(sidecar_dir, texts, target, tokenizer=tokenizer,
                                         layer=layer, rows=rows,
                                         progress=lambda n: bar.advance(task, n))  # fmt: skip
    summary = _profile_summary(found, target, sidecar.num_rows)
    if as_json:
        print_record(PLE_PROFILE_SUMMARY, summary)
        return
    _show_profile(summary)


def _is_profile(path: Path) -> bool:
    try:
        load_profile(path)
    except SidecarError:
        return False
    return True


def _profile_summary(found: RowProfile, target: Path, num_rows: int) -> dict[str, object]:
    # Counted before --rows truncated the profile (a 5-row profile says nothing of 1%).
    cover = found.meta.get("coverage_by_table_share", {})
    return {
        "profile": str(target),
        "rows": len(found),
        "table_rows": num_rows,
        "total_lookups": found.total_lookups,
        "coverage_of_lookups": found.coverage(len(found)),
        "coverage_by_table_share": cover,
        "tokenizer": found.meta.get("tokenizer"),
        "layer": found.meta.get("layer"),
        "files": len(found.meta.get("corpus", [])),
        "tokens": found.meta.get("tokens"),
    }


def _show_profile(summary: dict[str, Any]) -> None:
    table = Table(title=cell(f"profile: {summary['profile']}"), show_header=False, box=None)
    table.add_row("corpus", f"{summary['files']} files, {summary['tokens']:,} tokens")
    table.add_row("tokenizer", cell(str(summary["tokenizer"])))
    table.add_row("layer", str(summary["layer"]))
    table.add_row("lookups", f"{summary['total_lookups']:,}")
    table.add_row(
        "rows kept",
        f"{summary['rows']:,} of {summary['table_rows']:,}: "
        f"{summary['coverage_of_lookups']:.1%} of lookups",
    )
    for share, value in summary["coverage_by_table_share"].items():
        table.add_row(f"top {share} of rows", f"{value['rows']:,} rows: {value['coverage']:.1%}")
    show(table)


def _rank_list(ctx: click.Context, param: click.Parameter, value: str) -> tuple[int, ...]:
    try:
        ranks = tuple(int(v) for v in value.split(","))
    except ValueError:
        raise click.BadParameter(f"{value!r}: expected ranks like 0 or 0,1", ctx, param) from None
    tp = int(ctx.params.get("tp") or 1)  # --tp is eager and required: parsed first
    bad = [r for r in ranks if not 0 <= r < tp]
    if bad:
        raise click.BadParameter(
            f"{value!r}: rank {bad[0]} is not in a group of --tp {tp} (ranks 0..{tp - 1})",
            ctx,
            param,
        )
    return ranks


@ple.command("slice")
@sidecar_argument("sidecar")
@click.argument("dst", type=OutputDir())
@click.option("--tp", type=click.IntRange(min=1, max=4096), required=True, is_eager=True,
              help="Tensor-parallel size the model is served with.")  # fmt: skip
@click.option("--ranks", required=True, callback=_rank_list,
              help="The ranks this node serves, comma separated (e.g. 0,1).")  # fmt: skip
@click.option("--force", is_flag=True,
              help="Replace a DST that holds anything else (the old contents stay until the new "
              "slice is complete).")  # fmt: skip
@json_option(PLE_SLICE)
def slice_(
    sidecar: Path, dst: Path, tp: int, ranks: tuple[int, ...], force: bool, as_json: bool
) -> None:
    """Copy the shards of SIDECAR that ranks --ranks of --tp read into DST, byte for byte.

    Each copy's sha256 is checked against SIDECAR's META.json; profile.safetensors comes
    along; DST's META.json says which rows are present. The plugin and `ple lookup` serve a
    rank from DST when its rows lie inside them, and refuse naming the missing rows otherwise.
    DST must be new, empty, or this command's own slice of the same SIDECAR and ranks (an
    interrupted run resumes, keeping the shards it copied whole); anything else is refused
    unless --force.
    """
    from flashnext.store.slicing import plan_slice, write_slice

    source = open_sidecar(sidecar)
    plan = plan_slice(source, tp, ranks)
    # What DST holds is judged by the library, under the lock, as for `ple quantize`.
    check_output(dst, [sidecar], hint="DST")
    with terminate_cleanly(), _bar(disable=as_json) as bar:
        task = bar.add_task("copy", total=plan.nbytes, bytes_per_unit=1, unit="B")
        try:
            write_slice(source, dst, plan, progress=lambda n: bar.advance(task, n), force=force)
        except Terminated:
            click.echo(f"interrupted: {progress_kept(dst)}", err=True)
            raise
    summary = {
        "source": str(sidecar),
        "destination": str(dst),
        "tp": tp,
        "ranks": list(plan.ranks),
        "rank_rows": [list(r) for r in plan.rank_rows],
        "rows_present": [list(r) for r in plan.rows_present],
        "shards": [sh.index for sh in plan.shards],
        "bytes": plan.nbytes,
    }
    if as_json:
        print_record(PLE_SLICE, summary)
        return
    rows = ", ".join(f"{lo}..{hi}" for lo, hi in plan.rows_present)
    say(
        f"{dst}: {len(plan.shards)} of {len(source.shards)} shards ({human_bytes(plan.nbytes)}), "
        f"rows {rows} of {source.num_rows}, for ranks {','.join(map(str, plan.ranks))} of {tp}"
    )

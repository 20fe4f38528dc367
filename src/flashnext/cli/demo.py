"""``flashnext demo``: the PLE pipeline end to end on built-in synthetic data."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import click
from rich.table import Table

from flashnext.cli._common import OutputDir, human_bytes, json_option, note, print_record, show
from flashnext.cli._destination import check_output
from flashnext.cli._signals import terminate_cleanly
from flashnext.records import DEMO_RUN

if TYPE_CHECKING:
    from flashnext.demo import DemoResult


@click.command()
@click.option(
    "--out",
    "out_dir",
    type=OutputDir(),
    default=None,
    help="Keep the tables here [default: a temporary directory, removed at the end].",
)
@click.option(
    "--base",
    type=click.IntRange(min=1000),
    default=20_000,
    show_default=True,
    help="ngram_vocab_size_base of the scaled-down geometry (the model's is 20,000,000).",
)
@click.option(
    "--workers",
    type=click.IntRange(min=1),
    default=None,
    help="Quantizer processes [default: up to 4 cores].",
)
@json_option(DEMO_RUN)
def demo(out_dir: Path | None, base: int, workers: int | None, as_json: bool) -> None:
    """Build a synthetic PLE table, quantize it three ways, hash real text, time lookups.

    --out must be new, empty, or an earlier demo's output (its tables are rebuilt).
    """
    from flashnext.demo import (
        demo_output_problem,
        demo_temp_prefix,
        remove_stale_temp_dirs,
        run_demo,
    )
    from flashnext.text import corpus_roots

    check_output(out_dir, corpus_roots(), hint="--out")
    problem = demo_output_problem(out_dir) if out_dir is not None else None
    if problem:
        raise click.BadParameter(problem, param_hint="--out")
    log = (lambda msg: None) if as_json else (lambda msg: note(msg, "dim"))
    with terminate_cleanly():  # SIGTERM unwinds: the temporary directory goes too
        if out_dir is None:
            for stale in remove_stale_temp_dirs():
                log(f"removed {stale}, left by a demo run that was killed")
            with tempfile.TemporaryDirectory(prefix=demo_temp_prefix()) as tmp:
                result = run_demo(tmp, base=base, workers=workers, log=log)
        else:
            result = run_demo(out_dir, base=base, workers=workers, log=log)
    if as_json:
        print_record(DEMO_RUN, result)
        return

    show(_table(result))
    if out_dir is not None:
        note(f"tables kept in {out_dir}")


def _table(result: DemoResult) -> Table:
    """The demo's measurements as one table (sizes, errors, lookup times per residency)."""
    geo = result.geometry
    table = Table(
        title=(
            f"PLE table {geo['num_rows']:,} rows x {geo['width']} "
            f"(real geometry, base {geo['base']:,}); lookups of real-text n-grams"
        ),
        caption=(
            f"hashing: {result.hash_decode_us:.0f} µs per decode step, "
            f"{result.hash_prefill_ms:.1f} ms per 8K prefill; numpy take from an in-RAM BF16 "
            f"array: {result.numpy_take_decode_us:.0f} µs / {result.numpy_take_prefill_ms:.1f} ms. "
            f"Total {result.seconds:.0f} s."
        ),
    )
    table.add_column("format", no_wrap=True)
    table.add_column("on disk", justify="right", no_wrap=True)
    table.add_column("B/row", justify="right", no_wrap=True)
    table.add_column("rel.\nRMSE", justify="right", no_wrap=True)
    table.add_column("decode\n32x1\nmmap", justify="right", no_wrap=True)
    table.add_column("decode\n32x1\nresident", justify="right", no_wrap=True)
    table.add_column("prefill\n8K\nmmap", justify="right", no_wrap=True)
    table.add_column("prefill\n8K\nresident", justify="right", no_wrap=True)
    for row in result.rows:
        table.add_row(
            row.format,
            human_bytes(row.size_bytes),
            str(row.bytes_per_row),
            f"{row.rel_rmse:.4f}",
            f"{row.decode_us['mmap']:.0f} µs",
            f"{row.decode_us['resident']:.0f} µs",
            f"{row.prefill_ms['mmap']:.1f} ms",
            f"{row.prefill_ms['resident']:.1f} ms",
        )
    return table

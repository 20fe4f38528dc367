"""Shared CLI plumbing: stderr console, progress bars, JSON output."""

from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text

#: Diagnostics, progress and human summaries go to stderr; data goes to stdout.
err_console = Console(stderr=True)
out_console = Console()


class _RateColumn(ProgressColumn):
    """Rows/s and MB/s, from the task's rows and a ``bytes_per_unit`` field."""

    def render(self, task: Task) -> Text:
        speed = task.finished_speed or task.speed
        if not speed:
            return Text("-", style="progress.data.speed")
        mb = speed * task.fields.get("bytes_per_unit", 0) / 1e6
        unit = task.fields.get("unit", "rows")
        return Text(f"{speed:,.0f} {unit}/s  {mb:,.1f} MB/s", style="progress.data.speed")


def progress(disable: bool = False) -> Progress:
    """A progress display on stderr with count, rate, MB/s and ETA."""
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        _RateColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=err_console,
        disable=disable,
        transient=False,
    )


def print_json(data: Any) -> None:
    """Machine-readable output on stdout."""
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:,.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n} B"

"""The ``flashnext`` command: ``flashnext <group> <verb>``.

Each group lives in its own module and is imported only when invoked, so that
``flashnext validate`` does not pay for numpy and ``flashnext --help`` stays fast.
Data goes to stdout, diagnostics to stderr; a :class:`FlashnextError` becomes one
``error: ...`` line and exit status 1.
"""

from __future__ import annotations

import importlib
import sys

import click

from flashnext import __version__
from flashnext.errors import FlashnextError

# name -> (module, attribute, one-line help)
_COMMANDS: dict[str, tuple[str, str, str]] = {
    "check": (
        "flashnext.cli.check",
        "check",
        "Pre-boot check of planned `vllm serve` arguments against model, GPU and host.",
    ),
    "checkpoint": (
        "flashnext.cli.checkpoint",
        "checkpoint",
        "Verify a downloaded checkpoint, find its PLE tables, override config entries.",
    ),
    "demo": ("flashnext.cli.demo", "demo", "Run the PLE pipeline end to end on synthetic data."),
    "explain": ("flashnext.cli.explain", "explain", "Explain the memory events of a vLLM log."),
    "plan": ("flashnext.cli.plan", "plan", "Plan GPU and host memory for a vLLM deployment."),
    "ple": ("flashnext.cli.ple", "ple", "Inspect, quantize and query PLE sidecar tables."),
    "record": (
        "flashnext.cli.record",
        "record",
        "Capture what a server runs, diff two captures, restore one.",
    ),
    "validate": ("flashnext.cli.validate", "validate", "Validate a live server stage by stage."),
}


class _LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(_COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in _COMMANDS:
            return None
        module, attr, _ = _COMMANDS[cmd_name]
        return getattr(importlib.import_module(module), attr)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, _COMMANDS[name][2]) for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=_LazyGroup)
@click.version_option(__version__, prog_name="flashnext")
def cli() -> None:
    """flashnext: serve Flash-Next-class models reliably on one workstation GPU."""


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: run the CLI, turning flashnext errors into one line."""
    try:
        rv = cli.main(args=argv, prog_name="flashnext", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except FlashnextError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    if isinstance(rv, int):
        sys.exit(rv)

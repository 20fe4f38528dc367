"""``flashnext record``: capture what is running, diff two captures, restore one."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import click

from flashnext.cli._common import (
    err_console,
    json_option,
    old_spelling,
    out_console,
    say,
    server_url,
)
from flashnext.cli._destination import check_output
from flashnext.errors import FlashnextError
from flashnext.records import DEPLOY_RECORD_DIFF
from flashnext.user_files import JSON_LIMIT, read_user_text


@click.group("record")
def record() -> None:
    """Deployment records: capture, diff, restore."""


@record.command("capture")
@click.option("--url", required=True, help="The server's base URL, e.g. http://127.0.0.1:8000.")
@click.option("--container", help="Read the launch from `docker inspect NAME`.")
@click.option("--pid", type=click.IntRange(min=1), help="Read the launch from /proc/PID.")
@click.option("--model", "model_dir", type=click.Path(path_type=Path), help="Checkpoint directory.")
@click.option(
    "--log",
    type=click.Path(path_type=Path),
    help="Server log with the plugin's lines (default: a local process's stdout/stderr files).",
)
@click.option("--api-key", envvar="FLASHNEXT_API_KEY", help="Bearer key (or FLASHNEXT_API_KEY).")
@old_spelling("--out", "--output", "out", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--output",
    "out",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write the record to this file (else stdout).",
)
def capture(
    url: str, container: str | None, pid: int | None, model_dir: Path | None, log: Path | None,
    api_key: str | None, out: Path | None,
) -> None:  # fmt: skip
    """Capture a record of the server at URL (launch found by port when no --pid/--container)."""
    from flashnext.deploy.record import capture as do_capture
    from flashnext.records import dumps
    from flashnext.store.destination import write_text_locked

    if container and pid:
        raise click.UsageError("give at most one of --container and --pid")
    url = server_url(url)  # the root, as `validate --url` takes it: ".../v1" works too
    check_output(out, [model_dir, log], hint="--output", expect="file", owns=_is_record)
    rec = do_capture(
        url, pid=pid, container=container, model_dir=model_dir, log=log, api_key=api_key
    )
    text = dumps(rec)
    if out is None:
        sys.stdout.write(text)
        return
    write_text_locked(out, text)
    launch = rec.get("launch") or {}
    say(  # the closing summary: stdout, as in every command
        f"wrote {out}: server {rec['server'].get('version')}, launch from "
        f"{launch.get('source', 'nowhere (remote)')}"
    )


def _is_record(path: Path) -> bool:
    """Whether ``path`` holds a deployment record (one ``record capture`` may replace)."""
    try:
        _load(path)
    except (click.BadParameter, FlashnextError):
        return False
    return True


_SCRIPT_HEAD = "#!/usr/bin/env bash\nset -euo pipefail\n"


def _is_script(path: Path) -> bool:
    """Whether ``path`` is a script ``record restore --write`` wrote (it may replace it)."""
    try:
        with open(path, "rb") as fh:
            return fh.read(len(_SCRIPT_HEAD)) == _SCRIPT_HEAD.encode()
    except OSError:
        return False


def _load(path: Path) -> dict:
    from flashnext.deploy.record_diff import check_deployment_record

    try:
        data = json.loads(read_user_text(path, "a deployment record (record.json)", JSON_LIMIT))
    except OSError as exc:
        raise click.BadParameter(f"{path}: cannot read ({exc.strerror})") from None
    except ValueError as exc:
        raise click.BadParameter(f"{path}: not JSON ({exc})") from None
    return check_deployment_record(data, source=str(path))


@record.command("diff")
@click.argument("a", type=click.Path(path_type=Path))
@click.argument("b", type=click.Path(path_type=Path))
@json_option(DEPLOY_RECORD_DIFF)
def diff(a: Path, b: Path, as_json: bool) -> None:
    """What changed from record A to B, grouped; exit 1 when anything did."""
    from flashnext.deploy.record_diff import GROUPS, record_diff, variables_changed
    from flashnext.records import dumps, make_record

    changes = record_diff(_load(a), _load(b))
    n = variables_changed(changes)
    warning = (
        f"{n} variables changed between the two records: change one at a time to know which "
        "one a result belongs to"
        if n > 1
        else None
    )
    if as_json:
        payload = {"a": str(a), "b": str(b), "changes": changes, "variables_changed": n,
                   "warning": warning}  # fmt: skip
        sys.stdout.write(dumps(make_record(DEPLOY_RECORD_DIFF, payload)))
    else:
        for group in GROUPS:
            rows = [c for c in changes if c.group == group]
            if rows:
                out_console.print(f"{group}:", markup=False)
            for c in rows:
                kind = "" if c.variable else " (observed)"
                out_console.print(
                    f"  {c.name}{kind}: {c.before!r} -> {c.after!r}", markup=False, highlight=False
                )
        if not changes:
            out_console.print("no changes", markup=False)
        if warning:
            err_console.print(f"warning: {warning}", markup=False)
    sys.exit(1 if changes else 0)


@record.command("restore")
@click.argument("a", type=click.Path(path_type=Path))
@old_spelling("--write", "--output", "write_to", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--output",
    "write_to",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write the command as a script to this file (else stdout).",
)
@click.option("--exec", "do_exec", is_flag=True, help="Run it now (local launches only).")
def restore(a: Path, write_to: Path | None, do_exec: bool) -> None:
    """Print (or write) the command that relaunches what record A describes."""
    from flashnext.deploy.record_diff import restore_command
    from flashnext.store.destination import write_text_locked

    check_output(write_to, [a], hint="--output", expect="file", owns=_is_script)
    rec = _load(a)
    command = restore_command(rec)
    if write_to is not None:
        write_text_locked(write_to, f"{_SCRIPT_HEAD}{command}\n", mode=0o755)
        say(f"wrote {write_to}")
    else:
        out_console.print(command, markup=False, highlight=False, soft_wrap=True)
    if do_exec:
        if (rec.get("launch") or {}).get("source") == "container":
            raise click.UsageError(
                "--exec runs local launches only; run the docker command yourself"
            )
        os.execvp("bash", ["bash", "-c", command])

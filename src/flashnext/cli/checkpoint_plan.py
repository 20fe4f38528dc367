"""``flashnext checkpoint plan``: what to download, and the ``hf download`` command that skips
the PLE table shards a sidecar replaces."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import click

from flashnext.cli._common import SIDECAR, err_console, human_bytes, json_option, out_console
from flashnext.records import CHECKPOINT_PLAN


@click.command("plan")
@click.argument("index_or_dir", type=click.Path(path_type=Path))
@click.option(
    "--sidecar",
    "sidecars",
    multiple=True,
    type=click.Path(path_type=Path),
    metavar=SIDECAR,
    help="A sidecar that will serve a PLE table (repeatable): checked against config.json.",
)
@click.option("--repo", "repo_id", help="Hub repository id (default: from a hub cache path).")
@click.option("--local-dir", help="Where `hf download` should write.")
@json_option(CHECKPOINT_PLAN)
def checkpoint_plan(
    index_or_dir: Path, sidecars: tuple[Path, ...], repo_id: str | None, local_dir: str | None,
    as_json: bool,
) -> None:  # fmt: skip
    """List a checkpoint's files from model.safetensors.index.json (no hub access) and print
    the `hf download` command that skips files holding only PLE table tensors."""
    from flashnext.checkpoint.download_plan import check_sidecar, plan_download
    from flashnext.records import dumps, make_record

    # The plugin's own check (vLLM-free), so that "ok" here means the plugin will serve it.
    from flashnext.serve.serving import check_geometry

    result = plan_download(index_or_dir, repo_id)
    covers = [check_sidecar(result, s, check_geometry) for s in sidecars]
    command = result.hf_download_command(local_dir)
    if as_json:
        payload = {
            "index": str(result.index),
            "repo_id": result.repo_id,
            "total_size": result.total_size,
            "files": [{**vars(f), "role": f.role} for f in result.files],
            "skip": [f.name for f in result.skippable],
            "sidecars": covers,
            "hf_download": command,
            "notes": result.notes,
        }
        sys.stdout.write(dumps(make_record(CHECKPOINT_PLAN, payload)))
    else:
        for f in result.files:
            size = "not on disk" if f.size is None else human_bytes(f.size)
            out_console.print(
                f"{f.role:9} {f.name}  {f.tensors} tensors ({f.ple_tensors} PLE)  {size}",
                markup=False, highlight=False,
            )  # fmt: skip
        if result.total_size is not None:
            out_console.print(f"total (index): {human_bytes(result.total_size)}", markup=False)
        for c in covers:
            err_console.print(("ok: " if c.ok else "MISMATCH: ") + c.message, markup=False)
        for note in result.notes:
            err_console.print(f"note: {note}", markup=False, highlight=False)
        out_console.print(shlex.join(command), markup=False, highlight=False)
    if any(not c.ok for c in covers):
        sys.exit(1)

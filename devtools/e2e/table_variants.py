"""Rewrite a tiny Qwen4Exp checkpoint's PLE table into a layout stock vLLM may refuse.

Run in the e2e runtime (torch): ``python table_variants.py VARIANT SRC DST [--long-prefix]``.
Copies checkpoint SRC to DST (temp name, renamed when complete), with the n-gram table stored as:

- ``empty-shard``: one tensor ``...ngram_embedding.shard_.weight`` holding the numbered shards
  concatenated in order (the spelling some checkpoints ship; vLLM 0.32 rejects it);
- ``fp8``: the numbered shards as float8_e4m3fn rows plus one global fp32
  ``...ngram_embedding.weight_scale`` (amax / 448), with ``ple_embedding_dtype`` in config.json.

``--long-prefix`` also renames every table tensor from ``model.layers.`` to
``model.language_model.layers.`` (the VL spelling).
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

SHARD = re.compile(r"^(?P<stem>.*\.ngram_embedding\.)shard_(?P<k>\d+)\.weight$")
E4M3_MAX = 448.0


def _tables(tensors: dict) -> tuple[str, list[str]]:
    """The table's name stem and its numbered shard names in shard order."""
    shards = sorted((int(m["k"]), name) for name in tensors if (m := SHARD.match(name)) is not None)
    if not shards:
        raise SystemExit("table_variants.py: no numbered ngram_embedding shards in the checkpoint")
    stem = SHARD.match(shards[0][1])["stem"]  # type: ignore[index]
    return stem, [name for _, name in shards]


def rewrite(tensors: dict, variant: str, config: dict) -> dict:
    """The checkpoint's tensors in ``variant``'s layout (``config`` updated in place)."""
    import torch

    stem, names = _tables(tensors)
    out = {k: v for k, v in tensors.items() if k not in names}
    if variant == "empty-shard":
        out[stem + "shard_.weight"] = torch.cat([tensors[n] for n in names]).contiguous()
    elif variant == "fp8":
        scale = max(float(tensors[n].float().abs().max()) for n in names) / E4M3_MAX
        for n in names:
            out[n] = (tensors[n].float() / scale).to(torch.float8_e4m3fn)
        out[stem + "weight_scale"] = torch.tensor(scale, dtype=torch.float32)
        config["ple_embedding_dtype"] = "float8_e4m3fn"
    else:
        raise SystemExit(f"table_variants.py: unknown variant {variant!r} (empty-shard, fp8)")
    return out


def main(variant: str, src: Path, dst: Path, long_prefix: bool) -> None:
    """Write DST from SRC (see the module docstring)."""
    from safetensors.torch import load_file, save_file

    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    config = json.loads((tmp / "config.json").read_text())
    for path in sorted(tmp.glob("*.safetensors")):
        tensors = rewrite(load_file(path), variant, config)
        if long_prefix:
            tensors = {
                (k.replace("model.layers.", "model.language_model.layers.", 1)
                 if ".ngram_embedding." in k else k): v
                for k, v in tensors.items()
            }  # fmt: skip
        save_file(tensors, path, {"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    shutil.rmtree(dst, ignore_errors=True)
    tmp.rename(dst)


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--long-prefix"]
    if len(args) != 3:
        sys.exit("usage: table_variants.py {empty-shard,fp8} SRC DST [--long-prefix]")
    main(args[0], Path(args[1]), Path(args[2]), "--long-prefix" in sys.argv[1:])

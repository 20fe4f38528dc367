"""Synthetic PLE tables and configs with the real geometry scaled down (demo, tests, benches)."""

from __future__ import annotations

from typing import Any

import numpy as np


def flash_next_config(
    vocab_size: int = 248320,
    eos_token_id: int = 248044,
    ngram_vocab_size_base: int = 20_000_000,
    ple_layer_ids: list[int] | None = None,
    split_ngram_parts: int = 128,
) -> dict[str, Any]:
    """A text config with the released model's PLE fields; shrink it via ``ngram_vocab_size_base``."""
    return {
        "model_type": "qwen4_exp_text",
        "vocab_size": vocab_size,
        "eos_token_id": eos_token_id,
        "ngram_size": 3,
        "heads_per_ngram": 8,
        "ngram_vocab_size_base": ngram_vocab_size_base,
        "make_ngram_vocab_size_divisible_by": 128,
        "seed": 1234,
        "split_ngram_parts": split_ngram_parts,
        "ple_embed_dim": 2560,
        "ple_layer_ids": ple_layer_ids if ple_layer_ids is not None else [12, 24, 36, 48],
    }


def embedding_rows(num_rows: int, width: int, rng: np.random.Generator) -> np.ndarray:
    """float32 [num_rows, width] that look like a trained embedding table.

    Entries are heavy-tailed (Student t, 4 degrees of freedom), a few columns carry larger
    scale (outlier channels), and row norms vary log-normally over about two decades.
    """
    rows = rng.standard_t(4, size=(num_rows, width)).astype(np.float32)
    channel = np.ones(width, dtype=np.float32)
    channel[rng.choice(width, size=max(1, width // 32), replace=False)] = 4.0
    norms = np.exp(rng.normal(-3.5, 0.8, size=(num_rows, 1))).astype(np.float32)
    rows *= channel
    rows *= norms / np.sqrt((rows * rows).mean(axis=1, keepdims=True) + 1e-12)
    return rows

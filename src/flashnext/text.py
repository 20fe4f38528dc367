"""Local text and the demo tokenizer, shared by ``flashnext demo`` and PLE profiling.

Text found on this machine (licence texts, the Python standard library's sources) stands in
for real prompts, and a byte-level BPE trained on it gives token streams with the statistics of
real text; no download. :mod:`flashnext.demo` times lookups with it and
:mod:`flashnext.store.profile` uses the same tokenizer for a table with the demo's vocabulary.
"""

from __future__ import annotations

import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from flashnext._extras import require

#: The demo tokenizer's one special token, ending every document.
EOS = "<|endoftext|>"


def corpus_roots() -> list[Path]:
    """Where :func:`corpus_files` reads: inputs a writing command's destination stays clear of."""
    return [Path("/usr/share/common-licenses"), Path(sysconfig.get_paths()["stdlib"])]


def corpus_files(limit_bytes: int = 6_000_000) -> list[Path]:
    """Text files on this machine: licence texts and the Python standard library's sources."""
    roots = corpus_roots()
    files: list[Path] = []
    total = 0
    for root in roots:
        if not root.is_dir():
            continue
        pattern = "*" if root.name == "common-licenses" else "*.py"
        for path in sorted(root.glob(pattern)):
            if path.is_file() and not path.is_symlink():
                size = path.stat().st_size
                if 0 < size < 400_000:
                    files.append(path)
                    total += size
            if total >= limit_bytes:
                return files
    return files


def documents(files: list[Path]) -> Iterator[str]:
    """Each file's text (undecodable bytes replaced); unreadable files are left out."""
    for path in files:
        try:
            yield path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue


def train_tokenizer(files: list[Path], vocab_size: int = 8192) -> Any:
    """A byte-level BPE (a ``tokenizers.Tokenizer``) with one special token, :data:`EOS`,
    trained on ``files``."""
    tokenizers = require("tokenizers", "demo", "flashnext demo")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(documents(files), trainer=trainer)
    return tok


def token_stream(tok: Any, files: list[Path], eos_id: int) -> np.ndarray:
    """int64 [T]: the documents of ``files`` tokenized and joined by EOS, as a serving engine
    would see them."""
    stream: list[int] = []
    for enc in tok.encode_batch(list(documents(files))):
        stream.extend(enc.ids)
        stream.append(eos_id)
    return np.array(stream, dtype=np.int64)

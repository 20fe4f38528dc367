"""Token ids from local text for bench/gpu_lookup.py (no GPU needed; needs ``tokenizers``).

    python bench/text_tokens.py OUT.npy [--text-bytes N]

Trains ``flashnext demo``'s byte-level BPE on the demo corpus (licence texts and the standard
library's top-level modules), then tokenizes that corpus plus the standard library's
subpackages (tests skipped) up to ``--text-bytes``: documents joined by EOS, int32, with
``OUT.json`` beside it (vocab size, EOS id, files, bytes, tokens).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def text_files(limit_bytes: int) -> list[Path]:
    """``flashnext demo``'s corpus, then the standard library's subpackages (tests skipped)."""
    import sysconfig

    from flashnext.text import corpus_files

    files = corpus_files()
    total, seen = sum(p.stat().st_size for p in files), set(files)
    for p in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        if total >= limit_bytes:
            break
        if p not in seen and "test" not in p.parts and p.is_file() and not p.is_symlink():
            size = p.stat().st_size
            if 0 < size < 400_000:
                files.append(p)
                total += size
    return files


def make_tokens(path: Path, limit_bytes: int) -> None:
    """Tokenize local text with the demo's BPE (trained on the demo corpus); write tokens + .json."""
    from flashnext.text import EOS, corpus_files, documents, train_tokenizer

    tok = train_tokenizer(corpus_files())
    eos = tok.token_to_id(EOS)
    files = text_files(limit_bytes)
    stream: list[int] = []
    for enc in tok.encode_batch(list(documents(files))):
        stream.extend(enc.ids)
        stream.append(eos)
    np.save(path, np.array(stream, dtype=np.int32))
    meta = {"vocab_size": tok.get_vocab_size(), "eos_token_id": eos, "files": len(files),
            "bytes": sum(p.stat().st_size for p in files), "tokens": len(stream)}  # fmt: skip
    path.with_suffix(".json").write_text(json.dumps(meta))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--text-bytes", type=int, default=24_000_000)
    args = ap.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    make_tokens(args.out, args.text_bytes)
    print(json.loads(args.out.with_suffix(".json").read_text()))


if __name__ == "__main__":
    main()

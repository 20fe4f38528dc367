"""Token ids from local text for bench/gpu_lookup.py (no GPU needed; needs ``tokenizers``).

    python bench/text_tokens.py OUT.npy [--text-bytes N] [--extra DIR ...]

Trains ``flashnext demo``'s byte-level BPE on the demo corpus (licence texts and the standard
library's top-level modules), then tokenizes that corpus plus the standard library's
subpackages (tests skipped), then the Python sources under each ``--extra`` directory (a
venv's site-packages, say: more documents of the same kind of text, for a hot-row profile big
enough to fill a 2 GB cache), up to ``--text-bytes``: documents joined by EOS, with
``OUT.json`` beside it (vocab size, EOS id, files, bytes, tokens). The ids are uint16 when the
vocabulary fits (it does: 8,192), else int32, so a 64 MB text stays a 37 MB file.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np


def text_files(limit_bytes: int, extra: Sequence[Path] = ()) -> list[Path]:
    """``flashnext demo``'s corpus, then the standard library's subpackages, then the Python
    sources under each of ``extra`` (tests skipped, each tree in sorted order), until
    ``limit_bytes``."""
    import sysconfig

    from flashnext.text import corpus_files

    files = corpus_files()
    total, seen = sum(p.stat().st_size for p in files), {p.resolve() for p in files}
    for root in [Path(sysconfig.get_paths()["stdlib"]), *extra]:
        for p in sorted(root.rglob("*.py")):
            if total >= limit_bytes:
                return files
            if p.resolve() in seen or "test" in p.relative_to(root).parts:
                continue
            if p.is_file() and not p.is_symlink() and 0 < p.stat().st_size < 400_000:
                files.append(p)
                seen.add(p.resolve())
                total += p.stat().st_size
    return files


def make_tokens(path: Path, limit_bytes: int, extra: Sequence[Path] = ()) -> None:
    """Tokenize local text with the demo's BPE (trained on the demo corpus); write tokens + .json."""
    from flashnext.text import EOS, corpus_files, documents, train_tokenizer

    tok = train_tokenizer(corpus_files())
    eos = tok.token_to_id(EOS)
    files = text_files(limit_bytes, extra)
    stream: list[int] = []
    for enc in tok.encode_batch(list(documents(files))):
        stream.extend(enc.ids)
        stream.append(eos)
    dtype = np.uint16 if tok.get_vocab_size() <= 1 << 16 else np.int32
    np.save(path, np.array(stream, dtype=dtype))
    meta = {"vocab_size": tok.get_vocab_size(), "eos_token_id": eos, "files": len(files),
            "bytes": sum(p.stat().st_size for p in files), "tokens": len(stream)}  # fmt: skip
    path.with_suffix(".json").write_text(json.dumps(meta))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--text-bytes", type=int, default=24_000_000)
    ap.add_argument(
        "--extra",
        type=Path,
        action="append",
        default=[],
        metavar="DIR",
        help="more Python sources, after the standard library's (repeatable)",
    )
    args = ap.parse_args()
    for root in args.extra:
        if not root.is_dir():
            ap.error(f"--extra {root}: not a directory")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    make_tokens(args.out, args.text_bytes, args.extra)
    print(json.loads(args.out.with_suffix(".json").read_text()))


if __name__ == "__main__":
    main()

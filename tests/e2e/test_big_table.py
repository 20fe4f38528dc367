"""devtools/e2e/big_table.py against references: HF's own build for the geometry, torch's
float->bfloat16 conversion for the values.

The suite's ``tiny`` (n-gram base 2048) gets a streamed table of base 1024 here; the suite's
``geometry`` checkpoint is HF's own build at base 1024 (same seed, so every other weight is
tiny's). The streamed checkpoint must hold geometry's tensor names, shapes, dtypes and n-gram
buffers, tiny's other weights, and table rows equal to torch's bf16 of the same PCG64 draws.
The 5.12 GB build the small-hardware test serves is the same code at base 40M.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from devtools.e2e import big_table
from devtools.e2e.runtime import E2eRuntime

CHECK = r"""
import json, sys
from pathlib import Path
import numpy as np
import torch
from safetensors import safe_open

sys.path.insert(0, sys.argv[1])
from big_table import CHUNK_ROWS, bf16_bits

streamed, hf, tiny, seed = Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]), int(sys.argv[5])

def tensors(root):
    out = {}
    for path in sorted(root.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out

got, ref, small = tensors(streamed), tensors(hf), tensors(tiny)
report = {"names": sorted(got) == sorted(ref), "shapes": [], "buffers": [], "others": []}
for name, t in ref.items():
    if (t.shape, t.dtype) != (got[name].shape, got[name].dtype):
        report["shapes"].append([name, list(t.shape), list(got[name].shape)])
    if "ngram_heads" in name and not torch.equal(t, got[name]):
        report["buffers"].append(name)
    if "ngram" not in name and not torch.equal(small[name], got[name]):
        report["others"].append(name)
# the table: torch's bf16 of the same draws (shard by shard, chunk by chunk)
rng = np.random.Generator(np.random.PCG64(seed))
std = json.loads((streamed / "flashnext_tiny.json").read_text())["table_std"]
shards = sorted((n for n in got if ".ngram_embedding.shard_" in n), key=lambda n: int(n.split("shard_")[1].split(".")[0]))
mismatched = 0
for name in shards:
    rows, width = got[name].shape
    parts = []
    for start in range(0, rows, CHUNK_ROWS):
        x = rng.standard_normal(min(CHUNK_ROWS, rows - start) * width, dtype=np.float32)
        parts.append(torch.from_numpy(x * np.float32(std)).to(torch.bfloat16))
    want = torch.cat(parts).view(rows, width)
    mismatched += int((want.view(torch.int16) != got[name].view(torch.int16)).sum())
report["table_mismatches"] = mismatched
report["table_std"] = float(torch.cat([got[n].float().flatten() for n in shards]).std())
# the rounding on fresh float32 bit patterns, ties included (low 16 bits 0x8000)
bits = np.random.default_rng(seed).integers(0, 2**32, 1 << 20, dtype=np.uint64).astype(np.uint32)
bits[::4] = (bits[::4] & np.uint32(0xFFFF0000)) | np.uint32(0x8000)
x = bits.view(np.float32)
x = x[np.isfinite(x)]
want = torch.from_numpy(x.copy()).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
report["rounding_mismatches"] = int((bf16_bits(x.copy()) != want).sum())
report["rounding_ties"] = int(((x.view(np.uint32) & np.uint32(0xFFFF)) == 0x8000).sum())
print(json.dumps(report))
"""


def test_the_streamed_table_matches_hf_and_torch(
    e2e_runtime: E2eRuntime, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    seed = 7
    out = tmp_path / "streamed"
    # HF's own build of the same geometry (n-gram base 1024): names, shapes and buffers to match
    reference = e2e_runtime.build_tiny_qwen4exp(tmp_path / "hf", seed=0, ngram_vocab_size_base=1024)
    e2e_runtime.run(
        [str(e2e_runtime.python), big_table.__file__, str(checkpoints["tiny"]), str(out),
         "1024", str(seed)]
    )  # fmt: skip
    config = json.loads((out / "config.json").read_text())
    assert config == json.loads((reference / "config.json").read_text())
    done = subprocess.run(
        [str(e2e_runtime.python), "-c", CHECK, str(Path(big_table.__file__).parent), str(out),
         str(reference), str(checkpoints["tiny"]), str(seed)],
        capture_output=True, text=True, env={**os.environ, **e2e_runtime.env()},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["names"] and not report["shapes"] and not report["buffers"], report
    assert not report["others"], report
    assert report["table_mismatches"] == 0 and abs(report["table_std"] - 0.1) < 0.005, report
    assert report["rounding_mismatches"] == 0 and report["rounding_ties"] > 100_000, report

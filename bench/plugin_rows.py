"""The plugin's row lookups per placement on a GPU: what each ``FLASHNEXT_PLE_PLACEMENT`` costs.

    python bench/plugin_rows.py [--formats bf16,int4] [--tokens 8,2048] [--repeats 20] [--json]

Builds one sidecar per format from fresh random rows (a 20,000-base geometry: 320,256 rows of
width 160), opens it as the plugin does and times :class:`SidecarRows.lookup` (what the
plugin's ``start_prefetch`` / ``forward`` call) for each placement the plugin's
``choose_placement`` accepts here, with ids hashed as vLLM hashes them. Prints the median (and
range) of ``--repeats`` synchronised lookups per case, and each against ``device``, the same-run
baseline. Moved out of tests/integrations/test_plugin_gpu.py (a benchmark, not a test).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from _common import say

from flashnext.kernels.records import record_layout
from flashnext.ple import open_table, write_sidecar
from flashnext.ple.geometry import PLEGeometry
from flashnext.ple.hashing import ngram_ids_packed
from flashnext.serve.serving import SidecarRows, choose_placement
from flashnext.synthetic import embedding_rows, flash_next_config

CONFIG = flash_next_config(ngram_vocab_size_base=20_000)
PLACEMENTS = ("device", "pinned", "staged", "auto")


def _csv(kind: type, text: str) -> list:
    return [kind(v) for v in text.split(",") if v]


def time_case(rows: SidecarRows, ids: object, out: object, repeats: int) -> list[float]:
    """Microseconds of ``repeats`` synchronised lookups (after two warm-up calls)."""
    import torch

    times = []
    for _ in range(repeats + 2):
        torch.cuda.synchronize()
        t = time.perf_counter()
        rows.lookup(ids, out)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e6)
    return times[2:]


def run(args: argparse.Namespace) -> list[dict]:
    import torch

    geometry = PLEGeometry.from_config(CONFIG)
    seed = int(np.random.SeedSequence().entropy % 2**32)
    say(f"seed {seed}; {geometry.num_rows} rows x {geometry.width}")
    rng = np.random.default_rng(seed)
    rows = embedding_rows(geometry.num_rows, geometry.width, rng)
    device = torch.device("cuda")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for fmt in args.formats:
            sidecar = write_sidecar(
                Path(tmp) / fmt, fmt, rows, geometry.shard_rows(), geometry=geometry.to_dict()
            )
            table = open_table(sidecar)
            nbytes = geometry.num_rows * record_layout(table.codec, table.width).record_bytes
            base: dict[int, float] = {}
            for placement in PLACEMENTS:
                free = torch.cuda.mem_get_info()[0]
                choice = choose_placement(placement, device, nbytes, free)
                served = SidecarRows(table, choice, device, max(args.tokens) * geometry.num_heads)
                for t in args.tokens:
                    toks = rng.integers(0, CONFIG["vocab_size"], size=t)
                    qsl = np.linspace(0, t, 5).astype(np.int64)
                    ids = torch.from_numpy(ngram_ids_packed(geometry, toks, qsl)).cuda()
                    out = torch.empty(t, geometry.num_heads * geometry.width,
                                      dtype=torch.bfloat16, device=device)  # fmt: skip
                    times = time_case(served, ids, out, args.repeats)
                    med = statistics.median(times)
                    base.setdefault(t, med)
                    results.append({
                        "format": fmt, "placement": placement, "served_as": choice.placement,
                        "tokens": t, "median_us": round(med, 1), "min_us": round(min(times), 1),
                        "max_us": round(max(times), 1), "vs_device": round(med / base[t], 2),
                    })  # fmt: skip
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", type=lambda s: _csv(str, s), default=["bf16", "int4"])
    parser.add_argument("--tokens", type=lambda s: _csv(int, s), default=[8, 2048])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", action="store_true", help="one JSON record on stdout")
    args = parser.parse_args()
    try:
        import torch
    except ImportError:
        print("error: bench/plugin_rows.py needs torch: pip install 'flashnext[gpu]'", file=sys.stderr)
        sys.exit(1)
    if not torch.cuda.is_available():
        print("error: bench/plugin_rows.py needs a CUDA GPU", file=sys.stderr)
        sys.exit(1)
    results = run(args)
    if args.json:
        print(json.dumps({"kind": "bench.plugin_rows", "gpu": torch.cuda.get_device_name(),
                          "results": results}))  # fmt: skip
        return
    print(f"{'format':7} {'placement':9} {'as':7} {'T':>6} {'median us':>10} {'range':>15} {'x dev':>6}")
    for r in results:
        print(f"{r['format']:7} {r['placement']:9} {r['served_as']:7} {r['tokens']:>6} "
              f"{r['median_us']:>10} {r['min_us']:>7}-{r['max_us']:<7} {r['vs_device']:>6}")  # fmt: skip


if __name__ == "__main__":
    main()

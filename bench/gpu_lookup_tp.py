"""Two (or more) GPUs: per-rank GpuTables over contiguous row ranges, all-reduced, vs one GPU.

    torchrun --nproc-per-node 2 bench/gpu_lookup_tp.py [--rows N] [--repeats K]

Keep NVLink multicast off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1). Checks:
for every format and both placements, rank r serves rows [r*P, (r+1)*P) of one real sidecar
(fresh random rows, seed printed) and the all-reduce (sum) of the ranks' bf16 outputs equals
the whole-table lookup on one GPU bit for bit (a sum turns -0.0 into +0.0, so -0.0 is
compared as +0.0). Then times lookup + all-reduce per rank for T in {32, 512, 8192, 65536}
x 16 heads from ``--rows`` int4 rows split across the ranks in device memory, against the
same lookup of the whole table on one GPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

import numpy as np
from _common import shard_rows_for

from flashnext.host import open_table
from flashnext.ple.formats import get_codec
from flashnext.store import write_sidecar
from flashnext.synthetic import embedding_rows

try:  # --help runs without torch
    import torch
    import torch.distributed as dist

    from flashnext.kernels import GpuTable
except ImportError:
    torch = dist = GpuTable = None

HEADS, WIDTH = 16, 160


def check_exact(rank: int, world: int, root: Path, seed: int) -> None:
    rows = 1000
    if rank == 0:
        x = embedding_rows(rows, WIDTH, np.random.default_rng(seed))
        for fmt in ("bf16", "fp8", "int4", "nvfp4"):
            write_sidecar(root / fmt, fmt, x, shard_rows_for(rows))  # bench/_common.py's layout
    dist.barrier()
    per = rows // world
    lo, hi = rank * per, rows if rank == world - 1 else (rank + 1) * per
    ids = torch.randint(-1, rows, (257, HEADS), device="cuda", generator=None)
    dist.broadcast(ids, 0)
    for fmt in ("bf16", "fp8", "int4", "nvfp4"):
        for placement in ("device", "pinned"):
            table = open_table(root / fmt, row_range=(lo, hi))
            part = GpuTable.from_table(table, placement).lookup(ids)
            dist.all_reduce(part)
            whole = GpuTable.from_table(open_table(root / fmt), placement).lookup(ids)
            want = whole.view(torch.int16)
            want = torch.where(want == -32768, torch.zeros_like(want), want)  # -0.0 -> +0.0
            ok = torch.equal(part.view(torch.int16), want)
            if rank == 0:
                print(
                    f"exact {fmt:>5} {placement:>6}: all-reduce of {world} ranks == one GPU: {ok}"
                )
            if not ok:
                raise SystemExit(f"rank {rank}: {fmt} {placement} differs from the one-GPU lookup")


def time_it(fn, repeats: int) -> list[float]:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return times


def timing(rank: int, world: int, rows: int, repeats: int) -> None:
    codec = get_codec("int4")
    rec = codec.bytes_per_row(WIDTH)
    per = rows // world
    lo, hi = rank * per, rows if rank == world - 1 else (rank + 1) * per
    part = GpuTable.from_records(
        codec, WIDTH, torch.randint(0, 256, (hi - lo, rec), dtype=torch.uint8, device="cuda"),
        (lo, hi), rows,
    )  # fmt: skip
    whole = None
    if rank == 0:
        records = torch.randint(0, 256, (rows, rec), dtype=torch.uint8, device="cuda")
        whole = GpuTable.from_records(codec, WIDTH, records, (0, rows), rows)
    for t in (32, 512, 8192, 65536):
        ids = torch.randint(0, rows, (t, HEADS), device="cuda")
        dist.broadcast(ids, 0)
        out = torch.empty(t, HEADS * WIDTH, dtype=torch.bfloat16, device="cuda")

        def step(ids=ids, out=out) -> None:
            part.lookup(ids, out=out)
            dist.all_reduce(out)

        tp = time_it(step, repeats)
        if rank == 0 and whole is not None:
            one = time_it(lambda ids=ids, out=out: whole.lookup(ids, out=out), repeats)
            print(f"T={t:>5}: {world} ranks lookup+all-reduce {statistics.median(tp):9.1f} us "
                  f"[{min(tp):.1f}..{max(tp):.1f}]; one GPU lookup {statistics.median(one):9.1f} us "
                  f"[{min(one):.1f}..{max(one):.1f}]", flush=True)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=160_000_000)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    if torch is None or not torch.cuda.is_available():
        raise SystemExit(
            "error: gpu_lookup_tp.py needs torch with CUDA GPUs (run it with torchrun)"
        )
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    seed = int(np.random.SeedSequence().entropy % 2**32)
    if rank == 0:
        print(f"{world} x {torch.cuda.get_device_name()}, seed {seed}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        shared = [tmp]
        dist.broadcast_object_list(shared, 0)
        check_exact(rank, world, Path(shared[0]), seed)
        dist.barrier()
    timing(rank, world, args.rows, args.repeats)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

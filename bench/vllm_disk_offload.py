"""Benchmark: vLLM 0.34's own disk offload against flashnext's staged tables, same files, same run.

    python bench/vllm_disk_offload.py --tokens TOKENS.npy [--formats nvfp4,fp8] [--rows N]
        [--sizes 32,512,8192] [--cold-steps K] [--root DIR] [--seed S] [--json PATH]

Needs a CUDA GPU and vLLM 0.34 (``devtools/vllm_gpu_carry.py --vllm 0.34.0`` packs its Python
tree for a GPU machine without vLLM). Per format (nvfp4, then fp8; each format's files are
deleted before the next, so the two full tables need not fit on the disk together):

- one table of ``--rows`` rows (default the released 320,001,536) in the released shard layout
  (128 files of 2,500,012 rows, every shard the same random bytes: timings depend on which
  addresses are read, not on the values), written as a flashnext sidecar;
- vLLM's ``Qwen4ExpPLEDiskOffloadEmbedding`` (the class from vLLM's tree, not a copy) is given
  each shard file's row planes as vLLM's loader gives them: ``safe_open(...).get_tensor`` views
  (private maps of the file) through ``accept_checkpoint_shard``, then
  ``process_weights_after_loading`` (``bind_file_shards``: one fd per file, the views dropped).
  The planes are the checkpoint's: nvfp4 ``weight`` uint8 [rows, 80] and ``weight_scale`` e4m3
  [rows, 10] (the sidecar's ``weight_e2m1`` / ``weight_scale`` hold exactly those bytes) with one
  global ``weight_scale_2``; fp8 ``weight`` e4m3 [rows, 160] (the sidecar's ``weight_fp8``) with
  one global ``weight_scale``. So both sides read the same files through the same page cache;
  flashnext's fp8 rows also read their per-row fp32 scale.
- A vLLM step = ``copy_ids_to_host`` + ``stage_rows`` (``unique``, WILLNEED per page run, one
  ``os.preadv`` per distinct row and plane, ``index_select`` into pinned rows, copy to the fixed
  device buffers) + ``staged_rows`` (the nvfp4 decode) + fp8's ``dequantize``, then a
  synchronize: what ``stage_checkpoint_rows`` and the PLE layer's forward do, less the GPU hash
  and the id copy's stream sync, which both sides would pay alike.
- flashnext: ``StagedTable`` (stage + lookup + synchronize) and ``GraphStagedTable`` (the
  captured lookup is replayed first and waits on the flag while the host stages), each without
  and with a 2 GB device cache of the text's hot rows (``set_device_cache`` / ``share_cache``).
  Outputs are bf16 [T, 2560] on every side.

Ids: uniform over the table, and real text (``--tokens``, from ``bench/text_tokens.py``: the
first half of the stream profiles the hot rows, steps are drawn from the second), T in
``--sizes`` tokens x 16 heads. Every timed step has fresh ids, the same for every side. Warm:
the files in the page cache as just written; median of the steps, [min..max]. Cold: before each
side's first ``--cold-steps`` steps the shard files are evicted (fsync + POSIX_FADV_DONTNEED;
the bytes still cached are recorded: pages a live map has touched cannot be dropped), and
each of those steps is timed. Ratios are vLLM's step time over ours, in the same run.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import gc
import json
import os
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from _common import RELEASED_SHARDS, build_repeated, positive_int, shard_rows_for

from flashnext import __version__
from flashnext.host import open_table
from flashnext.host.preflight import page_cache_bytes

HEADS, WIDTH = 16, 160
ROWS = 320_001_536
CACHE_BYTES = 2 << 30
MADV_DONTNEED = 4
#: Timed steps per T (warm): more for short steps, few for vLLM's 8K prefill (~0.6 s each).
STEPS = {32: 50, 512: 20, 8192: 6}
#: vLLM's plane -> the sidecar tensor holding the same bytes, per format.
PLANES = {"nvfp4": {"weight": "weight_e2m1", "weight_scale": "weight_scale"},
          "fp8": {"weight": "weight_fp8"}}  # fmt: skip


def comma_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=Path, required=True, help="bench/text_tokens.py output")
    ap.add_argument("--formats", default="nvfp4,fp8", help="comma list of nvfp4, fp8")
    ap.add_argument("--rows", type=positive_int, default=ROWS, help="table rows (default released)")
    ap.add_argument("--sizes", type=comma_ints, default=[32, 512, 8192], help="tokens per step")
    ap.add_argument("--cold-steps", type=positive_int, default=2, help="steps timed after eviction")
    ap.add_argument("--cold-hints", default="off",
                    help="comma list of our cold_hints modes (off, on, auto), each timed cold")
    ap.add_argument("--warm-hints", default="off", help="our cold_hints mode in the warm steps")
    ap.add_argument("--root", type=Path, default=Path("/tmp/flashnext-vllm-disk-offload"),
                    help="where the tables are written (deleted after each format)")  # fmt: skip
    ap.add_argument("--seed", type=int, default=None, help="id and table seed (default random)")
    ap.add_argument("--json", type=Path, default=None, help="write every timing here")
    return ap


# -- vLLM's side -----------------------------------------------------------------------------
def vllm_world() -> None:
    """vLLM's process groups for a world of one, as its layers need them."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from devtools.vllm_cpu import free_port

    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(1, 0, f"tcp://127.0.0.1:{free_port()}", 0, backend="gloo")
        ensure_model_parallel_initialized(1, 1)


def vllm_disk_offload(fmt: str, path: Path, rows: int, max_tokens: int) -> Any:
    """vLLM's ``Qwen4ExpPLEDiskOffloadEmbedding`` over the sidecar's shard files, loaded and
    bound as vLLM's loader does."""
    import torch
    from safetensors import safe_open
    from vllm.config import EngramConfig, VllmConfig, set_current_vllm_config
    from vllm.models.qwen4_exp.common.ngram_embedding import (
        Qwen4ExpPLEFp8EmbeddingMethod,
        Qwen4ExpPLENvFp4EmbeddingMethod,
    )
    from vllm.models.qwen4_exp.nvidia.ngram_embedding import Qwen4ExpPLEDiskOffloadEmbedding

    config = VllmConfig()
    config.engram_config = EngramConfig(disk_offload=True)
    method = Qwen4ExpPLENvFp4EmbeddingMethod() if fmt == "nvfp4" else Qwen4ExpPLEFp8EmbeddingMethod()
    with set_current_vllm_config(config), torch.device("cuda"):
        emb = Qwen4ExpPLEDiskOffloadEmbedding(
            rows, WIDTH, params_dtype=torch.bfloat16, padding_size=128,
            prefix="model.layers.0.ple.ple_embedding.ngram_embedding",
            embedding_method=method, num_ngram_heads=HEADS, max_total_tokens=max_tokens,
        )  # fmt: skip
    shard_rows = shard_rows_for(rows)
    files = sorted(path.glob("shard_*.safetensors"), key=lambda p: int(p.stem.split("_")[1]))
    scale_2 = 1.0
    for k, file in enumerate(files):
        with safe_open(str(file), "pt") as f:
            for plane, tensor in PLANES[fmt].items():
                emb.accept_checkpoint_shard(k, f.get_tensor(tensor), shard_rows, plane)
            if fmt == "nvfp4":
                scale_2 = float(f.get_tensor("weight_scale_2"))
    global_scale = emb.weight_scale_2 if fmt == "nvfp4" else emb.weight_scale
    global_scale.data.fill_(scale_2)  # the checkpoint's one global scale
    emb.embedding_method.process_weights_after_loading(emb)  # bind_file_shards
    gc.collect()  # the loader's views are gone: only the fds remain
    return emb


def vllm_step(emb: Any, fmt: str, ids: np.ndarray) -> Any:
    """One step of vLLM's disk offload for host ids [T, 16]; bf16 [T, 2560] on the GPU."""
    import torch

    t = ids.shape[0]
    emb.copy_ids_to_host(torch.from_numpy(ids))
    emb.stage_rows(t)
    rows = emb.staged_rows(t)
    if fmt == "fp8":
        rows = emb.dequantize(rows, torch.bfloat16)
    torch.cuda.synchronize()
    return rows


# -- flashnext's side ------------------------------------------------------------------------
class Ours:
    """One of flashnext's staged tables over the sidecar (its own maps of the files): a
    ``StagedTable``, with or without the 2 GB device cache, and the ``GraphStagedTable``
    lookups captured for it (sharing its cache)."""

    def __init__(self, path: Path, max_ids: int, profile_rows: np.ndarray | None):
        from flashnext.kernels import StagedTable

        self.table = open_table(path, "mmap")
        self.staged = StagedTable(self.table, max_ids=max_ids, device="cuda")
        self.cache = None if profile_rows is None else self.staged.set_device_cache(profile_rows, CACHE_BYTES)
        self.graphs: dict[int, Any] = {}
        self.outs: dict[int, Any] = {}

    def out(self, t: int) -> Any:
        import torch

        if t not in self.outs:
            self.outs[t] = torch.empty(t, HEADS * WIDTH, dtype=torch.bfloat16, device="cuda")
        return self.outs[t]

    def capture(self, t: int, warm_ids: np.ndarray) -> None:
        """Capture the GraphStagedTable lookup for steps of ``t`` tokens (once)."""
        import torch

        from flashnext.kernels import GraphStagedTable

        if t in self.graphs:
            return
        staged = GraphStagedTable(self.table, (t, HEADS), prefault=False)
        if self.cache is not None:
            staged.share_cache(self.staged)
        staged.stage(warm_ids)
        staged.lookup(self.out(t))  # compile outside capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            staged.lookup(self.out(t))
        self.graphs[t] = (staged, graph)

    def hints(self, mode: str) -> None:
        """Every table of this side (graph-staged ones too) on ``cold_hints`` ``mode``."""
        self.staged.cold_hints = mode
        for staged, _ in self.graphs.values():
            staged.cold_hints = mode

    def step(self, graph: bool, ids: np.ndarray) -> Any:
        """One step for host ids [T, 16] (in the captured graph or not); bf16 [T, 2560]."""
        import torch

        t = ids.shape[0]
        if graph:
            staged, captured = self.graphs[t]
            captured.replay()  # waits on the flag the host sets when the slot is filled
            staged.stage(ids)
        else:
            self.staged.lookup(self.staged.stage(ids), self.out(t))
        torch.cuda.synchronize()
        return self.out(t)

    def close(self) -> None:
        """Drop the maps (touched pages stay cached while a map holds them)."""
        import torch

        self.graphs.clear()
        self.outs.clear()
        del self.staged
        self.table.close()
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


#: Our cases: name -> (cached, in a CUDA graph).
CASES = {"staged": (False, False), "staged cache 2GB": (True, False),
         "graph-staged": (False, True), "graph-staged cache 2GB": (True, True)}  # fmt: skip


# -- the run ---------------------------------------------------------------------------------
class Run:
    def __init__(self, args: argparse.Namespace):
        from gpu_lookup import TextIds

        self.args = args
        self.seed = args.seed if args.seed is not None else int(np.random.SeedSequence().entropy % 2**32)
        self.rng = np.random.default_rng(self.seed)
        self.text = TextIds(args.tokens)
        self.profile_rows = self.text.profile_rows % args.rows
        self.results: list[dict[str, Any]] = []

    def ids(self, kind: str, t: int, n: int) -> list[np.ndarray]:
        """``n`` fresh id sets [t, 16] (int64, host)."""
        rows = self.args.rows
        if kind == "uniform":
            return [self.rng.integers(0, rows, size=(t, HEADS)) for _ in range(n)]
        return [np.ascontiguousarray(s) for s in self.text.host_sets(t, n, self.rng, rows)]

    def record(self, fmt: str, case: str, kind: str, t: int, times: list[float],
               extra: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
        row = {"format": fmt, "case": case, "ids": kind, "T": t, "us": statistics.median(times),
               "us_min": min(times), "us_max": max(times), "us_all": times, **(extra or {})}  # fmt: skip
        self.results.append(row)
        print(f"{fmt:>5} {case:>24} {kind:>7} T={t:>5}: {row['us']:12.1f} us "
              f"[{row['us_min']:.1f}..{row['us_max']:.1f}]"
              + "".join(f" {k}={v}" for k, v in (extra or {}).items()), flush=True)  # fmt: skip
        return row

    def warm(self, fmt: str, emb: Any, ours: dict[bool, Ours]) -> None:
        """Every side on the same fresh steps, files in the page cache."""
        for kind in ("uniform", "text"):
            for t in self.args.sizes:
                steps = self.ids(kind, t, STEPS.get(t, 6) + 1)
                for side in ours.values():
                    side.capture(t, steps[0])
                    side.hints(self.args.warm_hints)
                # step 0 warms every side (compiles, first touch); the rest are timed
                times: dict[str, list[float]] = {c: [] for c in ("vllm", *CASES)}
                for i, ids in enumerate(steps):
                    for case in times:
                        t0 = time.perf_counter()
                        if case == "vllm":
                            got = vllm_step(emb, fmt, ids)
                        else:
                            cached, graph = CASES[case]
                            got = ours[cached].step(graph, ids)
                        if i:
                            times[case].append((time.perf_counter() - t0) * 1e6)
                        if i == 1 and fmt == "nvfp4" and case == "staged":
                            self.same_bits(fmt, kind, t, emb, got)
                base = self.record(fmt, "vllm disk offload", kind, t, times.pop("vllm"))
                slot = ours[True].staged.slot_map
                hit = round(float(np.mean([(slot[s] >= 0).mean() for s in steps])), 3)
                for case, ts in times.items():
                    extra = {"x_vllm": round(base["us"] / statistics.median(ts), 1)}
                    if CASES[case][0]:
                        extra["hit_rate"] = hit
                    self.record(fmt, case, kind, t, ts, extra)

    def same_bits(self, fmt: str, kind: str, t: int, emb: Any, ours: Any) -> None:
        """How vLLM's decoded nvfp4 rows of this step compare with ours (recorded, not
        asserted): the share of equal bf16 bit patterns, the largest gap in bf16 ulps, whether
        the values are equal as numbers (-0.0 == +0.0), and whether every differing pattern is a
        zero of the other sign."""
        import torch

        theirs_bf16 = emb._output[:t].flatten(-2)
        theirs = theirs_bf16.view(torch.int16).to(torch.int32)
        mine = ours.view(torch.int16).to(torch.int32)
        differ = theirs != mine
        row = {"format": fmt, "case": "same bits", "ids": kind, "T": t,
               "equal_share": float((~differ).float().mean()),
               "max_ulps": int((theirs - mine).abs().max()),
               "equal_as_numbers": bool(torch.equal(theirs_bf16.float(), ours.float())),
               "differ_only_in_sign_of_zero": bool(
                   ((theirs_bf16 == 0) & (ours == 0))[differ].all())}  # fmt: skip
        self.results.append(row)
        print(f"{fmt:>5} vLLM's decoded rows vs flashnext's, {kind} T={t}: "
              + ", ".join(f"{k} {row[k]}" for k in list(row)[4:]), flush=True)  # fmt: skip

    def cold(self, fmt: str, path: Path, emb: Any, ours: dict[bool, Ours]) -> None:
        """The first ``--cold-steps`` steps of each side, each side after the shard files are
        evicted (every map's pages too): the sides as built (graphs captured, the 2 GB cache
        filled), the files as after a restart or memory pressure."""
        files = sorted(path.glob("shard_*.safetensors"))
        for kind in ("uniform", "text"):
            for t in self.args.sizes:
                steps = self.ids(kind, t, self.args.cold_steps)
                base = None
                modes = self.args.cold_hints.split(",")
                for case, mode in [("vllm", ""), *((c, m) for c in CASES for m in modes)]:
                    if case == "vllm":
                        step = functools.partial(vllm_step, emb, fmt)
                    else:
                        cached, graph = CASES[case]
                        ours[cached].hints(mode)
                        step = functools.partial(ours[cached].step, graph)
                    left = evict(files)
                    times = [self.timed(step, ids) for ids in steps]
                    extra: dict[str, Any] = {"cached_bytes_after_evict": left}
                    if base is not None:
                        extra["x_vllm"] = round(base / statistics.median(times), 1)
                        extra["cold_hints"] = mode
                    name = "vllm disk offload" if case == "vllm" else case
                    row = self.record(fmt, f"cold {name}", kind, t, times, extra)
                    base = row["us"] if base is None else base
        for side in ours.values():
            side.hints(self.args.warm_hints)

    @staticmethod
    def timed(step: Any, ids: np.ndarray) -> float:
        t0 = time.perf_counter()
        step(ids)
        return (time.perf_counter() - t0) * 1e6

    def one_format(self, fmt: str) -> None:
        args = self.args
        root = args.root / fmt
        if root.exists():
            shutil.rmtree(root)
        t0 = time.perf_counter()
        path = build_repeated(root, fmt, args.rows, self.rng)
        size = sum(p.stat().st_size for p in path.glob("*.safetensors"))
        print(f"{fmt}: wrote {args.rows:,} rows in {RELEASED_SHARDS} files, {size / 1e9:.1f} GB, "
              f"in {time.perf_counter() - t0:.0f} s", flush=True)  # fmt: skip
        emb = vllm_disk_offload(fmt, path, args.rows, max(args.sizes))
        max_ids = max(args.sizes) * HEADS
        ours = {False: Ours(path, max_ids, None), True: Ours(path, max_ids, self.profile_rows)}
        cache = ours[True].staged.cache_info
        print(f"{fmt}: 2 GB cache holds {cache.rows:,} hot rows ({cache.bytes / 1e9:.2f} GB)",
              flush=True)  # fmt: skip
        self.warm(fmt, emb, ours)
        self.cold(fmt, path, emb, ours)
        for side in ours.values():
            side.close()
        for fd in emb._fds.values():
            os.close(fd)
        del emb
        gc.collect()
        shutil.rmtree(root)


def evict(files: list[Path]) -> int:
    """Drop ``files`` from the page cache; returns the bytes still cached (0 when it worked).

    The kernel keeps a cached page while any map has it faulted in, so first every map of
    these files in this process (our tables' maps: they stay open) lets go of its pages
    (``madvise(MADV_DONTNEED)``: read-only file maps, so the next touch reads the file again),
    then each file is flushed and dropped (``POSIX_FADV_DONTNEED``)."""
    names = {str(p.resolve()) for p in files}
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) > 5 and fields[5].strip() in names:
                low, high = (int(bound, 16) for bound in fields[0].split("-"))
                if libc.madvise(low, high - low, MADV_DONTNEED):
                    raise OSError(ctypes.get_errno(), f"madvise of {fields[5].strip()}")
    for path in files:
        with open(path, "rb") as fh:
            os.fsync(fh.fileno())
            os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    return sum(page_cache_bytes(p) for p in files)


def environment() -> dict[str, Any]:
    import torch
    import vllm

    return {"flashnext": __version__, "vllm": vllm.__version__, "torch": torch.__version__,
            "python": platform.python_version(), "card": torch.cuda.get_device_name(),
            "host_cpus": os.cpu_count(), "command": sys.argv}  # fmt: skip


def main() -> int:
    args = parser().parse_args()
    try:
        import torch
        import vllm.models.qwen4_exp.nvidia.ngram_embedding as ngram
    except ImportError as exc:
        print(f"needs torch and vLLM 0.34 ({exc})", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("needs a CUDA GPU (vLLM's disk offload is CUDA only)", file=sys.stderr)
        return 2
    if not hasattr(ngram, "Qwen4ExpPLEDiskOffloadEmbedding"):
        print("needs vLLM 0.34 or later (no Qwen4ExpPLEDiskOffloadEmbedding)", file=sys.stderr)
        return 2
    run = Run(args)
    vllm_world()
    env = environment()
    print(json.dumps({**env, "seed": run.seed}), flush=True)
    for fmt in args.formats.split(","):
        run.one_format(fmt)
        if args.json:  # after each format: a run cut short keeps what it measured
            tmp = args.json.with_name(args.json.name + ".partial")
            tmp.write_text(json.dumps({"schema_version": 1, **env, "seed": run.seed,
                                       "results": run.results}, indent=1))  # fmt: skip
            tmp.replace(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())

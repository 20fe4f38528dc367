"""Per-step A/B of the staged path behind a device cache: a previous tree against this one, in one process.

    python bench/staged_ab.py --previous PREV_SRC [--tokens TOKENS.npy] [--profile docs|halves]
        [--staged-rows N] [--sidecar DIR] [--cache-gb 2] [--sizes 32,512,8192] [--pairs N]
        [--warmup N] [--seed S] [--device cuda|cpu] [--json PATH]

What back-to-back runs of ``bench/gpu_lookup.py --sections staged-cache`` cannot settle (their
process-to-process noise, x0.5-2.3, hides a x0.9; BENCHMARKS.md, redesign re-measure).
``--previous`` is a checkout's ``src`` (``git archive 1b3656e src | tar -x -C /tmp/prev``, then
``--previous /tmp/prev/src``): its ``flashnext`` is copied as ``flashnext_prev``, absolute
imports and ``"flashnext.x"`` module strings renamed, and imported beside this tree's. Each
side is built as its own tree's staged-cache section builds it: its ``open_table(sidecar,
"mmap")``; a ``StagedTable`` with a device cache of the profile's hottest rows that fit in
``--cache-gb`` (the same rows on both sides, checked); per T a ``GraphStagedTable`` sharing
that cache (uva: the kernel reads the pinned slot and polls the flag). Both read one
memory-mapped int4 sidecar of ``--staged-rows`` rows, written and warmed as gpu_lookup.py does
(``--sidecar DIR``: kept in DIR, reused when DIR/int4 exists). Ids: text from ``--tokens``
(bench/text_tokens.py), else a seeded synthetic Zipf stream; every step draws fresh ids.
Per (path, T) each side first runs ``--warmup`` untimed steps (compiles, first touches), then
``--pairs`` rounds of one step each, A B then B A in turn, each step timed with CUDA events
(from before its stage or graph launch to the kernel's end) and wall clock. The ratio previous /
current (x > 1: this tree is faster) is the median of the per-pair ratios, with a bootstrap
95% interval. ``--device cpu`` runs the staged path under Triton's interpreter
(``TRITON_INTERPRET=1``): a check that the script runs, not a measurement.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import importlib
import importlib.util
import json
import platform
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
from _common import add_shard_rows_option, device_refusal, positive_int

PREV = "flashnext_prev"
HEADS, WIDTH = 16, 160
# `flashnext.x` anywhere (imports, attribute use, "flashnext.x" strings) and `from/import
# flashnext`; not `~/.cache/flashnext` or the "flashnext" config section and distribution name
DOTTED = re.compile(r"(?<![\w/-])flashnext(?=\.[\w\"'<])")
BARE = re.compile(r"^(\s*(?:from|import)\s+)flashnext\b(?!\.)", re.M)


def import_previous(src: Path, into: Path) -> SimpleNamespace:
    """Copy ``src/flashnext`` to ``into/flashnext_prev`` with its absolute imports renamed and
    import its :func:`tree_api`; every module it loads resolves to the copy, none to this
    tree's package.

    Raises:
        SystemExit: ``src`` holds no ``flashnext`` package, or the copy reaches this tree's.
    """
    if not (src / "flashnext" / "__init__.py").is_file():
        sys.exit(f"error: --previous {src}: expected a src dir holding flashnext/__init__.py")
    dest = into / PREV
    shutil.copytree(src / "flashnext", dest, ignore=shutil.ignore_patterns("__pycache__"))
    for path in dest.rglob("*.py"):
        text = path.read_text()
        path.write_text(BARE.sub(rf"\g<1>{PREV}", DOTTED.sub(PREV, text)))
    sys.path.insert(0, str(into))
    before = {m for m in sys.modules if m.split(".")[0] == "flashnext"}
    api = tree_api(PREV)
    leaked = {m for m in sys.modules if m.split(".")[0] == "flashnext"} - before
    outside = [m for m, mod in sys.modules.items() if m.split(".")[0] == PREV
               and not Path(getattr(mod, "__file__", None) or dest).resolve().is_relative_to(dest.resolve())]  # fmt: skip
    if leaked or outside:
        sys.exit(f"error: the copy of {src} imports this tree's {sorted(leaked)} or loads "
                 f"{sorted(outside)} from elsewhere")  # fmt: skip
    return api


def tree_api(pkg: str) -> SimpleNamespace:
    """A tree's public ``open_table`` (``host`` since issue 43, ``ple`` before) and staged
    classes."""
    kernels = importlib.import_module(f"{pkg}.kernels")
    where = "host" if importlib.util.find_spec(f"{pkg}.host") is not None else "ple"
    return SimpleNamespace(open_table=importlib.import_module(f"{pkg}.{where}").open_table,
                           StagedTable=kernels.StagedTable,
                           GraphStagedTable=kernels.GraphStagedTable)  # fmt: skip


def digest(package: Path) -> str:
    """sha256 (12 hex) of a package's sources, to name the code each side ran."""
    h = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        h.update(str(path.relative_to(package)).encode() + path.read_bytes())
    return h.hexdigest()[:12]


class Side:
    """One tree's table, StagedTable (with its device cache) and step timing."""

    def __init__(self, name: str, api: SimpleNamespace, sidecar: Path, args: argparse.Namespace,
                 profile: np.ndarray, torch: Any):  # fmt: skip
        self.name, self.api, self.torch, self.device = name, api, torch, args.device
        self.table = self.api.open_table(sidecar, "mmap")
        t0 = time.perf_counter()
        self.staged = self.api.StagedTable(self.table, max_ids=max(args.sizes) * HEADS,
                                           device=args.device)  # fmt: skip
        cache = getattr(self.staged, "set_device_cache", None) or self.staged.set_hot_rows
        self.info = cache(profile, int(args.cache_gb * (1 << 30)))
        print(f"{name}: {self.info.rows:,} rows cached ({self.info.bytes / 1e9:.2f} GB), "
              f"built in {time.perf_counter() - t0:.1f} s", flush=True)  # fmt: skip
        cuda = args.device == "cuda"
        self.events = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if cuda else None

    def _mark(self, i: int) -> None:
        if self.events:
            self.events[i].record()

    def _done(self, t0: float, batch: Any) -> tuple[float, float, int]:
        """(event us, wall us, rows staged) of the step begun at ``t0``, once its end passed."""
        if self.events:
            self.events[1].synchronize()
        wall = (time.perf_counter() - t0) * 1e6
        event = self.events[0].elapsed_time(self.events[1]) * 1e3 if self.events else wall
        return event, wall, int(batch.n_unique)

    def staged_step(self, ids: np.ndarray, out: Any) -> tuple[float, float, int]:
        """Stage + lookup + the kernel's end, as the staged-cache section times it."""
        t0 = time.perf_counter()
        self._mark(0)
        batch = self.staged.stage(ids)
        self.staged.lookup(batch, out)
        self._mark(1)
        return self._done(t0, batch)

    def graph_step(self, table: Any, graph: Any, ids: np.ndarray) -> tuple[float, float, int]:
        """The graph launched first, waiting on the flag while the host stages (as the
        section's ``_replay_graph_staged``)."""
        t0 = time.perf_counter()
        self._mark(0)
        graph.replay()
        self._mark(1)
        return self._done(t0, table.stage(ids))

    def runner(self, path: str, t: int, first: np.ndarray) -> Any:
        """ids -> (event us, wall us, rows staged): one step of ``path`` at ``t`` tokens;
        ``first`` compiles the graph's kernel outside its capture."""
        torch = self.torch
        out = torch.empty(t, HEADS * WIDTH, dtype=torch.bfloat16, device=self.device)
        if path == "staged":
            return lambda ids: self.staged_step(ids, out)
        table = self.api.GraphStagedTable(self.table, (t, HEADS), prefault=False,
                                          copy_slot=False, wait="spin")  # fmt: skip
        table.share_cache(self.staged)
        table.stage(first)
        table.lookup(out)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            table.lookup(out)
        return lambda ids: self.graph_step(table, graph, ids)


# -- inputs --------------------------------------------------------------------------------
def token_stream(
    args: argparse.Namespace, root: Path, rng: np.random.Generator
) -> tuple[Path, str]:
    """``--tokens``, else a synthetic Zipf(1.2) stream written as bench/text_tokens.py writes
    text (int32 ids, EOS between documents, a .json beside); and what it is, in words."""
    if args.tokens:
        return args.tokens, f"text {args.tokens}"
    vocab, eos, n = 151_936, 151_643, 4_000_000
    tokens = np.minimum(rng.zipf(1.2, n), vocab - 1).astype(np.int32)
    tokens[rng.random(n) < 1 / 2000] = eos  # documents of ~2,000 tokens, for --profile docs
    path = root / "zipf.npy"
    np.save(path, tokens)
    path.with_suffix(".json").write_text(json.dumps({"vocab_size": vocab, "eos_token_id": eos}))
    return path, f"synthetic Zipf(1.2) stream, {n:,} tokens, seed {args.seed}"


def sidecar(args: argparse.Namespace, rng: np.random.Generator, root: Path) -> tuple[Path, int]:
    """``root/int4`` and its rows: reused when it exists, else written and warmed by
    gpu_lookup.py's own ``staged_sidecar`` (``--staged-rows``, default 40,000,000)."""
    from gpu_lookup import Bench

    from flashnext.host import open_table

    path = root / "int4"
    root.mkdir(parents=True, exist_ok=True)
    if path.exists():
        with open_table(path, "mmap") as table:
            rows = table.num_rows
        if args.staged_rows not in (None, rows):
            sys.exit(f"error: --sidecar {root}: int4 holds {rows:,} rows, --staged-rows says "
                     f"{args.staged_rows:,}")  # fmt: skip
        print(f"sidecar: reusing {path} ({rows:,} rows)", flush=True)
        return path, rows
    args.staged_rows = args.staged_rows or 40_000_000
    Bench.staged_sidecar(SimpleNamespace(args=args, rng=rng), root)  # type: ignore[arg-type]
    return path, args.staged_rows


# -- the A/B -------------------------------------------------------------------------------
def median_ci(ratios: np.ndarray, rng: np.random.Generator, n: int = 2000) -> list[float]:
    """[median, 2.5th, 97.5th percentile of the bootstrap medians] of per-pair ratios."""
    boot = np.median(ratios[rng.integers(0, ratios.size, (n, ratios.size))], axis=1)
    return [float(np.median(ratios)), *map(float, np.percentile(boot, [2.5, 97.5]))]


def run_case(sides: list[Side], path: str, t: int, draw: Any, args: argparse.Namespace,
             bar: Any) -> dict:  # fmt: skip
    """``--warmup`` untimed steps per side, then ``--pairs`` rounds, A B then B A in turn."""
    runs = [side.runner(path, t, draw()) for side in sides]
    for _ in range(args.warmup):
        for run in runs:
            run(draw())
    steps: list[list[tuple[float, float, int]]] = [[], []]
    gc.collect()
    for i in range(args.pairs):
        for k in (0, 1) if i % 2 == 0 else (1, 0):
            steps[k].append(runs[k](draw()))
        bar.update()
    prev, cur = np.array(steps[0]), np.array(steps[1])  # [pairs, (event, wall, unique)]
    slot_map = sides[1].staged.slot_map
    hits = [0.0] if slot_map is None else [(slot_map[draw()] >= 0).mean() for _ in range(4)]
    row: dict[str, Any] = {"path": path, "T": t, "pairs": args.pairs,
                           "hit_rate": float(np.mean(hits))}  # fmt: skip
    for j, clock in enumerate(("event", "wall")):
        row[clock] = {"previous_us": float(np.median(prev[:, j])),
                      "current_us": float(np.median(cur[:, j])),
                      "ratio_ci95": median_ci(prev[:, j] / cur[:, j], args.rng)}  # fmt: skip
    row["unique_rows"] = [float(np.median(prev[:, 2])), float(np.median(cur[:, 2]))]
    row["steps_us"] = {"previous": prev[:, :2].round(2).tolist(),
                       "current": cur[:, :2].round(2).tolist()}  # fmt: skip
    return row


def verdict(ci: list[float]) -> str:
    return "current slower" if ci[2] < 1 else "current faster" if ci[1] > 1 else "equal"


def report(record: dict, gb: float) -> None:
    """The one-screen summary: per (path, T) the medians and previous / current."""
    print(f"\n{headline(record)}\n{'path':<26} {'T':>5} {'hit':>4} {'prev us':>9} {'cur us':>9}"
          f"  {'prev/cur events [95%]':<22}  {'wall [95%]':<20} verdict (events)")  # fmt: skip
    fmt = "x{:.3f} [{:.3f}-{:.3f}]".format
    for r in record["results"]:
        ev, wall = r["event"], r["wall"]
        print(f"{r['path'] + f' + {gb:g} GB':<26} {r['T']:>5} {r['hit_rate']:>4.0%} "
              f"{ev['previous_us']:>9.1f} {ev['current_us']:>9.1f}  {fmt(*ev['ratio_ci95']):<22}  "
              f"{fmt(*wall['ratio_ci95']):<20} {verdict(ev['ratio_ci95'])}")  # fmt: skip
    slower = [r for r in record["results"] if verdict(r["event"]["ratio_ci95"]) == "current slower"]
    print(f"x > 1: the current tree is faster; current slower beyond the 95% interval: "
          f"{len(slower)} of {len(record['results'])}", flush=True)  # fmt: skip


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--previous", type=Path, required=True,
                    help="the previous tree's src dir (holding flashnext/)")  # fmt: skip
    ap.add_argument("--tokens", type=Path, help="bench/text_tokens.py output .npy (its .json "
                    "beside); default: a seeded synthetic Zipf stream")  # fmt: skip
    ap.add_argument("--profile", choices=("halves", "docs"), default="docs",
                    help="the cache's rows from the even documents, timed on the odd (docs), or "
                    "from the first half, timed on the second (halves)")  # fmt: skip
    ap.add_argument("--staged-rows", type=positive_int, default=None,
                    help="rows of the int4 sidecar (default 40,000,000, or --sidecar's)")  # fmt: skip
    ap.add_argument("--sidecar", type=Path, help="keep the sidecar in DIR/int4 (reused if there)")
    add_shard_rows_option(ap)
    ap.add_argument("--cache-gb", type=float, default=2.0, help="device cache size, GB (2^30)")
    ap.add_argument("--sizes", type=lambda s: [positive_int(x) for x in s.split(",") if x],
                    default=[32, 512, 8192], help="tokens per step T, comma-separated")  # fmt: skip
    ap.add_argument("--pairs", type=positive_int, default=2000, help="timed A/B rounds per case")
    ap.add_argument("--warmup", type=positive_int, default=20, help="untimed steps per side")
    ap.add_argument("--built-first", choices=("previous", "current"), default="previous",
                    help="which side allocates its table, cache and slots first (an allocation "
                         "order that favoured one side would flip with this)")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: Triton's interpreter (TRITON_INTERPRET=1), staged path only")  # fmt: skip
    ap.add_argument("--json", type=Path, help="write the record here")
    return ap


def main() -> int:
    ap = parser()
    args = ap.parse_args()
    if args.cache_gb <= 0:  # the A/B is of the path behind a device cache
        ap.error(f"--cache-gb must be above 0, found {args.cache_gb:g}")
    if args.json and not args.json.parent.is_dir():  # found now, not after the run
        ap.error(f"--json {args.json}: directory {args.json.parent} does not exist")
    try:
        import torch
        import triton
    except ImportError:
        print("error: needs torch and triton (pip install 'flashnext[gpu]')", file=sys.stderr)
        return 1
    refusal = device_refusal(args.device, torch.cuda.is_available())
    if refusal:
        print(refusal, file=sys.stderr)
        return 1
    if args.seed is None:
        args.seed = int(np.random.SeedSequence().generate_state(1)[0])
    args.rng = np.random.default_rng(args.seed)
    device = torch.cuda.get_device_name() if args.device == "cuda" else "Triton interpreter"
    record = {"device": device, "torch": torch.__version__, "triton": triton.__version__,
              "python": platform.python_version(), "seed": args.seed}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        record |= measure(args, torch, Path(tmp), record)
    report(record, args.cache_gb)
    if args.json:
        record["args"] = {k: str(v) for k, v in vars(args).items() if k != "rng"}
        tmp_json = args.json.with_name(args.json.name + ".tmp")
        tmp_json.write_text(json.dumps(record, indent=1))
        tmp_json.replace(args.json)
    return 0


def measure(args: argparse.Namespace, torch: Any, root: Path, env: dict) -> dict[str, Any]:
    """Build both sides over one sidecar and cache plan, run every (path, T) case."""
    from gpu_lookup import TextIds

    import flashnext

    api, rng = import_previous(args.previous, root / "prev"), args.rng
    tokens, source = token_stream(args, root, rng)
    text = TextIds(tokens, args.profile)
    path, rows = sidecar(args, rng, args.sidecar or root)
    profile = text.profile_rows % rows  # as the section: the timed ids are taken % rows
    apis = {"previous": api, "current": tree_api("flashnext")}
    order = ["previous", "current"][:: 1 if args.built_first == "previous" else -1]
    built = {name: Side(name, apis[name], path, args, profile, torch) for name in order}
    sides = [built["previous"], built["current"]]
    maps = [s.staged.slot_map for s in sides]
    same = maps[0] is None if maps[1] is None else np.array_equal(maps[0] >= 0, maps[1] >= 0)
    record = {"ids": source, "sidecar_rows": rows, "built_first": args.built_first, "same_cached_rows": bool(same),
              "cached_rows": [s.info.rows for s in sides],
              "trees": {"previous": {"src": str(args.previous),
                                     "sources": digest(args.previous / "flashnext")},
                        "current": {"version": flashnext.__version__,
                                    "sources": digest(Path(flashnext.__file__).parent)}}}  # fmt: skip
    print(headline({**env, **record}), flush=True)
    paths = ["staged"] + (["graph-staged uva"] if args.device == "cuda" else [])
    cases = [(p, t) for t in args.sizes for p in paths]
    bar, results = progress(len(cases) * args.pairs), []
    for p, t in cases:
        bar.set_description(f"{p} T={t}")
        draw = lambda t=t: text.host_sets(t, 1, rng, rows)[0]  # noqa: E731
        results.append(run_case(sides, p, t, draw, args, bar))
    bar.close()
    return {**record, "results": results}


def headline(r: dict) -> str:
    same = "same rows cached" if r["same_cached_rows"] else "WARNING: the trees cache other rows"
    trees = ", ".join(f"{k} {v['sources']}" for k, v in r["trees"].items())
    return (f"{r['device']}, torch {r['torch']}, triton {r['triton']}, seed {r['seed']}; ids: "
            f"{r['ids']}; {r['sidecar_rows']:,}-row int4 sidecar; {same} "
            f"({r['cached_rows'][1]:,}); {r['built_first']} built first; sources {trees}")  # fmt: skip


def progress(total: int) -> Any:
    """A tqdm bar on stderr (sparse when not a terminal: the summary is what a log keeps), or
    a stand-in that prints each case (tqdm is not a dependency)."""
    try:
        from tqdm import tqdm
    except ImportError:
        return SimpleNamespace(update=lambda: None, close=lambda: None,
                               set_description=lambda d: print(d, file=sys.stderr, flush=True))  # fmt: skip
    return tqdm(total=total, unit="pair", file=sys.stderr,
                mininterval=0.5 if sys.stderr.isatty() else 30)  # fmt: skip


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # the temporary copy and sidecar are gone with their directory
        print("staged_ab: interrupted", file=sys.stderr)
        raise SystemExit(130) from None

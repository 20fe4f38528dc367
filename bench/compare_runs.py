"""Runs of one bench script by two versions of the code, case by case: is the current one slower?

    python bench/compare_runs.py PREVIOUS CURRENT [PREVIOUS CURRENT ...] [--json OUT]

Each file is a ``--json`` record of the same ``bench/`` script (``gpu_lookup.py``: a ``results``
list of rows with ``case``, ``T`` and ``us``), each PREVIOUS CURRENT pair run on one machine one
after the other, e.g. the previous main's tree and this one's. Rows are matched by (case,
format, cache_GB, ids, T); per pair the ratio previous / current of the median microseconds is
printed (x > 1: the current code is faster), and their geometric mean.

A machine drifts between two runs, and on the H200 host the second of two back-to-back runs
of the staged paths was up to 2x faster whichever code it ran (BENCHMARKS.md, the re-measure):
so give pairs in both orders (previous first, then current first: "ABBA"), whose geometric
mean cancels the order. A case is a regression only where the geometric mean falls below the
noise case's (``--noise``, default ``baseline``: vLLM's kernel, the same code in both) by more
than ``--margin`` (default 10%) AND every pair has it slower: a real slowdown shows in both
orders. Exit 1 when there is one.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

KEY = ("case", "format", "cache_GB", "ids", "T")


def rows_by_key(path: Path) -> dict[tuple, dict[str, Any]]:
    """``{(case, format, cache_GB, ids, T): row}`` for the rows of ``path`` with a time (``us``)."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SystemExit(f"error: {path}: not a bench --json record ({exc})") from None
    if not isinstance(record, dict) or not isinstance(record.get("results"), list):
        raise SystemExit(f"error: {path}: no 'results' list (expected a bench/*.py --json record)")
    return {tuple(r.get(k) for k in KEY): r for r in record["results"]
            if isinstance(r, dict) and isinstance(r.get("us"), (int, float)) and r["us"] > 0}  # fmt: skip


def compare(pairs: list[tuple[dict[tuple, dict], dict[tuple, dict]]], noise: str,
            margin: float) -> dict[str, Any]:  # fmt: skip
    """Per key present in every run: each pair's previous / current ratio and their geometric
    mean (``ratio``); the noise band from the ``noise`` case's means; ``regressions``: keys
    whose mean is below the band by more than ``margin`` and slower in every pair."""
    common = set.intersection(*(set(p) & set(c) for p, c in pairs))
    rows = []
    for key in sorted(common, key=lambda k: tuple(map(str, k))):
        ratios = [p[key]["us"] / c[key]["us"] for p, c in pairs]
        rows.append({**dict(zip(KEY, key)),
                     "previous_us": statistics.median(p[key]["us"] for p, _ in pairs),
                     "current_us": statistics.median(c[key]["us"] for _, c in pairs),
                     "pair_ratios": ratios,
                     "ratio": math.exp(statistics.fmean(map(math.log, ratios)))})  # fmt: skip
    band = [r["ratio"] for r in rows if r["case"] == noise]
    floor = min(band) if band else 1.0
    regressions = [r for r in rows if r["case"] != noise and r["ratio"] < floor * (1 - margin)
                   and all(x < 1 for x in r["pair_ratios"])]  # fmt: skip
    every = set().union(*(set(p) | set(c) for p, c in pairs))
    return {"pairs": len(pairs), "noise_case": noise, "noise_ratios": band, "rows": rows,
            "not_in_every_run": sorted(map(list, every - common), key=str),
            "regressions": regressions}  # fmt: skip


def show(out: dict[str, Any]) -> None:
    """The comparison as a table, then the noise band and the regressions."""
    width = max([len(r["case"]) for r in out["rows"]] + [4])
    print(f"{'case':<{width}} {'cache':>5} {'ids':>7} {'T':>6} {'previous us':>12} "
          f"{'current us':>11}  per pair -> mean")  # fmt: skip
    for r in out["rows"]:
        cache = "" if r["cache_GB"] is None else f"{r['cache_GB']}GB"
        pairs = " ".join(f"x{x:.2f}" for x in r["pair_ratios"])
        print(f"{r['case']:<{width}} {cache:>5} {r['ids']!s:>7} {r['T']!s:>6} "
              f"{r['previous_us']:12.1f} {r['current_us']:11.1f}  {pairs} -> x{r['ratio']:.2f}")  # fmt: skip
    band = out["noise_ratios"]
    noise = f"x{min(band):.2f}..x{max(band):.2f}" if band else "no such case in every run"
    print(f"noise ({out['noise_case']}): {noise}; pairs: {out['pairs']}")
    if out["not_in_every_run"]:
        print(f"not in every run: {len(out['not_in_every_run'])} cases")
    print(f"regressions beyond noise, in every pair: {len(out['regressions'])}"
          + "".join(f"\n  {r['case']} {r['ids']} T={r['T']}: x{r['ratio']:.2f}"
                    for r in out["regressions"]))  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", type=Path, nargs="+", metavar="PREVIOUS CURRENT",
                    help="--json records in pairs: the previous code's, then the current's")  # fmt: skip
    ap.add_argument("--noise", default="baseline",
                    help="a case neither version changed (default: baseline)")  # fmt: skip
    ap.add_argument("--margin", type=float, default=0.10,
                    help="how far below the noise band is a regression (default 0.10)")  # fmt: skip
    ap.add_argument("--json", type=Path, help="write the comparison here")
    args = ap.parse_args(argv)
    if len(args.runs) % 2:
        ap.error(f"{len(args.runs)} records given: expected pairs (PREVIOUS CURRENT ...)")
    records = [rows_by_key(p) for p in args.runs]
    out = compare(list(zip(records[::2], records[1::2])), args.noise, args.margin)
    show(out)
    if args.json:
        tmp = args.json.with_name(args.json.name + ".tmp")
        tmp.write_text(json.dumps(out, indent=1))
        tmp.replace(args.json)
    return 1 if out["regressions"] else 0


if __name__ == "__main__":
    sys.exit(main())

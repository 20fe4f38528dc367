"""Plugin off vs a bf16 sidecar of the model's own table: identical answers through ``flashnext
validate ab``, switched on through the environment (the README's two commands, run as written;
test_formats switches nvfp4 on through ``--additional-config``). The README's A/B records plugin
off's answers, which the other modules' A/Bs compare with (conftest.off_answers). And the
negative control: another table of the same geometry makes the A/B fail. (Another geometry is
refused inside real vLLM by tests/integrations/test_plugin_vllm.py, with no server to boot.)"""

from __future__ import annotations

import json
import os
import queue
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from devtools.e2e.servers import ServerPool, log_text

from ..cli.runner import BASE_ENV
from .conftest import MAX_TOKENS, OFF_ANSWERS, PROMPTS, same_model, summary, validate_ab, wave

PLUGIN_LINE = "flashnext plugin: ple_sidecar: model.layers.0.ple.ple_embedding.ngram_embedding <- "
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def servers(pool: ServerPool) -> Iterator[ServerPool]:
    yield from wave(pool, "identity", "formats")


def assert_identical(code: int, record: dict) -> None:
    """An A/B of three prompts whose answers are the same, token for token, with KL 0."""
    s = record["summary"]
    assert code == 0, json.dumps(record["verdict"])
    assert record["verdict"]["status"] == "identical", json.dumps(record["verdict"])
    assert s["errors"] == 0 and s["identical"] == s["prompts"] == 3
    assert s["tf_positions"] > 0, "nothing was teacher-forced: KL 0 would mean nothing"
    assert s["kl"]["max"] == 0.0 and s["top1_agreement"] == 1.0


def readme_e2e_commands() -> tuple[list[str], list[str]]:
    """The README's "See it run end to end" block: the ``serve`` and the ``validate ab`` argv."""
    blocks = re.findall(r"```bash\n(.*?)\n```", (ROOT / "README.md").read_text(), flags=re.S)
    block = next(b for b in blocks if "devtools.e2e serve" in b)
    serve, ab = (shlex.split(line, comments=True) for line in block.splitlines())
    assert serve[:4] == [".venv/bin/python", "-m", "devtools.e2e", "serve"], serve
    assert ab[:3] == [".venv/bin/flashnext", "validate", "ab"], ab
    return serve, ab


def _sigint_default() -> None:
    """In the child: Ctrl-C at its default, as in a terminal (a suite started in the background
    by a non-interactive shell runs with SIGINT ignored, which children inherit)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture(scope="module")
def readme_serve(e2e_runtime: object, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """The README's ``serve`` line as written (``.venv/bin/python`` is this venv's interpreter,
    ``/tmp/`` a fresh temporary directory), in its own process group as a terminal would run it;
    yields once it has printed both URLs. Stopped at the end whatever the test did."""
    serve, ab = readme_e2e_commands()
    for port in (8000, 8001):
        assert not _port_open(port), f"port {port} is taken: the README's commands need it free"
    tmp = tmp_path_factory.mktemp("readme-e2e")
    argv = [sys.executable, *(a.replace("/tmp/", f"{tmp}/") for a in serve[1:])]
    err = open(tmp / "serve.stderr", "w")  # noqa: SIM115
    proc = subprocess.Popen(
        argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True,
        env={**os.environ, **BASE_ENV}, preexec_fn=_sigint_default,
    )  # fmt: skip
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout or []], daemon=True).start()
    printed: list[str] = []
    deadline = time.monotonic() + 900
    try:
        while not any(x.startswith("plugin on:") for x in printed):
            try:
                printed.append(lines.get(timeout=2))
            except queue.Empty:
                if proc.poll() is not None or time.monotonic() > deadline:
                    tail = (tmp / "serve.stderr").read_text(errors="replace")[-3000:]
                    raise AssertionError(
                        f"serve printed no URLs (exit {proc.poll()}): {tail}"
                    ) from None
        yield {"proc": proc, "tmp": tmp, "ab": ab, "printed": printed}
    finally:
        # Ctrl-C first: serve stops both servers (they run in sessions of their own, which a
        # SIGKILL of serve's group would leave behind, holding the ports)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        err.close()


def test_readme_end_to_end_commands_run_as_written(
    servers: ServerPool, readme_serve: dict, checkpoints: dict[str, Path]
) -> None:
    """The README's two commands: ``serve`` prints both URLs, the ``validate ab`` line (defaults
    included: ./ab-report with its PNG) passes with identical answers, Ctrl-C stops both servers.
    Plugin off's answers, recorded in ./ab-report, are the other modules' baseline."""
    proc, tmp, printed = readme_serve["proc"], readme_serve["tmp"], readme_serve["printed"]
    assert printed[-2:] == [
        "plugin off: http://127.0.0.1:8000\n",
        f"plugin on:  http://127.0.0.1:8001 ({tmp}/e2e/sidecar-bf16)\n",
    ], printed
    # The A/B line runs where its relative prompts path exists and its ./ab-report may be written.
    work = tmp / "cwd"
    (work / "tests" / "e2e").mkdir(parents=True)
    shutil.copy(PROMPTS, work / "tests" / "e2e" / "prompts.jsonl")
    script = Path(sys.executable).parent / "flashnext"  # this venv's console script
    ab = [str(script), *readme_serve["ab"][1:]]
    done = subprocess.run(
        ab, cwd=work, capture_output=True, text=True, timeout=900, env={**os.environ, **BASE_ENV}
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = json.loads((work / "ab-report" / "ab.json").read_text())
    assert (work / "ab-report" / "ab.png").stat().st_size > 0
    print(f"\nE2E-AB bf16_env {json.dumps(summary(record))}")
    assert_identical(0, record)
    assert record["config"]["max_tokens"] == int(ab[ab.index("--max-tokens") + 1]) == MAX_TOKENS
    # The README builds its own tiny model: the same bytes as the pool's (seed 0), so its
    # plugin-off answers are the other modules' baseline.
    assert same_model(tmp / "e2e" / "tiny-qwen4exp", checkpoints["tiny"])
    OFF_ANSWERS.append(work / "ab-report")
    on_log = (tmp / "e2e" / "logs-plugin" / "vllm-8001-1.log").read_text(errors="replace")
    assert PLUGIN_LINE + f"{tmp}/e2e/sidecar-bf16 (bf16" in on_log
    off_log = (tmp / "e2e" / "logs-off" / "vllm-8000-1.log").read_text(errors="replace")
    assert "flashnext plugin" not in off_log
    # Ctrl-C: SIGINT to the foreground process group, as a terminal sends it.
    os.killpg(proc.pid, signal.SIGINT)
    assert proc.wait(timeout=120) == 0
    assert not _port_open(8000) and not _port_open(8001)


def test_another_table_of_the_same_geometry_fails_the_ab(
    servers: ServerPool,
    sidecars: dict[str, Path],
    ab_records: dict[str, dict],
    off_answers: Path,
    tmp_path: Path,
) -> None:
    other = servers.healthy("other_table")
    assert PLUGIN_LINE + str(sidecars["other"]) in log_text(other)
    code, record = validate_ab(off_answers, other, tmp_path / "ab")
    ab_records["other_table"] = record
    print(f"\nE2E-AB other_table {json.dumps(summary(record))}")
    assert code == 1, json.dumps(record["verdict"])
    assert record["verdict"]["status"] == "fail"
    assert record["summary"]["kl"]["mean"] > 0.01


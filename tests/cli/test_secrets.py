"""Issue 42: one redaction serves every output (text, JSON, files, logs).

Secrets are planted everywhere a user puts them: an API key and an HF token on the command line
(flag and ``--flag=value`` forms), credentials in a URL, and ``HF_TOKEN`` / ``OPENAI_API_KEY`` in
the environment of flashnext and of the server it captures. Every command that echoes a command
line, an environment or a log then runs for real, and every byte it writes (stdout, stderr,
every file under its output) is searched for each secret.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ..cli.inputs import Inputs
from .runner import run
from .servers import openai_server

API_KEY = "sk-planted-API-key-0001"
HF_FLAG = "hf_plantedFLAGtoken0002"
URL_PW = "planted-url-pw-0003"
HF_ENV = "hf_plantedENVtoken0004"
OPENAI_ENV = "sk-planted-ENV-key-0005"
SECRETS = (API_KEY, HF_FLAG, URL_PW, HF_ENV, OPENAI_ENV)
ENV = {"HF_TOKEN": HF_ENV, "OPENAI_API_KEY": OPENAI_ENV}


def _leaks(texts: dict[str, str]) -> list[str]:
    return [f"{where}: {s}: {text[max(0, text.find(s) - 200):text.find(s) + 50]}"
            for where, text in texts.items() for s in SECRETS if s in text]  # fmt: skip


def _run_all(*args: object, out: Path | None = None) -> dict[str, str]:
    """stdout, stderr and every file under ``out`` of ``flashnext ARGS``."""
    p = run(*args, env=ENV)
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    name = " ".join(map(str, args))
    texts = {f"{name}: stdout": p.stdout, f"{name}: stderr": p.stderr}
    if out is not None and out.exists():
        files = [out] if out.is_file() else [f for f in out.rglob("*") if f.is_file()]
        texts |= {str(f): f.read_bytes().decode("utf-8", "replace") for f in files}
    return texts


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    """A real server process with a key, HTTP Basic credentials and secrets in its env."""
    tmp = tmp_path_factory.mktemp("secrets")
    with openai_server(tmp, key=API_KEY, basic=f"u:{URL_PW}", env=ENV) as srv:
        yield srv


def test_check_redacts_serve_args_env_and_the_process_environment(cli_inputs: Inputs) -> None:
    args = ["check", "--model", cli_inputs.checkpoint, "--gpu", "sm120,96GiB",
            "--env", f"HF_TOKEN={HF_ENV}", "--", "--api-key", API_KEY, f"--hf-token={HF_FLAG}",
            "--served-model-name", "m"]  # fmt: skip
    texts = _run_all(*args[:5], "--json", *args[5:]) | _run_all(*args)
    assert not _leaks(texts), _leaks(texts)
    record = json.loads(next(t for k, t in texts.items() if "--json" in k and "stdout" in k))
    assert record["kind"] == "flashnext.deploy.check", record
    assert record["serve_args"][:2] == ["--api-key", "<redacted>"]  # redacted, not dropped


def test_record_capture_diff_and_restore_redact(server, tmp_path: Path) -> None:
    url = server.url.replace("http://", f"http://u:{URL_PW}@")
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    texts = _run_all("record", "capture", "--url", url, "--api-key", API_KEY, "--output", a,
                     out=a)  # fmt: skip
    texts |= _run_all("record", "capture", "--url", url, "--output", b, out=b)
    assert a.is_file() and b.is_file(), texts
    launch = json.loads(a.read_text())["launch"]
    assert launch["env"]["HF_TOKEN"] == "<redacted>" and "--key" in launch["argv"]
    texts |= _run_all("record", "diff", a, b) | _run_all("record", "diff", a, b, "--json")
    script = tmp_path / "r.sh"
    texts |= _run_all("record", "restore", a) | _run_all("record", "restore", a, "--output",
                                                         script, out=script)  # fmt: skip
    assert not _leaks(texts), _leaks(texts)


def test_validate_and_ab_redact_in_every_file_and_stream(server, tmp_path: Path) -> None:
    url = server.url.replace("http://", f"http://u:{URL_PW}@")
    out = tmp_path / "v"
    texts = _run_all("validate", "--url", url, "--api-key", API_KEY, "--stages", "ready",
                     "--no-nvml", "--json", "--out", out, out=out)  # fmt: skip
    assert (out / "report.json").is_file(), texts
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "p1", "prompt": "Hello"}\n')
    ab = tmp_path / "ab"
    texts |= _run_all("validate", "ab", "--baseline", url, "--candidate", url + "/",
                      f"--api-key={API_KEY}", "--prompts", prompts, "--timeout", "2",
                      "--no-png", "--out", ab, out=ab)  # fmt: skip
    assert (ab / "ab.json").is_file(), texts
    assert not _leaks(texts), _leaks(texts)


def test_explain_redacts_a_log_that_quotes_secrets(tmp_path: Path) -> None:
    log = tmp_path / "vllm.log"
    log.write_text(
        "INFO 12-04 03:00:00 [utils.py:1] non-default args: {'model': '/m', 'api_key': "
        f"'{API_KEY}', 'hf_token': '{HF_FLAG}'}}\n"
        f"INFO vllm serve /m --api-key {API_KEY} --hf-token {HF_FLAG}\n"
        f"INFO loading from https://u:{URL_PW}@example.invalid/m with {HF_ENV}\n"
        "ERROR ValueError: No available memory for the cache blocks. Try increasing "
        "`gpu_memory_utilization` when initializing the engine.\n"
    )
    texts = _run_all("explain", log) | _run_all("explain", log, "--json")
    assert not _leaks(texts), _leaks(texts)


def test_redact_covers_every_shape_and_stays_linear_on_long_lines() -> None:
    from flashnext.records import REDACTED, redact

    got = redact({"argv": ["vllm", "--api-key", API_KEY, f"--hf-token={HF_FLAG}"],
                  "env": {"HF_TOKEN": "short", "PATH": "/bin"},
                  "url": f"http://u:{URL_PW}@h:1/v1", "top1_token": "key",
                  "log": [f"loaded with {HF_ENV}"]}, secrets=[HF_ENV])  # fmt: skip
    assert got == {"argv": ["vllm", "--api-key", REDACTED, f"--hf-token={REDACTED}"],
                   "env": {"HF_TOKEN": REDACTED, "PATH": "/bin"},
                   "url": f"http://{REDACTED}@h:1/v1", "top1_token": "key",
                   "log": [f"loaded with {REDACTED}"]}  # fmt: skip
    # 1 MB adversarial lines (a letter run with an @, many schemes): linear, so they return
    for line in ("a" * 1_000_000 + "@x", "http://" * 150_000 + "@", "a1+" * 300_000 + "@"):
        assert redact(line) == line

"""Pieces of the validator that need no server: parser, image, NVML, CLI input, SSE lines."""

from __future__ import annotations

import ctypes.util
import io
import sys
import time
from pathlib import Path

import pytest

from flashnext.validate.images import make_png, png_data_url
from flashnext.validate.probes import NvmlSampler, metric_value, parse_prometheus

from ..cli.runner import run_in_process


def _nvml_gpu() -> str | None:
    """None when NVML sees a GPU here, else the reason it does not."""
    try:
        import pynvml
    except ImportError:
        return "nvidia-ml-py is not installed"
    try:
        pynvml.nvmlInit()
        n = pynvml.nvmlDeviceGetCount()
        pynvml.nvmlShutdown()
    except Exception as exc:
        return f"NVML not usable: {exc}"
    return None if n > 0 else "NVML sees no GPU"


NO_GPU_REASON = _nvml_gpu()


def test_parse_prometheus_labels_and_sums() -> None:
    text = (
        "# HELP x y\n"
        'vllm:num_requests_running{engine="0",model_name="a,b"} 3.0\n'
        'vllm:num_requests_running{engine="1",model_name="say \\"hi\\""} 2\n'
        "process_start_time_seconds 1.7e+09\n"
        "garbage line\n"
        "vllm:kv_cache_usage_perc NaN\n"
    )
    m = parse_prometheus(text)
    assert m["vllm:num_requests_running"][0][0] == {"engine": "0", "model_name": "a,b"}
    assert m["vllm:num_requests_running"][1][0]["model_name"] == 'say \\"hi\\"'
    assert metric_value(m, "running") == 5.0
    assert metric_value(m, "start_time") == 1.7e9
    assert metric_value(m, "preemptions") is None
    assert "garbage" not in m


def test_png_is_a_valid_image() -> None:
    from PIL import Image

    png = make_png(40, 24)
    img = Image.open(io.BytesIO(png))
    img.load()
    assert img.size == (40, 24) and img.mode == "RGB"
    assert img.getpixel((20, 12)) == (255, 0, 0)
    assert img.getpixel((0, 0)) == (0, 0, 128)
    assert png_data_url(png).startswith("data:image/png;base64,iVBORw0KGgo")
    with pytest.raises(ValueError, match="image size 0x5"):
        make_png(0, 5)


def test_nvml_degrades_without_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml now raises ImportError
    s = NvmlSampler(time.monotonic())
    s.start()
    s.stop()
    assert s.status == (
        "not available: the 'nvidia-ml-py' package is not installed (pip install 'flashnext[nvml]')"
    )
    assert s.to_dict()["summary"] == {"status": s.status}


@pytest.mark.skipif(
    ctypes.util.find_library("nvidia-ml") is not None,
    reason="libnvidia-ml is present; the no-library degradation is tested where it is absent",
)
def test_nvml_not_available_without_driver() -> None:
    s = NvmlSampler(time.monotonic())
    s.start()
    s.stop()
    assert s.status == "not available: NVML Shared Library Not Found"
    assert s.samples == []


@pytest.mark.skipif(NO_GPU_REASON is not None, reason=f"needs an NVIDIA GPU: {NO_GPU_REASON}")
def test_nvml_samples_gpu_memory() -> None:
    s = NvmlSampler(time.monotonic(), gpu_index=0, interval_s=0.1)
    s.start()
    time.sleep(1.2)
    s.stop()
    assert s.status == "ok"
    assert s.device["name"] and s.device["driver"] and s.device["total_bytes"] > 0
    rows = [x for x in s.samples if "used" in x]
    assert len(rows) >= 6  # a fixed interval, not a one-off reading
    assert all(0 < x["used"] <= s.device["total_bytes"] for x in rows)
    assert all(x["used"] + x["free"] <= s.device["total_bytes"] for x in rows)
    summary = s.summary()
    assert summary["peak_used_bytes"] == max(x["used"] for x in rows)
    assert summary["min_free_bytes"] == min(x["free"] for x in rows)


@pytest.mark.skipif(NO_GPU_REASON is not None, reason=f"needs an NVIDIA GPU: {NO_GPU_REASON}")
def test_nvml_gpu_index_out_of_range() -> None:
    s = NvmlSampler(time.monotonic(), gpu_index=999)
    s.start()
    s.stop()
    assert s.status.startswith("not available: --gpu-index 999 but NVML sees ")


def _cli_error(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    code, _, err = run_in_process(list(args), capsys)
    assert code != 0
    return err.strip()


def test_cli_rejects_bad_input(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert _cli_error(capsys, "validate", "--url", "ftp://x") == (
        "error: --url 'ftp://x': expected the server root, e.g. http://127.0.0.1:8000 "
        "(see `flashnext validate --help`)"
    )
    assert _cli_error(capsys, "validate") == (
        "error: --url is required, e.g. --url http://127.0.0.1:8000"
    )
    assert _cli_error(capsys, "validate", "--url", "http://127.0.0.1:1", "--stages", "short,x") == (
        "error: --stages 'short,x': unknown stage(s) ['x']; expected a comma-separated subset "
        "of ready,short,long,multimodal,concurrency,prefix-cache,sustained "
        "(see `flashnext validate --help`)"
    )
    assert _cli_error(capsys, "validate", "--url", "http://127.0.0.1:1", "--rounds", "0") == (
        "error: Invalid value for '--rounds': 0 is not in the range x>=1. "
        "(see `flashnext validate --help`)"
    )
    f = tmp_path / "file"
    f.write_text("x")
    assert _cli_error(capsys, "validate", "--url", "http://127.0.0.1:1", "--out", str(f)) == (
        f"error: Invalid value for '--out': Directory '{f}' is a file. "
        "(see `flashnext validate --help`)"
    )
    assert _cli_error(capsys, "validate", "compare", str(f), str(f)).startswith(
        f"error: {f}: cannot read a report.json"
    )
    # checked before any stage runs: the run's evidence would be lost otherwise
    assert _cli_error(
        capsys, "validate", "--url", "http://127.0.0.1:1", "--out", str(f / "sub")
    ).startswith(f"error: Invalid value for '--out': {f} is a file, not a directory")
    assert (
        _cli_error(capsys, "validate", "--url", "http://127.0.0.1:1", "--temperature", "-1")
        == "error: Invalid value for '--temperature': -1.0 is not in the range 0<=x<=2. "
        "(see `flashnext validate --help`)"
    )
    incomplete = tmp_path / "incomplete.json"
    incomplete.write_text('{"schema_version": 1}')
    assert _cli_error(capsys, "validate", "compare", str(incomplete), str(incomplete)).startswith(
        f"error: {incomplete}: not a flashnext validate report"
    )


def test_sse_lines_split_only_at_line_feeds() -> None:
    import asyncio

    from flashnext.validate.client import sse_lines

    # U+2028 and U+0085 are legal unescaped inside JSON strings; CRLF and split chunks too.
    payload = 'data: {"c": "a\u2028b\x85c"}\r\n\r\ndata: [DO'.encode() + b"NE]\n"

    async def chunks():  # the bytes arrive in awkward pieces, as from a socket
        for i in range(0, len(payload), 5):
            yield payload[i : i + 5]

    async def collect() -> list[str]:
        return [line async for line in sse_lines(chunks())]

    assert asyncio.run(collect()) == ['data: {"c": "a\u2028b\x85c"}', "", "data: [DONE]"]


@pytest.mark.parametrize("chars_per_token", [1.0, 1.7, 4.0])
def test_prefix_cache_prefix_fits_a_short_context_whatever_the_tokenizer(
    chars_per_token: float,
) -> None:
    """The prefix-cache prompt is sized by counting, not by a fixed chars/token ratio: with a
    256-token context (the e2e server) the longest request fits for a coarse tokenizer (1
    char/token, a 512-token BPE is close) as for a fine one, and is not far under the target."""
    import asyncio

    from flashnext.validate.stages import prompts
    from flashnext.validate.stages.cache import QUESTION_TOKENS, fit_prefix_chars

    template = len(prompts.prefix_prompt("", 4)[0]["content"])

    async def count(chars: int) -> int:
        # A tokenizer of ``chars_per_token`` plus a chat template of 12 tokens.
        return 12 + int((len(prompts.shared_prefix("0" * 32, chars)) + template) / chars_per_token)

    target = min(128, 256 - 16 - QUESTION_TOKENS)
    chars, counted = asyncio.run(fit_prefix_chars(count, target))
    assert counted == asyncio.run(count(chars))
    assert target * 0.8 <= counted <= target, (chars, counted)


def test_prefix_cache_prefix_without_tokenize_assumes_one_char_per_token() -> None:
    import asyncio

    from flashnext.validate.stages.cache import QUESTION_TOKENS, fit_prefix_chars

    async def no_route(chars: int) -> None:
        return None

    assert asyncio.run(fit_prefix_chars(no_route, 128)) == (128 - QUESTION_TOKENS, None)

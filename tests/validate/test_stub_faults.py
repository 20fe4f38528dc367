"""Faults a real vLLM server cannot be made to produce, injected by a named stub server.

``StubServerMissingFinishReason`` is a real HTTP server on 127.0.0.1 that speaks just enough of
the OpenAI API to be validated, but streams completions that never carry a finish_reason.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from ..cli.runner import run
from .test_live_server import by_name


class StubServerMissingFinishReason(BaseHTTPRequestHandler):
    """OpenAI-style endpoints whose chat stream ends without any finish_reason."""

    def log_message(self, *args: object) -> None:  # keep the test output quiet
        pass

    def _send(self, status: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path == "/health":
            self._send(200, b"")
        elif self.path == "/v1/models":
            data = {"data": [{"id": "stub", "max_model_len": 256}]}
            self._send(200, json.dumps(data).encode())
        else:
            self._send(404, b'{"error": {"message": "not found"}}')

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.path != "/v1/chat/completions":
            self._send(404, b'{"error": {"message": "not found"}}')
            return
        chunks = [
            {"choices": [{"index": 0, "delta": {"content": w}, "finish_reason": None}]}
            for w in ("hello", " there")
        ]
        chunks.append({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2}})
        body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        self._send(200, body.encode(), "text/event-stream")


@pytest.fixture
def stub_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), StubServerMissingFinishReason)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_missing_finish_reason_fails_short_and_concurrency(stub_url: str, tmp_path: Path) -> None:
    p = run(
        "validate",
        "--url",
        stub_url,
        "--stages",
        "ready,short,concurrency",
        "--rounds",
        "1",
        "--concurrency",
        "4",
        "--out",
        str(tmp_path),
        "--no-png",
    )
    assert p.returncode == 1
    report = json.loads((tmp_path / "report.json").read_text())
    s = by_name(report)
    assert s["ready"]["status"] == "pass"
    assert s["short"]["status"] == "fail"
    assert s["short"]["reason"] == (
        "request failed (missing_finish_reason): the stream ended without a finish_reason"
    )
    conc = s["concurrency"]
    assert conc["status"] == "fail"
    assert conc["evidence"]["rounds"][0]["errors"] == {"missing_finish_reason": 4}
    assert conc["key"]["completed"] == "0/4"
    # /metrics is absent here: the probe says so instead of inventing restarts
    assert report["probes"]["metrics"]["available"] is False
    assert report["probes"]["metrics"]["events"] == []
    # no request completed: the key numbers say "unknown", not 0 (which `compare` would
    # read as an improvement)
    assert conc["key"]["ttft_p90_s"] is None and conc["key"]["output_tok_s"] is None


class StubServerWithoutHealth(StubServerMissingFinishReason):
    """An OpenAI-compatible server with no /health route (vLLM always has one)."""

    def do_GET(self) -> None:
        if self.path == "/health":
            self._send(404, b'{"error": {"message": "not found"}}')
        else:
            super().do_GET()


def test_server_without_health_route_is_ready_by_its_model_list(tmp_path: Path) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), StubServerWithoutHealth)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        p = run("validate", "--url", url, "--stages", "ready", "--ready-timeout", "60",
                      "--out", str(tmp_path), "--no-png")  # fmt: skip
    finally:
        server.shutdown()
        server.server_close()
    report = json.loads((tmp_path / "report.json").read_text())
    ready = by_name(report)["ready"]
    assert p.returncode == 0 and ready["status"] == "pass", ready
    assert ready["duration_s"] < 10  # not the 60 s deadline


class StubServerBrokenLogprobs(BaseHTTPRequestHandler):
    """/v1/completions answering a scoring request with the logprobs of ``SERVED[path]``: the
    malformed values a broken kernel or server sends (NaN, null), which a working vLLM does
    not produce on demand."""

    served: dict[str, object] = {}

    def log_message(self, *args: object) -> None:
        pass

    def do_POST(self) -> None:
        request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        n = len(request["prompt"])
        rows: list[object] = [None] + [{"7": {"logprob": -0.5}} for _ in range(n - 1)]
        bad_at = 1 + n // 2
        rows[bad_at] = StubServerBrokenLogprobs.served["row"]
        body = json.dumps({"choices": [{"text": "", "prompt_logprobs": rows}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.mark.parametrize(
    "row, said",
    [
        ({"7": {"logprob": float("nan")}}, "the logprob of token 7 is nan"),
        ({"7": {"logprob": None}}, "the logprob of token 7 is None"),
        ({"7": None}, "the logprob of token 7 is None"),
        ({"7": {"logprob": 0.5}}, "the logprob of token 7 is 0.5"),
        ([1, 2], "logprobs are list, expected an object"),
    ],
)
def test_broken_logprobs_are_a_bad_response_not_a_distribution(row, said, rng) -> None:
    """NaN or null logprobs from a candidate once pooled as nothing (verdict "identical") or
    crashed the report; now the request fails as a bad response naming the position."""
    import asyncio

    from flashnext.validate.ab_server import RequestFailed, Side
    from flashnext.validate.client import Client

    StubServerBrokenLogprobs.served["row"] = row
    server = ThreadingHTTPServer(("127.0.0.1", 0), StubServerBrokenLogprobs)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    tokens = rng.integers(0, 1000, size=int(rng.integers(4, 40))).tolist()

    async def score() -> None:
        side = Side("candidate", Client(f"http://127.0.0.1:{server.server_address[1]}"))
        try:
            await side._score(tokens, 5, "prompt_logprobs")
        finally:
            await side.aclose()

    try:
        with pytest.raises(RequestFailed) as failed:
            asyncio.run(score())
    finally:
        server.shutdown()
        server.server_close()
    assert failed.value.kind == "bad_response"
    assert f"prompt position {1 + len(tokens) // 2}: " in failed.value.message
    assert said in failed.value.message

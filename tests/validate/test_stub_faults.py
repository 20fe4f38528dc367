"""Faults a real vLLM server cannot be made to produce, injected by a named stub server.

``StubServerMissingFinishReason`` is a real HTTP server on 127.0.0.1 that speaks just enough of
the OpenAI API to be validated, but streams completions that never carry a finish_reason.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest

from ..cli.runner import run_here as run
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
    # /metrics is absent here: the probe says so instead of inventing restarts, and so does
    # the one-screen report
    assert report["probes"]["metrics"]["available"] is False
    assert report["probes"]["metrics"]["events"] == []
    assert "No `/metrics` on this server: restarts" in (tmp_path / "report.md").read_text()
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

    served: ClassVar[dict[str, object]] = {}

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


def _serve(handler: type[BaseHTTPRequestHandler]) -> tuple[ThreadingHTTPServer, str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def _validate(
    handler: type[BaseHTTPRequestHandler], out: Path, *args: str
) -> tuple[subprocess.CompletedProcess[str], dict[str, dict]]:
    """``flashnext validate --url STUB *args --out OUT --no-png`` against a fresh ``handler``
    server: the process and the report's stages by name."""
    server, url = _serve(handler)
    try:
        p = run("validate", "--url", url, *args, "--out", str(out), "--no-png")
    finally:
        server.shutdown()
        server.server_close()
    return p, by_name(json.loads((out / "report.json").read_text()))


class StubServerNotARoot(StubServerMissingFinishReason):
    """Any HTTP service that is not an OpenAI server root: 404 on every route."""

    def do_GET(self) -> None:
        self._send(404, b'{"detail": "Not Found"}')


def test_a_url_that_is_no_server_root_fails_ready_in_seconds(tmp_path: Path) -> None:
    p, stages = _validate(StubServerNotARoot, tmp_path, "--stages", "ready")
    ready = stages["ready"]
    assert p.returncode == 1 and ready["status"] == "fail" and ready["duration_s"] < 30, ready
    assert "HTTP 404 on /health and on /v1/models for 10 s: not an OpenAI-compatible server " \
           "root" in ready["reason"]  # fmt: skip


class StubServerTrickle(StubServerMissingFinishReason):
    """A chat stream that sends a token every 0.3 s and never ends (a server stuck decoding,
    past max_tokens): each read is quick, the request never completes."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        chunk = {"choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": None}]}
        try:
            while True:
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.flush()
                time.sleep(0.3)
        except OSError:  # the client gave up
            pass


class StubServerAnswersJson(StubServerMissingFinishReason):
    """Asked to stream, it answers one plain JSON completion (a proxy that buffers)."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        body = {"choices": [{"index": 0, "message": {"content": "hi"}, "finish_reason": "stop"}]}
        self._send(200, json.dumps(body).encode())


@pytest.mark.parametrize(
    "handler, reason",
    [
        (StubServerTrickle, "request failed (timeout): no complete answer within --timeout 3 s"),
        (StubServerAnswersJson, "request failed (bad_response): asked to stream, the server "
                                "answered application/json, not an event stream"),
    ],
)  # fmt: skip
def test_a_stream_that_never_ends_or_is_no_stream_fails_short(tmp_path: Path, handler, reason):
    t0 = time.monotonic()
    p, stages = _validate(handler, tmp_path, "--stages", "ready,short", "--timeout", "3")
    short = stages["short"]
    assert p.returncode == 1 and short["status"] == "fail" and short["reason"] == reason, short
    assert time.monotonic() - t0 < 90


class StubServerIdleClose(StubServerMissingFinishReason):
    """Keeps connections alive, then closes one just as the next request arrives on it: the
    race of a server closing idle connections (uvicorn: after 5 s) with a client reusing one,
    made to happen every time."""

    protocol_version = "HTTP/1.1"

    def _second_request_here(self) -> bool:
        if getattr(self, "_answered", False):
            self.close_connection = True  # no response: "Server disconnected without ..."
            return True
        self._answered = True
        return False

    def do_GET(self) -> None:
        if not self._second_request_here():
            super().do_GET()

    def do_POST(self) -> None:
        if not self._second_request_here():
            super().do_POST()


def test_a_keepalive_closed_while_idle_is_retried_on_a_fresh_connection() -> None:
    import asyncio

    from flashnext.validate.client import Client

    server, url = _serve(StubServerIdleClose)

    async def twice() -> list[object]:
        client = Client(url, timeout_s=5.0)
        try:
            first = await client.get("/v1/models")
            second = await client.get("/v1/models")  # on the pooled connection: dropped
            chat = await client.chat("stub", [{"role": "user", "content": "hi"}], 4)
            return [first, second, chat]
        finally:
            await client.aclose()

    try:
        first, second, chat = asyncio.run(twice())
    finally:
        server.shutdown()
        server.server_close()
    assert first[0] == 200 and second[0] == 200, second  # type: ignore[index]
    # the chat stream itself is this stub's (no finish_reason), but it was answered
    assert chat.status == 200 and chat.content == "hello there", chat  # type: ignore[attr-defined]


class StubServerLyingAnswer(StubServerMissingFinishReason):
    """A complete chat stream whose ``model`` or ``usage`` cannot be true (``LIE`` says which):
    the validator's throughput and fill figures are computed from usage."""

    LIE: ClassVar[dict[str, object]] = {}

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        lie = StubServerLyingAnswer.LIE
        model = lie.get("model", "stub")
        chunks = [{"model": model, "choices": [{"index": 0, "delta": {"content": w},
                                                "finish_reason": None}]} for w in ("a", " b")]  # fmt: skip
        chunks.append({"model": model, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
        chunks.append({"model": model, "choices": [], "usage": {
            "prompt_tokens": lie.get("prompt_tokens", 5),
            "completion_tokens": lie.get("completion_tokens", 2)}})  # fmt: skip
        body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        self._send(200, body.encode(), "text/event-stream")


@pytest.mark.parametrize(
    "lie, reason",
    [
        ({}, None),
        ({"model": "some-other-model"}, "answered as model 'some-other-model', asked for 'stub'"),
        ({"completion_tokens": 10**6}, "usage.completion_tokens is 1000000, outside 0..max_tokens"),
        ({"completion_tokens": 0}, "usage.completion_tokens is 0, yet content arrived"),
        ({"prompt_tokens": 0}, "usage.prompt_tokens is 0, expected at least 1"),
    ],
)
def test_an_answer_from_another_model_or_with_impossible_usage_fails(tmp_path: Path, lie,
                                                                     reason) -> None:  # fmt: skip
    StubServerLyingAnswer.LIE = lie
    p, stages = _validate(StubServerLyingAnswer, tmp_path, "--stages", "ready,short")
    short = stages["short"]
    if reason is None:  # the same stub telling the truth passes: the check is the lie's
        assert p.returncode == 0 and short["status"] == "pass", short
    else:
        assert p.returncode == 1 and short["status"] == "fail", short
        assert short["reason"].startswith(f"request failed (bad_response): {reason}"), short


class StubServerHung(StubServerMissingFinishReason):
    """Answers /health and /v1/models but never a completion (an engine stuck mid-step)."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        time.sleep(30)


def test_a_hung_server_costs_one_round_of_timeouts_not_every_stage(tmp_path: Path) -> None:
    t0 = time.monotonic()
    p, s = _validate(StubServerHung, tmp_path, "--stages", "ready,short,concurrency,sustained",
                     "--timeout", "2", "--rounds", "3", "--concurrency", "2")  # fmt: skip
    assert p.returncode == 1 and time.monotonic() - t0 < 60
    assert s["short"]["reason"].startswith("request failed (timeout)"), s["short"]
    conc = s["concurrency"]
    assert conc["reason"].endswith(
        "round 1: every request timed out (--timeout 2 s): the server is hung; remaining rounds "
        "not run"), conc  # fmt: skip
    assert len(conc["evidence"]["rounds"]) == 1
    assert s["sustained"]["status"] == "skip"
    assert s["sustained"]["reason"] == (
        "server hung since stage concurrency (its requests timed out, --timeout 2 s)")


def test_ab_counts_a_side_down_after_two_timeouts_in_a_row() -> None:
    import asyncio

    from flashnext.validate.ab_server import RequestFailed, Side
    from flashnext.validate.client import Client

    server, url = _serve(StubServerHung)

    async def three() -> list[str]:
        side = Side("candidate", Client(url, timeout_s=1.0))
        kinds = []
        try:
            for _ in range(3):
                try:
                    await side.post("/v1/completions", {"prompt": [1, 2]})
                except RequestFailed as exc:
                    kinds.append(f"{exc.kind}: {exc.message}")
        finally:
            await side.aclose()
        return kinds

    t0 = time.monotonic()
    try:
        kinds = asyncio.run(three())
    finally:
        server.shutdown()
        server.server_close()
    assert [k.split(":")[0] for k in kinds] == ["timeout", "timeout", "skipped"], kinds
    assert kinds[0] == "timeout: POST /v1/completions: ReadTimeout: no answer within 1 s"
    assert "2 requests in a row timed out (--timeout 1 s): hung" in kinds[2]
    assert time.monotonic() - t0 < 10  # the third never waited


class StubServerUsageVsTokenize(StubServerLyingAnswer):
    """/tokenize counts 40 tokens for any prompt; the chat answer's usage says ``LIE``'s
    prompt_tokens (a server whose usage its own tokenizer contradicts)."""

    def do_POST(self) -> None:
        if self.path == "/tokenize":
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self._send(200, b'{"count": 40}')
        else:
            super().do_POST()


@pytest.mark.parametrize("prompt_tokens, ok", [(41, True), (5, False)])
def test_long_checks_usage_against_the_servers_tokenize(tmp_path: Path, prompt_tokens, ok):
    StubServerLyingAnswer.LIE = {"prompt_tokens": prompt_tokens}
    p, stages = _validate(StubServerUsageVsTokenize, tmp_path, "--stages", "ready,long")
    long = stages["long"]
    assert long["key"]["counted_with"] == "tokenize", long
    if ok:
        assert p.returncode == 0 and long["status"] == "pass", long
    else:
        assert p.returncode == 1 and long["reason"] == (
            "usage.prompt_tokens is 5, but the server's /tokenize counted 40 for the same "
            "prompt: its usage counts are wrong"), long  # fmt: skip

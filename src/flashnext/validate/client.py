"""Async HTTP client for an OpenAI-compatible server, with per-request timings.

Every chat request is streamed (``stream: true`` with ``stream_options.include_usage``) so that
the time to first token (TTFT), the gaps between content chunks (inter-token latency, ITL) and
the end-to-end latency are measured on the client, the way a user sees them. A request never
raises: its outcome, including the kind of error, is a :class:`RequestResult`.

Error kinds (``RequestResult.error_kind``):

- ``unreachable``: connection refused or reset, or the stream broke off (the server went away);
- ``timeout``: no answer within the client timeout;
- ``http_<status>``: the server answered with an HTTP error; ``error`` holds its message;
- ``missing_finish_reason``: the stream ended without any choice carrying a finish_reason;
- ``bad_response``: the body was not the JSON an OpenAI-compatible server sends.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import time
import urllib.parse
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from typing import Any

from flashnext._extras import require
from flashnext.errors import ValidationError
from flashnext.records import REDACTED

#: OpenAI routes people paste instead of the server root; dropped by :func:`server_root`.
OPENAI_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/embeddings", "/v1")
_ROOT_EXAMPLE = "expected the server root, e.g. http://127.0.0.1:8000"


def server_root(url: str, flag: str = "--url") -> str:
    """The server root of ``url``: scheme, host, port and any proxy prefix, no OpenAI route.

    ``http://h:8000/v1/chat/completions``, ``.../v1/models`` and ``.../v1`` all give
    ``http://h:8000`` (the validator needs the root for ``/health`` and ``/metrics``).

    Raises:
        ValidationError: one line naming ``flag`` when ``url`` is not an http(s) URL, has a
            bad host or a port outside 1-65535, carries a query or fragment, or ends in an
            unknown ``/v1/...`` route.
    """
    # Credentials are hidden even in a URL too broken for urlsplit (redact_url needs it).
    shown = repr(re.sub(r"//[^/@]*@", f"//{REDACTED}@", url))
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError as exc:  # "Invalid IPv6 URL", "Port out of range 0-65535", ...
        raise ValidationError(f"{flag} {shown}: not a valid URL ({exc}); {_ROOT_EXAMPLE}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValidationError(f"{flag} {shown}: {_ROOT_EXAMPLE}")
    if port == 0:
        raise ValidationError(f"{flag} {shown}: port 0 is not a server port (1-65535)")
    if parts.query or parts.fragment:
        raise ValidationError(f"{flag} {shown}: has a query or fragment; {_ROOT_EXAMPLE}")
    path = parts.path.rstrip("/")
    route = next((r for r in OPENAI_ROUTES if path.endswith(r)), None)
    if route is not None:
        path = path[: -len(route)]
    elif "/v1/" in path + "/":
        raise ValidationError(
            f"{flag} {shown}: {parts.path} is not a route the validator knows; {_ROOT_EXAMPLE}"
        )
    return f"{parts.scheme}://{parts.netloc}{path}"


#: Completion requests in a row that time out after which a server counts as hung.
HUNG_AFTER_TIMEOUTS = 2


@dataclass
class RequestResult:
    """The outcome and client-side timings of one chat completion (seconds throughout)."""

    ok: bool
    started: float  # time.monotonic() when the request was sent
    e2e_s: float | None = None
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    content: str = ""
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    error_kind: str | None = None
    error: str | None = None
    status: int | None = None
    model: str | None = None  # the model the stream says answered

    def summary(self) -> dict[str, Any]:
        """A JSON-ready record without the bulky per-chunk gaps and content."""
        d = asdict(self)
        d.pop("itl_s")
        d["content_chars"] = len(d.pop("content"))
        return d


def _error_message(body: bytes) -> str:
    """The server's error text from an OpenAI-style error body, else the raw body, as one
    short line (:func:`brief`)."""
    try:
        data = json.loads(body)
    except ValueError:
        return brief(body.decode("utf-8", "replace"))
    if isinstance(data, dict):
        err = data.get("error", data)
        if isinstance(err, dict) and "message" in err:
            return brief(str(err["message"]))
        if "message" in data:
            return brief(str(data["message"]))
    return brief(json.dumps(data))


_TITLE = re.compile(r"<title[^>]{0,200}>([^<]{0,500})</title>", re.IGNORECASE)
_TAG = re.compile(r"<[^<>]{0,1000}>")
BRIEF_CHARS = 300


def brief(text: str, limit: int = BRIEF_CHARS) -> str:
    """A server's answer as one line for a report or a message: an HTML page (a proxy's or a
    web server's 404) by its title, else its text without tags; whitespace collapsed; cut at
    ``limit`` characters with the length said."""
    head = text[:100_000]  # bounded work on whatever a server sends
    if "<html" in head[:2000].lower() or "<!doctype" in head[:2000].lower():
        title = _TITLE.search(head)
        head = f"HTML page: {title.group(1)}" if title else "HTML page: " + _TAG.sub(" ", head)
    line = " ".join(head.split())
    if len(line) > limit or len(text) > 100_000:
        return f"{line[:limit].rstrip()}... ({len(text)} characters)"
    return line


async def sse_lines(chunks: AsyncIterator[bytes]) -> AsyncIterator[str]:
    """Server-sent-event lines from a byte stream, split only at LF (an optional CR stripped).

    Not ``httpx``'s ``aiter_lines``: it splits like ``str.splitlines``, also at U+2028, U+0085,
    U+001C and friends, which JSON leaves unescaped inside strings, so a model that generates one
    of them would cut a ``data:`` line in two.
    """
    buf = b""
    async for chunk in chunks:
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            yield line.rstrip(b"\r").decode("utf-8", "replace")
    if buf:
        yield buf.rstrip(b"\r").decode("utf-8", "replace")


class Client:
    """A thin async wrapper over ``httpx.AsyncClient`` for one server.

    ``base_url`` is the server root (``http://host:port``); OpenAI routes are under ``/v1``.
    """

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        timeout_s: float = 180.0,
        max_connections: int = 256,
    ) -> None:
        httpx = require("httpx", "validate", "flashnext validate")
        self._httpx = httpx
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=64)
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        #: Completion requests that timed out since the last one that did not (see ``hung``).
        self.timeouts_in_a_row = 0
        self.http = httpx.AsyncClient(
            base_url=self.base_url,
            headers=headers,
            timeout=httpx.Timeout(timeout_s, connect=min(10.0, timeout_s)),
            limits=limits,
        )

    async def aclose(self) -> None:
        """Close the connection pool."""
        await self.http.aclose()

    def _kind(self, exc: BaseException) -> str:
        """``timeout``; ``unreachable`` (no connection could be made); ``disconnected`` (a
        connection made, then reset or closed mid-request: a server shedding load is still
        there); else ``bad_response``."""
        httpx = self._httpx
        if isinstance(exc, httpx.TimeoutException):
            return "timeout"
        if isinstance(exc, (httpx.ConnectError, ConnectionRefusedError)):
            return "unreachable"
        if isinstance(exc, (httpx.TransportError, ConnectionError)):
            return "disconnected"
        return "bad_response"

    def count(self, error_kind: str | None) -> None:
        """Count one completion request's outcome (``error_kind`` None: it was answered)."""
        self.timeouts_in_a_row = self.timeouts_in_a_row + 1 if error_kind == "timeout" else 0

    @property
    def hung(self) -> bool:
        """:data:`HUNG_AFTER_TIMEOUTS` completion requests in a row timed out: the server
        answers none, and every later request would cost the whole timeout again."""
        return self.timeouts_in_a_row >= HUNG_AFTER_TIMEOUTS

    async def gone(self) -> bool:
        """After a connection reset: whether ``/health`` is gone too (a killed server) rather
        than the server shedding load."""
        return (await self.get("/health", 5.0))[0] != 200

    def describe(self, exc: BaseException, timeout_s: float | None = None) -> str:
        """``Type: message`` of a failed request, never with nothing after the type (httpx's
        timeouts and resets often carry no message)."""
        text = str(exc).strip()
        if not text and isinstance(exc, self._httpx.TimeoutException):
            text = f"no answer within {timeout_s or self.timeout_s:g} s"
        return f"{type(exc).__name__}: {text or 'the connection failed without a message'}"

    def _stale_keepalive(self, exc: BaseException) -> bool:
        """A pooled connection the server had closed while idle (uvicorn closes them after 5
        s): the request never reached it, and one retry on a fresh connection is the fix."""
        return isinstance(exc, self._httpx.RemoteProtocolError) and "disconnected" in str(exc)

    def _retry_get(self, exc: BaseException) -> bool:
        """A GET (idempotent) is retried once after a dropped or reset connection too."""
        return self._stale_keepalive(exc) or isinstance(exc, self._httpx.ReadError)

    async def get(self, path: str, timeout_s: float = 10.0) -> tuple[int | None, str, str | None]:
        """GET ``path``: (status or None, body text, error kind or None). Never raises."""
        for attempt in (0, 1):
            try:
                r = await self.http.get(path, timeout=timeout_s)
                break
            except Exception as exc:  # every failure is data for the report
                if attempt == 0 and self._retry_get(exc):
                    continue
                return None, self.describe(exc, timeout_s), self._kind(exc)
        return r.status_code, r.text, None

    async def get_json(self, path: str, timeout_s: float = 10.0) -> Any | None:
        """GET ``path`` and decode JSON; None on any failure (callers record that as absence)."""
        status, text, _ = await self.get(path, timeout_s)
        if status != 200:
            return None
        try:
            return json.loads(text)
        except ValueError:
            return None

    async def count_tokens(self, model: str, messages: list[dict[str, Any]]) -> int | None:
        """Prompt tokens of ``messages`` with the chat template, from the server's ``/tokenize``.

        vLLM and SGLang expose it; None when the server has no such route.
        """
        try:
            r = await self.http.post(
                "/tokenize", json={"model": model, "messages": messages}, timeout=30.0
            )
        except Exception:
            return None
        if r.status_code != 200:
            return None
        try:
            data = r.json()
        except ValueError:
            return None
        count = data.get("count") if isinstance(data, dict) else None
        if count is None and isinstance(data, dict) and isinstance(data.get("tokens"), list):
            count = len(data["tokens"])
        return int(count) if count is not None else None

    async def _stream(
        self, payload: dict[str, Any], res: RequestResult, parts: list[str], marks: list[float]
    ) -> None:
        """POST a streamed chat completion and fold its answer into ``res`` (see ``chat``)."""
        async with self.http.stream("POST", "/v1/chat/completions", json=payload) as r:
            res.status = r.status_code
            if r.status_code != 200:
                res.error_kind = f"http_{r.status_code}"
                res.error = _error_message(await r.aread())
            elif not r.headers.get("content-type", "").startswith("text/event-stream"):
                res.error_kind = "bad_response"
                res.error = (f"asked to stream, the server answered "
                             f"{r.headers.get('content-type') or 'no content type'}, not an "
                             "event stream")  # fmt: skip
            else:
                await _read_stream(r.aiter_bytes(), res, parts, marks)

    async def chat(
        self,
        model: str,
        messages: list[dict[str, Any]],
        max_tokens: int,
        temperature: float = 0.0,
        extra: dict[str, Any] | None = None,
    ) -> RequestResult:
        """One streamed chat completion; timings from the first byte of each content chunk."""
        payload: dict[str, Any] = {
            "model": model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if extra:
            payload.update(extra)
        t0 = time.monotonic()
        res = RequestResult(ok=False, started=t0)
        parts: list[str] = []
        marks: list[float] = []  # arrival time of each content piece
        for attempt in (0, 1):
            try:  # --timeout bounds the whole request, not each read of a trickling stream
                await asyncio.wait_for(self._stream(payload, res, parts, marks), self.timeout_s)
            except ValueError as exc:
                res.error_kind, res.error = "bad_response", f"undecodable stream chunk: {exc}"
            except asyncio.TimeoutError:
                res.error_kind = "timeout"
                res.error = f"no complete answer within --timeout {self.timeout_s:g} s"
            except Exception as exc:  # transport failures are outcomes, not crashes
                if attempt == 0 and res.status is None and self._stale_keepalive(exc):
                    continue
                res.error_kind, res.error = self._kind(exc), self.describe(exc)
            break
        res.e2e_s = time.monotonic() - t0
        res.content = "".join(parts)
        if marks:
            res.ttft_s = marks[0] - t0
            res.itl_s = [b - a for a, b in itertools.pairwise(marks)]
        if res.error_kind is None and res.finish_reason is None:
            res.error_kind = "missing_finish_reason"
            res.error = "the stream ended without a finish_reason"
        if res.error_kind is None:
            wrong = _answer_problem(res, model, max_tokens)
            if wrong:
                res.error_kind, res.error = "bad_response", wrong
        res.ok = res.error_kind is None
        self.count(res.error_kind)
        return res


def _answer_problem(res: RequestResult, model: str, max_tokens: int) -> str | None:
    """What makes a complete answer wrong: another model answered, or its usage cannot be
    true (throughput and fill figures are computed from it)."""
    if res.model is not None and res.model != model:
        return f"answered as model {res.model!r}, asked for {model!r}"
    done = res.completion_tokens
    if done is not None and (not isinstance(done, int) or done < 0 or done > max_tokens):
        return f"usage.completion_tokens is {done!r}, outside 0..max_tokens {max_tokens}"
    if done == 0 and res.content:
        return "usage.completion_tokens is 0, yet content arrived"
    prompt = res.prompt_tokens
    if prompt is not None and (not isinstance(prompt, int) or prompt < 1):
        return f"usage.prompt_tokens is {prompt!r}, expected at least 1"
    return None


async def _read_stream(
    chunks: AsyncIterator[bytes], res: RequestResult, parts: list[str], marks: list[float]
) -> None:
    """Fold an SSE chat stream into ``res``: content pieces (and their arrival times in
    ``marks``), finish_reason, usage, or an error object sent inside the stream.

    Raises:
        ValueError: a ``data:`` line is not JSON.
    """
    async for line in sse_lines(chunks):
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        chunk = json.loads(data)
        if "error" in chunk:
            res.error_kind, res.error = "server_error", _error_message(data.encode())
            return
        now = time.monotonic()
        if chunk.get("model") is not None and res.model is None:
            res.model = str(chunk["model"])
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            text = delta.get("content") or delta.get("reasoning_content") or ""
            if text:
                parts.append(text)
                marks.append(now)
            if choice.get("finish_reason"):
                res.finish_reason = choice["finish_reason"]
        usage = chunk.get("usage")
        if usage:
            res.prompt_tokens = usage.get("prompt_tokens")
            res.completion_tokens = usage.get("completion_tokens")

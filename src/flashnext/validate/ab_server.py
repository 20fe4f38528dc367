"""One side of an A/B run: a server's info, tokenization, greedy generation and scoring.

Everything goes through vLLM's OpenAI-compatible routes with token ids, so that both servers
see exactly the same tokens: ``/tokenize`` (the chat template applied by the server),
``/v1/completions`` with a token-id prompt for generation (``logprobs=K``,
``return_tokens_as_token_ids``) and for teacher-forced scoring (``prompt_logprobs=K``, vLLM's
extension; else ``echo`` with ``logprobs``, the legacy OpenAI way). Failures raise
:class:`RequestFailed` with a kind like :class:`~flashnext.validate.client.RequestResult`'s.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

from flashnext.records import redact_url
from flashnext.validate.ab_metrics import TopK
from flashnext.validate.client import Client, _error_message, brief

_TOKEN_ID = "token_id:"


class RequestFailed(Exception):
    """A request to one server failed: ``kind`` (unreachable, timeout, http_N, bad_response)."""

    def __init__(self, side: str, kind: str, message: str) -> None:
        super().__init__(f"{side}: {kind}: {message}")
        self.side = side
        self.kind = kind
        self.message = message


@dataclass
class Generation:
    """A greedy continuation: token ids, text, finish reason."""

    token_ids: list[int]
    text: str
    finish_reason: str | None


@dataclass
class Side:
    """One server under comparison. ``tf_mode``: how it scores a given continuation
    (``prompt_logprobs`` | ``echo`` | ``unsupported``; None until first tried)."""

    name: str
    client: Client
    model: str | None = None
    version: str | None = None
    models: Any = None
    max_model_len: int | None = None
    requests: int = 0
    down: str | None = None
    tf_mode: str | None = None
    tf_note: str | None = None
    _tf_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def info(self) -> dict[str, Any]:
        """JSON-ready description for the record (URL credentials redacted)."""
        return {
            "url": redact_url(self.client.base_url),
            "model": self.model,
            "version": self.version,
            "max_model_len": self.max_model_len,
            "models": self.models,
            "requests": self.requests,
            "teacher_forcing": self.tf_mode,
            "teacher_forcing_note": self.tf_note,
            "down": self.down,
        }

    async def aclose(self) -> None:
        """Close the connection pool."""
        await self.client.aclose()

    async def post(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        """POST JSON; the decoded object, or :class:`RequestFailed` (server marked down when
        unreachable, so that later prompts are not sent to it)."""
        if self.down:
            raise RequestFailed(self.name, "skipped", f"server down earlier ({self.down})")
        self.requests += 1
        try:
            r = await self.client.http.post(path, json=payload)
        except Exception as exc:  # every transport failure is data for the report
            kind = self.client._kind(exc)
            if kind == "disconnected" and await self.client.gone():
                kind = "unreachable"  # reset, and gone: a killed server, not one shedding load
            if kind == "unreachable":
                self.down = f"{type(exc).__name__} on POST {path}"
            self.client.count(kind)
            if self.client.hung:
                self.down = (f"{self.client.timeouts_in_a_row} requests in a row timed out "
                             f"(--timeout {self.client.timeout_s:g} s): hung")  # fmt: skip
            raise RequestFailed(self.name, kind, f"POST {path}: {self.client.describe(exc)}") from None
        self.client.count(None)
        if r.status_code != 200:
            raise RequestFailed(self.name, f"http_{r.status_code}", _error_message(r.content))
        try:
            data = r.json()
        except ValueError:
            raise RequestFailed(self.name, "bad_response", f"POST {path}: not JSON") from None
        if not isinstance(data, dict):
            raise RequestFailed(self.name, "bad_response", f"POST {path}: not a JSON object")
        return data

    async def load_info(self, wanted_model: str | None) -> None:
        """/version and /v1/models; picks the served model (``wanted_model`` or the first).

        Raises:
            RequestFailed: /v1/models did not answer or does not list the wanted model.
        """
        self.requests += 2
        version = await self.client.get_json("/version")
        self.version = version.get("version") if isinstance(version, dict) else None
        status, text, kind = await self.client.get("/v1/models")
        if status != 200:
            self.down = None if status else f"{kind} on GET /v1/models"
            raise RequestFailed(self.name, kind or f"http_{status}",
                                f"GET /v1/models: {brief(text)}")  # fmt: skip
        try:
            self.models = json.loads(text)
            served = [m for m in self.models["data"] if isinstance(m, dict)]
        except (ValueError, KeyError, TypeError):
            raise RequestFailed(self.name, "bad_response", "GET /v1/models: no data list") from None
        ids = [m.get("id") for m in served]
        if not served or (wanted_model and wanted_model not in ids):
            raise RequestFailed(
                self.name, "no_model", f"model {wanted_model!r} not served; served: {ids}"
            )
        entry = served[ids.index(wanted_model)] if wanted_model else served[0]
        self.model = entry["id"]
        self.max_model_len = entry.get("max_model_len")

    async def tokenize(self, prompt_messages: Any, text: str | None) -> list[int]:
        """Token ids of a chat (template applied, generation prompt added) or of plain text."""
        payload: dict[str, Any] = {"model": self.model}
        if text is not None:
            payload["prompt"] = text
        else:
            payload.update(messages=prompt_messages, add_generation_prompt=True)
        data = await self.post("/tokenize", payload)
        tokens = data.get("tokens")
        if not isinstance(tokens, list):
            raise RequestFailed(self.name, "bad_response", "/tokenize: no token list")
        return [int(t) for t in tokens]

    async def generate(self, prompt: list[int], max_tokens: int, k: int, seed: int) -> Generation:
        """Greedy continuation of a token-id prompt (temperature 0, fixed seed)."""
        data = await self.post(
            "/v1/completions",
            {
                "model": self.model,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "seed": seed,
                "logprobs": k,
                "return_tokens_as_token_ids": True,
                "return_token_ids": True,
            },
        )
        choice = _first_choice(self.name, data)
        ids = choice.get("token_ids")
        if not isinstance(ids, list):  # servers without return_token_ids: the logprob tokens
            tokens = (choice.get("logprobs") or {}).get("tokens") or []
            ids = [_parse_token(self.name, t) for t in tokens]
        return Generation(
            [int(t) for t in ids], str(choice.get("text", "")), choice.get("finish_reason")
        )

    async def score(self, tokens: list[int], k: int) -> list[TopK] | None:
        """Teacher forcing: the server's top-K distributions at every position of ``tokens``.

        Element i is the distribution of ``tokens[i]`` given ``tokens[:i]`` (element 0 empty).
        None when this server cannot return prompt log-probabilities (``tf_note`` says why).
        """
        async with self._tf_lock:
            if self.tf_mode is None:
                return await self._detect_tf(tokens, k)
        if self.tf_mode == "unsupported":
            return None
        return await self._score(tokens, k, self.tf_mode)

    async def _detect_tf(self, tokens: list[int], k: int) -> list[TopK] | None:
        errors = []
        for mode in ("prompt_logprobs", "echo"):
            try:
                out = await self._score(tokens, k, mode)
            except RequestFailed as exc:
                if not (exc.kind.startswith("http_4") or exc.kind == "unsupported"):
                    raise
                errors.append(f"{mode}: {exc.kind} {exc.message}")
                continue
            self.tf_mode = mode
            return out
        self.tf_mode = "unsupported"
        self.tf_note = "; ".join(errors)
        return None

    async def _score(self, tokens: list[int], k: int, mode: str) -> list[TopK]:
        payload: dict[str, Any] = {
            "model": self.model,
            "prompt": tokens,
            "max_tokens": 1,
            "temperature": 0.0,
            "return_tokens_as_token_ids": True,
        }
        if mode == "prompt_logprobs":
            payload["prompt_logprobs"] = k
        else:
            payload.update(echo=True, logprobs=k)
        choice = _first_choice(self.name, await self.post("/v1/completions", payload))
        if mode == "prompt_logprobs":
            rows = choice.get("prompt_logprobs")
            if not isinstance(rows, list):
                raise RequestFailed(self.name, "unsupported", "prompt_logprobs ignored")
            dists = [
                {_prompt_token(self.name, t): _logprob(self.name, i, t, v)
                 for t, v in _entries(self.name, i, row)}
                for i, row in enumerate(rows)
            ]  # fmt: skip
        else:
            logprobs = choice.get("logprobs")
            rows = logprobs.get("top_logprobs") if isinstance(logprobs, dict) else None
            if not isinstance(rows, list):
                raise RequestFailed(self.name, "unsupported", "echo gave no top_logprobs")
            dists = [
                {_parse_token(self.name, t): _logprob(self.name, i, t, v)
                 for t, v in _entries(self.name, i, row)}
                for i, row in enumerate(rows)
            ]  # fmt: skip
        if len(dists) < len(tokens):
            raise RequestFailed(
                self.name, "bad_response", f"{len(dists)} prompt logprobs for {len(tokens)} tokens"
            )
        return dists[: len(tokens)]


def _first_choice(side: str, data: dict[str, Any]) -> dict[str, Any]:
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise RequestFailed(side, "bad_response", "completion without choices")
    return choices[0]


def _entries(side: str, position: int, row: Any) -> list[tuple[str, Any]]:
    """A position's ``{token: logprob}`` items (none for the first prompt position's null)."""
    if row is None:
        return []
    if not isinstance(row, dict):
        raise RequestFailed(side, "bad_response", f"prompt position {position}: logprobs are "
                            f"{type(row).__name__}, expected an object of token -> logprob")  # fmt: skip
    return list(row.items())


def _logprob(side: str, position: int, token: str, value: Any) -> float:
    """A listed logprob: a number <= 0 (-inf allowed). NaN, null, +inf or a positive one is a
    broken kernel or server, never a distribution to compare: it would pool as nothing, and
    the verdict would read "identical"."""
    if isinstance(value, dict):  # prompt_logprobs: {"logprob": x, "rank": r, ...}
        value = value.get("logprob")
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value <= 1e-4
    if not ok:
        raise RequestFailed(
            side,
            "bad_response",
            f"prompt position {position}: the logprob of token {token} is {value!r}, expected a "
            "number <= 0 (NaN or null: a broken kernel or server)",
        )
    return float(value)


def _prompt_token(side: str, token: str) -> int:
    """A prompt_logprobs key: the token id as a string."""
    try:
        return int(token)
    except ValueError:
        raise RequestFailed(side, "bad_response", f"prompt_logprobs key {token!r} is not a "
                            "token id") from None  # fmt: skip


def _parse_token(side: str, token: str) -> int:
    """``token_id:123`` -> 123 (what ``return_tokens_as_token_ids`` makes the server send)."""
    if not token.startswith(_TOKEN_ID):
        raise RequestFailed(
            side,
            "unsupported",
            f"logprob token {token!r} is not 'token_id:N' (return_tokens_as_token_ids ignored)",
        )
    return int(token[len(_TOKEN_ID) :])

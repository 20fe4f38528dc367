"""A baseline's recorded answers: compare a candidate later against a server that is gone.

One workstation GPU seldom holds two deployments of a large model at once, and an upgrade
replaces the server it is judged against. Every ``flashnext validate ab`` run therefore writes
the baseline's answers next to its report (:data:`ANSWERS_FILE`), and a later run takes that
file (or its directory) as ``--baseline``: the candidate is asked the same token ids and its
answers are measured against the recorded ones exactly as against a live baseline.

The file is JSON lines. The first line is the header, a ``flashnext.validate.ab_answers``
record: ``server`` (the baseline's url, model, version, max_model_len and teacher-forcing mode
when recorded), ``config`` (``max_tokens``, ``top_logprobs``, ``seed``: a replay uses the
same) and ``prompts_source``. Each further line is one prompt: ``id``,
``category``, exactly one of ``messages`` / ``text`` (as tokenized: long prompts already
filled), ``token_ids`` (the prompt's), ``generation`` (``token_ids``, ``text``,
``finish_reason``) and ``teacher_forced``: per generated position the baseline's top-K
``{token id: logprob}`` given the prompt and the generation before it, or null when the
baseline could not score.

:class:`RecordedSide` answers from such a file with :class:`~flashnext.validate.ab_server.Side`'s
methods, so :func:`flashnext.validate.ab.compare_prompt` runs unchanged.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from flashnext.errors import ValidationError
from flashnext.records import VALIDATE_AB_ANSWERS, make_record
from flashnext.user_files import UserFileError, read_user_text
from flashnext.validate.ab_metrics import TopK
from flashnext.validate.ab_prompts import Prompt
from flashnext.validate.ab_server import Generation, RequestFailed, Side

ANSWERS_FILE = "baseline-answers.jsonl"
KIND = VALIDATE_AB_ANSWERS
SCHEMA_VERSION = 1
#: The run settings a replay takes from the file.
REPLAYED = ("max_tokens", "top_logprobs", "seed")


def answers_path(path: Path) -> Path:
    """``path`` itself, or the answers file inside it when it is a directory (an earlier
    run's ``--out``)."""
    return path / ANSWERS_FILE if path.is_dir() else path


def answer_line(
    p: Prompt, ids: list[int], gen: Generation, tf: list[TopK] | None
) -> dict[str, Any]:
    """One prompt's line: the prompt as tokenized (``p`` already filled), its token ids, the
    baseline's greedy continuation and its teacher-forced top-K over that continuation."""
    line: dict[str, Any] = {"id": p.id, "category": p.category}
    line["messages" if p.text is None else "text"] = p.messages if p.text is None else p.text
    line.update(token_ids=ids, generation=asdict(gen))
    line["teacher_forced"] = None if tf is None else [{str(t): v for t, v in d.items()} for d in tf]
    return line


def answers_header(ab_record: dict[str, Any]) -> dict[str, Any]:
    """The header record of the answers of ``ab_record`` (a ``flashnext.validate.ab`` record or
    payload: its ``baseline`` and ``config``)."""
    base, cfg = ab_record["baseline"], ab_record["config"]
    server = ("url", "model", "version", "max_model_len", "teacher_forcing")
    return make_record(
        KIND,
        {
            "server": {k: base.get(k) for k in server},
            "config": {k: cfg[k] for k in REPLAYED},
            "prompts_source": cfg.get("prompts_source"),
        },
        schema_version=SCHEMA_VERSION,
    )


def render_answers(header: dict[str, Any], lines: list[dict[str, Any]]) -> str:
    """The file's text: the header line, then one line per prompt."""
    return "".join(json.dumps(x, ensure_ascii=False) + "\n" for x in (header, *lines))


class RecordedSide(Side):
    """The baseline of an A/B run answered from a recorded answers file.

    Build with :meth:`load`. ``prompts`` are the recorded prompts (already filled), in the
    file's order; ``config`` holds the recorded ``max_tokens``, ``top_logprobs`` and ``seed``.
    No request is sent: ``requests`` stays 0.
    """

    source: Path
    config: dict[str, Any]
    prompts: list[Prompt]
    _server: dict[str, Any]
    _ids: dict[str, list[int]]
    _gen: dict[tuple[int, ...], Generation]
    _tf: dict[tuple[int, ...], list[TopK] | None]

    @classmethod
    def load(cls, path: Path) -> RecordedSide:
        """Read ``path`` (a file, or a directory holding :data:`ANSWERS_FILE`).

        Raises:
            ValidationError: missing, not an answers file, another schema version, or a line
                that is not a recorded prompt (file and line named).
        """
        file = answers_path(path)
        try:
            text = read_user_text(file, "the recorded answers (baseline-answers.jsonl)")
            rows = [json.loads(x) for x in text.splitlines() if x]
        except UserFileError as exc:
            raise ValidationError(str(exc)) from None
        except OSError as exc:
            raise ValidationError(f"{file}: cannot read the recorded answers: {exc}") from None
        except ValueError as exc:
            raise ValidationError(f"{file}: not JSON lines: {exc}") from None
        if not rows or not isinstance(rows[0], dict) or rows[0].get("kind") != KIND:
            raise ValidationError(
                f"{file}: not a baseline answers file (its first line must have kind {KIND!r}; "
                f"`flashnext validate ab` writes one as {ANSWERS_FILE} next to its report)"
            )
        head = rows[0]
        if head.get("schema_version") != SCHEMA_VERSION:
            raise ValidationError(
                f"{file}: schema_version {head.get('schema_version')!r}, expected {SCHEMA_VERSION}"
            )
        config: dict[str, Any] = head["config"] if isinstance(head.get("config"), dict) else {}
        if not all(isinstance(config.get(k), int) for k in REPLAYED):
            raise ValidationError(f"{file}: the header's config lacks an integer {REPLAYED}")
        side = cls("baseline", None)  # type: ignore[arg-type]  # never sends a request
        side.source = file
        side.config = {k: config[k] for k in REPLAYED}
        side._server = dict(head.get("server") or {})
        side.model = side._server.get("model")
        side.version = side._server.get("version")
        side.max_model_len = side._server.get("max_model_len")
        side.tf_mode = side._server.get("teacher_forcing")
        side.prompts, side._ids, side._gen, side._tf = [], {}, {}, {}
        for n, row in enumerate(rows[1:], start=2):
            side._add(file, n, row)
        if not side.prompts:
            raise ValidationError(f"{file}: records no prompt")
        return side

    def _add(self, file: Path, n: int, row: Any) -> None:
        try:
            prompt = Prompt(
                str(row["id"]), str(row["category"]), row.get("messages"), row.get("text")
            )
            ids = [int(t) for t in row["token_ids"]]
            g = row["generation"]
            gen = Generation([int(t) for t in g["token_ids"]], str(g["text"]), g["finish_reason"])
            tf = row["teacher_forced"]
            dists = None if tf is None else [{int(t): float(v) for t, v in d.items()} for d in tf]
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValidationError(
                f"{file}: line {n} is not a recorded prompt ({type(exc).__name__}: {exc})"
            ) from None
        if (prompt.messages is None) == (prompt.text is None):
            raise ValidationError(f"{file}: line {n}: expected exactly one of messages, text")
        if dists is not None and len(dists) != len(gen.token_ids):
            raise ValidationError(
                f"{file}: line {n}: {len(dists)} teacher-forced positions for "
                f"{len(gen.token_ids)} generated tokens"
            )
        self.prompts.append(prompt)
        self._ids[_key(prompt.messages, prompt.text)] = ids
        self._gen[tuple(ids)] = gen
        self._tf[tuple(ids + gen.token_ids)] = dists

    def info(self) -> dict[str, Any]:
        """:meth:`Side.info`'s fields as recorded, with ``recorded``: the file answered from."""
        keys = ("url", "model", "version", "max_model_len", "models")
        return {
            **{k: self._server.get(k) for k in keys},
            "requests": 0,
            "teacher_forcing": self.tf_mode,
            "teacher_forcing_note": None,
            "down": None,
            "recorded": str(self.source),
        }

    async def load_info(self, wanted_model: str | None) -> None:
        """Nothing to ask: the facts come from the file."""

    async def aclose(self) -> None:
        """Nothing to close."""

    async def tokenize(self, prompt_messages: Any, text: str | None) -> list[int]:
        """The recorded token ids of this prompt."""
        return self._ids[_key(prompt_messages, text)]

    async def generate(self, prompt: list[int], max_tokens: int, k: int, seed: int) -> Generation:
        """The recorded continuation of ``prompt``."""
        return self._gen[tuple(prompt)]

    async def score(self, tokens: list[int], k: int) -> list[TopK] | None:
        """The recorded distributions over the generated part of ``tokens`` (the prompt's
        positions empty, as a live server's first position is), or None when the baseline
        could not score."""
        dists = self._tf[tuple(tokens)]
        if dists is None:
            return None
        return [{} for _ in range(len(tokens) - len(dists))] + dists

    async def post(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        raise RequestFailed(self.name, "recorded", f"a recorded baseline sends no POST {path}")


def _key(messages: Any, text: str | None) -> str:
    return json.dumps([messages, text], sort_keys=True, ensure_ascii=False)

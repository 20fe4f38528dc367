"""The prompt set of ``flashnext validate ab``: a JSONL file, one prompt per line.

Each line is a JSON object:

- ``id`` (str, unique): names the prompt in the report;
- ``category`` (str, optional, default ``general``): groups prompts in the report;
- exactly one of ``messages`` (an OpenAI chat message list; the server's chat template is
  applied) or ``prompt`` (plain text, sent without a template);
- ``fill_fraction`` (float in (0, 1), optional): a long-context prompt. Its text contains the
  placeholder ``{fill}``, replaced by repeats of ``filler`` (optional; a neutral paragraph by
  default) until the prompt takes about this fraction of the servers' ``max_model_len``
  (leaving room for the generated tokens).

The default set (``prompts/ab_default.jsonl``, shipped with the package) mixes code, math,
multilingual, general and two long-context prompts.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from flashnext.errors import ValidationError
from flashnext.user_files import UserFileError, read_user_text

FILL = "{fill}"
DEFAULT_FILLER = (
    "The archive keeps ledgers of grain, rainfall and river levels for every season. "
    "Clerks copied each page twice, and the copies were stored in separate buildings. "
)


@dataclass(frozen=True)
class Prompt:
    """One prompt: chat ``messages`` or plain ``text`` (exactly one is set)."""

    id: str
    category: str
    messages: list[dict[str, Any]] | None = None
    text: str | None = None
    fill_fraction: float | None = None
    filler: str = DEFAULT_FILLER

    def filled(self, repeats: int) -> Prompt:
        """A copy with ``{fill}`` replaced by ``repeats`` fillers (no-op without a fraction)."""
        if self.fill_fraction is None:
            return self
        fill = self.filler * repeats
        if self.text is not None:
            return _replace(self, text=self.text.replace(FILL, fill))
        messages = copy.deepcopy(self.messages or [])
        for m in messages:
            if isinstance(m.get("content"), str):
                m["content"] = m["content"].replace(FILL, fill)
        return _replace(self, messages=messages)


def _replace(p: Prompt, **changes: Any) -> Prompt:
    fields = {**p.__dict__, **changes, "fill_fraction": None}
    return Prompt(**fields)


def default_prompts_path() -> Path:
    """The shipped default prompt set."""
    return Path(str(resources.files("flashnext.validate").joinpath("prompts/ab_default.jsonl")))


def load_prompts(path: Path | None = None) -> list[Prompt]:
    """Read and check a prompt file (the default set when ``path`` is None).

    Raises:
        ValidationError: the file is unreadable, empty, or a line is not a valid prompt (the
            message names the file, the line and the field).
    """
    path = path or default_prompts_path()
    try:
        lines = read_user_text(path, "--prompts (a JSONL prompt file)").splitlines()
    except UserFileError as exc:
        raise ValidationError(str(exc)) from None
    except OSError as exc:
        raise ValidationError(f"--prompts {path}: cannot read ({exc})") from None
    prompts: list[Prompt] = []
    for n, line in enumerate(lines, 1):
        if line.strip():
            prompts.append(_parse_line(path, n, line))
    if not prompts:
        raise ValidationError(f"--prompts {path}: no prompts (expected one JSON object a line)")
    ids = [p.id for p in prompts]
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        raise ValidationError(f"--prompts {path}: duplicate id(s) {dup}; ids must be unique")
    return prompts


def _parse_line(path: Path, n: int, line: str) -> Prompt:
    where = f"--prompts {path} line {n}"
    try:
        obj = json.loads(line)
    except ValueError as exc:
        raise ValidationError(f"{where}: not JSON ({exc})") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("id"), str) or not obj["id"]:
        raise ValidationError(f'{where}: expected an object with a string "id"')
    has_messages, has_text = "messages" in obj, "prompt" in obj
    if has_messages == has_text:
        raise ValidationError(f'{where}: give exactly one of "messages" or "prompt"')
    messages = obj.get("messages")
    if has_messages and not (
        isinstance(messages, list) and messages and all(isinstance(m, dict) for m in messages)
    ):
        raise ValidationError(f'{where}: "messages" must be a non-empty list of objects')
    if has_text and not isinstance(obj["prompt"], str):
        raise ValidationError(f'{where}: "prompt" must be a string')
    fraction = obj.get("fill_fraction")
    if fraction is not None:
        if not isinstance(fraction, (int, float)) or not 0 < fraction < 1:
            raise ValidationError(f'{where}: "fill_fraction" must be a number in (0, 1)')
        if FILL not in json.dumps(messages if has_messages else obj["prompt"]):
            raise ValidationError(f'{where}: "fill_fraction" given but the text has no {FILL}')
    return Prompt(
        id=obj["id"],
        category=str(obj.get("category", "general")),
        messages=messages if has_messages else None,
        text=obj["prompt"] if has_text else None,
        fill_fraction=float(fraction) if fraction is not None else None,
        filler=str(obj.get("filler", DEFAULT_FILLER)),
    )


def fill_repeats(base_tokens: int, filler_tokens: int, target_tokens: int) -> int:
    """How many fillers bring a prompt of ``base_tokens`` to about ``target_tokens`` (>= 0)."""
    if filler_tokens <= 0:
        return 0
    return max(0, (target_tokens - base_tokens) // filler_tokens)

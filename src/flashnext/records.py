"""Typed, versioned records: the one shape of every machine-readable output flashnext writes.

Every ``--json`` output, state file and report is a JSON object with this envelope::

    {
      "schema_version": 1,                  # version of this kind's payload (int)
      "kind": "flashnext.ple.info",         # what the record is: flashnext.<area>.<what>
      "environment": {                      # who wrote it, where, how (the same in every record)
        "flashnext": "0.1.0",
        "python": "3.11.7",
        "platform": "Linux-6.1-x86_64-with-glibc2.36",
        "command": ["flashnext", "ple", "info", "DIR", "--json"],   # secrets redacted
        "created": "2026-11-30T23:59:59+00:00"
      },
      ...                                   # the kind's own fields, at the top level
    }

Payload fields sit beside the envelope (not under a key) so that a reader can use a record like
the plain dict it always was. A payload may not use the envelope's keys.

Secrets never reach a record: :func:`redact_argv` hides the values of flags whose names contain
key/token/secret/password and credentials in URLs; :func:`redact_text` removes known secret
strings from any text.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import math
import os
import platform
import re
import sys
import urllib.parse
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from flashnext import __version__
from flashnext.errors import FlashnextError

# Record kinds, ``flashnext.<area>.<what>``: defined here once and imported everywhere else, so
# that a writer and its readers cannot drift apart by a retyped string.
CHECKPOINT_OVERRIDE = "flashnext.checkpoint.override"
CHECKPOINT_PLAN = "flashnext.checkpoint.plan"
CHECKPOINT_PLE = "flashnext.checkpoint.ple"
CHECKPOINT_VERIFY = "flashnext.checkpoint.verify"
CLI_ERROR = "flashnext.cli.error"
DEMO_RUN = "flashnext.demo.run"
DEPLOY_CHECK = "flashnext.deploy.check"
DEPLOY_RECORD = "flashnext.deploy.record"
DEPLOY_RECORD_DIFF = "flashnext.deploy.record_diff"
PLAN_EXPLAIN = "flashnext.plan.explain"
PLAN_MEMORY = "flashnext.plan.memory"
PLE_INFO = "flashnext.ple.info"
PLE_LOOKUP = "flashnext.ple.lookup"
PLE_PREFLIGHT = "flashnext.ple.preflight"
PLE_PROFILE = "flashnext.ple.profile"
PLE_PROFILE_SUMMARY = "flashnext.ple.profile_summary"
PLE_QUANTIZE = "flashnext.ple.quantize"
PLE_QUANTIZE_STATE = "flashnext.ple.quantize_state"
PLE_SLICE = "flashnext.ple.slice"
PLE_WARM = "flashnext.ple.warm"
VALIDATE_AB = "flashnext.validate.ab"
VALIDATE_AB_ANSWERS = "flashnext.validate.ab_answers"
VALIDATE_COMPARE = "flashnext.validate.compare"
VALIDATE_REPORT = "flashnext.validate.report"
#: Every kind above; a kind outside this set was retyped somewhere (tests/test_records.py).
KINDS = frozenset(
    v for k, v in dict(globals()).items() if k.isupper() and str(v).startswith("flashnext.")
)

ENVELOPE_KEYS = ("schema_version", "kind", "environment")
REDACTED = "<redacted>"
#: Flag and environment-variable names whose values are secrets.
#: "token" but not "tokens"/"tokenizer": --max-tokens and --tokenizer are not secrets.
SECRET_NAME = re.compile(r"(key|token(?!s|iz)|secret|password|passwd|credential)", re.IGNORECASE)


class RecordError(FlashnextError, ValueError):
    """A file or document is not the flashnext record it should be."""


def redact_url(url: str) -> str:
    """``url`` with any ``user:password@`` replaced by ``<redacted>@``."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return url
    if "@" not in parts.netloc:
        return url
    host = parts.netloc.rsplit("@", 1)[1]
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{REDACTED}@{host}"))


def redact_argv(argv: Sequence[str], secrets: Iterable[str] = ()) -> list[str]:
    """A command line with secret flag values, URL credentials and ``secrets`` removed.

    ``--api-key X``, ``--api-key=X``, ``--hf-token X`` (any flag whose name matches
    :data:`SECRET_NAME`) and ``NAME=VALUE`` words with a secret NAME keep the name and lose
    the value.
    """
    known = sorted({s for s in secrets if s and len(s) >= 3}, key=len, reverse=True)
    out: list[str] = []
    hide_next = False
    for arg in argv:
        if hide_next and not arg.startswith("--"):
            out.append(REDACTED)
            hide_next = False
            continue
        hide_next = False
        name, eq, _value = arg.partition("=")
        if arg.startswith("-") and SECRET_NAME.search(name):
            if eq:
                out.append(f"{name}={REDACTED}")
            else:
                out.append(arg)
                hide_next = True  # unless the next word is a flag: then the value is missing
            continue
        is_env = eq and not arg.startswith("-") and re.fullmatch(r"[A-Za-z_]\w*", name)
        if is_env and SECRET_NAME.search(name):
            out.append(f"{name}={REDACTED}")
            continue
        if "://" in arg:
            arg = redact_url(arg)
        out.append(redact_text(arg, known))
    return out


def redact_text(text: str, secrets: Iterable[str]) -> str:
    """``text`` with every secret string (longest first) replaced by ``<redacted>``."""
    for secret in sorted({s for s in secrets if s and len(s) >= 3}, key=len, reverse=True):
        text = text.replace(secret, REDACTED)
    return text


#: A name that is an environment variable's (``HF_TOKEN``), whose value :func:`redact` hides
#: when :data:`SECRET_NAME` matches it; other mapping keys (``"key"``, ``"top1_token"``) are data.
_ENV_NAME = re.compile(r"[A-Z_][A-Z0-9_]*")
# The scheme is bounded: on a long run of letters the search stays linear (user text: logs).
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]{0,31}://[^\s'\"<>]*")


def process_secrets(env: Mapping[str, str] | None = None) -> list[str]:
    """The values of this process's secret-named environment variables (``HF_TOKEN``,
    ``OPENAI_API_KEY``): never shown by any output, wherever they turn up (8 characters and
    more: a short value such as ``1`` would blank out ordinary text)."""
    env = os.environ if env is None else env
    return [v for k, v in env.items() if SECRET_NAME.search(k) and len(v) >= 8]


def redact(value: Any, secrets: Iterable[str] = ()) -> Any:
    """THE redaction of flashnext's outputs (text, JSON records, files, logs): ``value`` with
    secrets removed, recursively.

    - every string: each of ``secrets`` and of :func:`process_secrets` becomes ``<redacted>``,
      and so does a URL's ``user:password@``;
    - every list of strings (a command line): :func:`redact_argv` (``--api-key X``,
      ``--hf-token=X``, ``HF_TOKEN=X`` words);
    - every mapping: the string value of an environment-variable name matching
      :data:`SECRET_NAME` (``{"HF_TOKEN": ...}``).
    """
    known = sorted({s for s in [*secrets, *process_secrets()] if s and len(s) >= 3},
                   key=len, reverse=True)  # fmt: skip
    return _redact(value, known)


def _redact(value: Any, known: list[str]) -> Any:
    if isinstance(value, str):
        return _redact_str(value, known)
    if isinstance(value, Mapping):
        return {
            k: REDACTED
            if isinstance(v, str) and isinstance(k, str) and _ENV_NAME.fullmatch(k)
            and SECRET_NAME.search(k) and v != REDACTED
            else _redact(v, known)
            for k, v in value.items()
        }  # fmt: skip
    if isinstance(value, (list, tuple)):
        if value and all(isinstance(v, str) for v in value):
            return redact_argv(value, known)
        return [_redact(v, known) for v in value]
    return value


def _redact_str(text: str, known: list[str]) -> str:
    for secret in known:
        text = text.replace(secret, REDACTED)
    return _URL.sub(lambda m: redact_url(m.group(0)), text) if "@" in text else text


def environment(argv: Sequence[str] | None = None, secrets: Iterable[str] = ()) -> dict[str, Any]:
    """The environment block: flashnext version, Python, platform, command (redacted), time."""
    command = list(sys.argv if argv is None else argv)
    if command and command[0].endswith(("/flashnext", "__main__.py")):
        command[0] = "flashnext"
    return {
        "flashnext": __version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "command": redact_argv(command, [*secrets, *process_secrets()]),
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }


def to_jsonable(value: Any) -> Any:
    """Dataclasses, paths, tuples and numpy scalars to plain JSON values; NaN/inf to None."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return to_jsonable(dataclasses.asdict(value))
    if isinstance(value, Mapping):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, (str, int, bool)) or value is None:
        return value
    item = getattr(value, "item", None)  # numpy scalars
    if callable(item):
        return to_jsonable(item())
    return str(value)


def make_record(
    kind: str,
    payload: Mapping[str, Any] | Any,
    *,
    schema_version: int = 1,
    argv: Sequence[str] | None = None,
    secrets: Iterable[str] = (),
) -> dict[str, Any]:
    """A record of ``kind``: the envelope plus ``payload``'s fields (a mapping or dataclass).

    Raises:
        RecordError: ``kind`` is not ``flashnext.<area>...`` or the payload uses an envelope key.
    """
    if not re.fullmatch(r"flashnext(\.[a-z0-9_]+){2,}", kind):
        raise RecordError(f"record kind {kind!r} is not of the form flashnext.<area>.<what>")
    body = to_jsonable(payload)
    if not isinstance(body, dict):
        raise RecordError(f"record {kind}: payload must be a mapping, found {type(body).__name__}")
    clash = [k for k in ENVELOPE_KEYS if k in body]
    if clash:
        raise RecordError(f"record {kind}: payload uses the envelope key(s) {clash}")
    return {
        "schema_version": int(schema_version),
        "kind": kind,
        "environment": environment(argv, secrets),
        **redact(body, secrets),  # one redaction for every record: files and --json alike
    }


def dumps(record: Mapping[str, Any], indent: int | None = 2) -> str:
    """Strict JSON text of a record (no NaN), newline-terminated."""
    return json.dumps(to_jsonable(record), indent=indent, allow_nan=False) + "\n"


def check_record(
    data: Any, kind: str | None = None, schema_version: int | None = None, source: str = "record"
) -> dict[str, Any]:
    """Validate a parsed record's envelope (and its kind/version when given); return it.

    Raises:
        RecordError: naming ``source``, the field and what was expected.
    """
    if not isinstance(data, dict):
        raise RecordError(f"{source}: expected a JSON object, found {type(data).__name__}")
    for key in ENVELOPE_KEYS:
        if key not in data:
            raise RecordError(f"{source}: not a flashnext record (no {key!r})")
    if not isinstance(data["schema_version"], int):
        raise RecordError(f"{source}: schema_version must be an integer")
    env = data["environment"]
    if not isinstance(env, dict) or not {"flashnext", "python", "platform", "command"} <= set(env):
        raise RecordError(f"{source}: environment block lacks flashnext/python/platform/command")
    if kind is not None and data["kind"] != kind:
        raise RecordError(f"{source}: is a {data['kind']!r} record, expected {kind!r}")
    if schema_version is not None and data["schema_version"] != schema_version:
        raise RecordError(
            f"{source}: schema_version {data['schema_version']}, expected {schema_version}; "
            "written by another flashnext version"
        )
    return data


#: The type(s) a field of :func:`check_fields`'s spec must have.
Types = type | tuple[type, ...]
_ABSENT = object()


def check_fields(
    data: Mapping[str, Any], spec: Mapping[str, Types], source: str = "record"
) -> None:
    """Check a parsed record's payload against ``spec`` before any reader trusts it.

    ``spec`` maps a field path to the type(s) its value must have. ``a.b`` is field ``b`` of
    mapping ``a``; ``a[]`` is every item of list ``a``; ``a{}`` every value of mapping ``a``.
    An absent field counts as None, so ``type(None)`` among the types makes it optional. List
    parents before their children: a path below an absent, None or mistyped parent is skipped
    (the parent's own entry reports it). ``bool`` is not an ``int`` here, nor an int a float.

    Raises:
        RecordError: ``source: field a.b[2]: expected str, found int 7`` for the first mismatch.
    """
    for path, types in spec.items():
        wanted = types if isinstance(types, tuple) else (types,)
        for where, value in _field_values(data, path):
            found = None if value is _ABSENT else value
            if not _is_a(found, wanted):
                names = " or ".join("null" if t is type(None) else t.__name__ for t in wanted)
                what = (
                    "nothing" if value is _ABSENT
                    else "null" if found is None
                    else f"{type(found).__name__} {found!r:.40}"
                )  # fmt: skip
                raise RecordError(f"{source}: field {where}: expected {names}, found {what}")


def _is_a(value: Any, wanted: tuple[type, ...]) -> bool:
    if isinstance(value, bool):
        return bool in wanted
    return isinstance(value, wanted)


def _field_values(data: Mapping[str, Any], path: str) -> list[tuple[str, Any]]:
    """(printable path, value) for every field ``path`` names in ``data`` (see check_fields)."""
    found: list[tuple[str, Any]] = [("", data)]
    for step in path.split("."):
        name, each = (step[:-2], step[-2:]) if step.endswith(("[]", "{}")) else (step, "")
        nxt: list[tuple[str, Any]] = []
        for where, parent in found:
            if not isinstance(parent, Mapping):
                continue  # absent, None or mistyped: reported by the parent's own entry
            here = f"{where}.{name}" if where else name
            child = parent.get(name, _ABSENT)
            if each == "[]" and isinstance(child, list):
                nxt += [(f"{here}[{i}]", v) for i, v in enumerate(child)]
            elif each == "{}" and isinstance(child, Mapping):
                nxt += [(f"{here}.{k}", v) for k, v in child.items()]
            elif not each:
                nxt.append((here, child))
        found = nxt
    return found

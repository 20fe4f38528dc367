"""The record envelope: every machine-readable output has the same shape."""

import json
import re

import pytest

from flashnext.records import (
    REDACTED,
    RecordError,
    check_record,
    dumps,
    make_record,
    redact_argv,
)

KIND_PATTERN = r"flashnext\.[a-z0-9_]+\.[a-z0-9_]+"


def test_record_has_envelope_and_payload():
    rec = make_record("flashnext.test.thing", {"rows": 3, "ratio": float("nan")}, argv=["x", "y"])
    data = json.loads(dumps(rec))
    check_record(data, kind="flashnext.test.thing", schema_version=1)
    assert data["rows"] == 3 and data["ratio"] is None
    assert data["environment"]["command"] == ["x", "y"]


def test_payload_may_not_shadow_envelope():
    with pytest.raises(RecordError, match="envelope key"):
        make_record("flashnext.test.thing", {"kind": 1})


def test_check_record_names_source_and_field():
    with pytest.raises(RecordError, match=r"a\.json: not a flashnext record \(no 'kind'\)"):
        check_record({"schema_version": 1}, source="a.json")
    rec = make_record("flashnext.test.a", {})
    with pytest.raises(RecordError, match=r"expected 'flashnext\.test\.b'"):
        check_record(rec, kind="flashnext.test.b")


def test_redact_argv_hides_secret_flags_env_and_url_credentials():
    argv = [
        "vllm", "serve", "--api-key", "sk-123", "--hf-token=hf_abc", "HF_TOKEN=hf_abc",
        "--url", "http://user:pw@host:8000/v1", "--port", "8000",
    ]
    out = redact_argv(argv)
    text = " ".join(out)
    assert "sk-123" not in text and "hf_abc" not in text and "user:pw" not in text
    assert out[3] == REDACTED and "--port" in out and "8000" in out
    counts = ["--max-tokens", "24", "--max-num-batched-tokens=8192", "--tokenizer", "t"]
    assert redact_argv(counts) == counts


def test_record_kinds_are_defined_once():
    """Every kind follows flashnext.<area>.<what> and no module outside records.py retypes one."""
    import ast
    from pathlib import Path

    from flashnext import records

    assert records.KINDS and all(re.fullmatch(KIND_PATTERN, k) for k in records.KINDS)
    src = Path(records.__file__).parent
    old = {"flashnext.demo", "flashnext.plan", "flashnext.explain"}
    retyped = []
    for path in sorted(src.rglob("*.py")):
        if path == Path(records.__file__):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            value = getattr(node, "value", None) if isinstance(node, ast.Constant) else None
            if isinstance(value, str) and (value in records.KINDS or value in old):
                retyped.append(f"{path.relative_to(src)}:{node.lineno}: {value}")
    assert not retyped, "import the kind from flashnext.records instead:\n" + "\n".join(retyped)

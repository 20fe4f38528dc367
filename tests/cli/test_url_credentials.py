"""Rule: say what happened. A `--url` with `user:password@` is sent as HTTP Basic auth (as curl
does) by validate and by the deployment record it embeds; when those credentials displace
--api-key's bearer token and the server answers 401, the report says so, not "wrong --api-key".
Against a real HTTP server on 127.0.0.1 (tests/cli/openai_server.py)."""

from __future__ import annotations

import json

from .runner import run_in_process
from .servers import openai_server

KEY = "sk-url-credentials-1234"


def _validate(capsys, tmp_path, url, *extra):
    argv = ["validate", "--url", url, "--stages", "ready", "--ready-timeout", "20", "--no-png",
            "--out", tmp_path / "report", "--json", *extra]  # fmt: skip
    code, out, err = run_in_process([str(a) for a in argv], capsys)
    return code, json.loads(out), out + err


def test_url_credentials_displacing_the_key_are_named(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("FLASHNEXT_API_KEY", raising=False)
    with openai_server(tmp_path, key=KEY) as srv:
        url = srv.url.replace("http://", "http://alice:pw-9z8y@")
        code, report, text = _validate(capsys, tmp_path, url, "--api-key", KEY)
    assert code == 1
    (ready,) = report["stages"]
    assert ready["status"] == "fail"
    assert "user:password@ was sent as HTTP Basic auth in place of --api-key" in ready["reason"]
    assert "wrong --api-key" not in text and "pw-9z8y" not in text and KEY not in text


def test_url_credentials_reach_the_embedded_record(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("FLASHNEXT_API_KEY", raising=False)
    with openai_server(tmp_path, key=KEY, basic="alice:pw-9z8y") as srv:
        url = srv.url.replace("http://", "http://alice:pw-9z8y@")
        _, report, text = _validate(capsys, tmp_path, url)
    deployment = report["deployment"]
    assert "error" not in deployment, deployment
    assert deployment["kind"] == "flashnext.deploy.record"
    assert [m["id"] for m in deployment["server"]["models"]] == ["tiny"]
    assert "Name or service not known" not in text and "pw-9z8y" not in text

"""Rule: no silent wrong answer. A `record capture` that could not see the server fails with one
line (no `models: []` record, exit 0); a --pid that is not the server is refused; URL
credentials are used as HTTP Basic auth, and a 401 they cause is named as such. `record diff`
sees every field `record restore` uses."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from flashnext.records import DEPLOY_RECORD, dumps, make_record

from .inputs import closed_port
from .runner import run_in_process
from .servers import openai_server

KEY = "sk-capture-test-4711"


def _capture(capsys, *args):
    return run_in_process(["record", "capture", *map(str, args)], capsys)


def _one_error_line(err: str) -> str:
    assert err.count("\n") == 1 and err.startswith("error: "), err
    return err


def test_keyed_server_without_or_with_a_wrong_key(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("FLASHNEXT_API_KEY", raising=False)
    with openai_server(tmp_path, key=KEY) as srv:
        code, out, err = _capture(capsys, "--url", srv.url)
        assert code == 1 and out == ""
        assert "HTTP 401: the server needs an API key: pass --api-key" in _one_error_line(err)
        code, out, err = _capture(capsys, "--url", srv.url, "--api-key", "sk-wrong-key")
        assert code == 1 and "refused the --api-key given" in _one_error_line(err)
        assert "sk-wrong-key" not in err
        code, out, err = _capture(capsys, "--url", srv.url, "--api-key", KEY)
        assert code == 0, err
        record = json.loads(out)
        assert [m["id"] for m in record["server"]["models"]] == ["tiny"]
        assert record["server"]["version"] == "0.33.0" and KEY not in out
        assert record["captured"]["pid"] == srv.pid  # found by the URL's port
        # ".../v1" (what OpenAI clients are given) is the same server, as `validate --url`
        code, out, err = _capture(capsys, "--url", srv.url + "/v1/", "--api-key", KEY)
        assert code == 0 and json.loads(out)["server"]["version"] == "0.33.0", err
        assert err == f"note: --url: using the server root {srv.url}\n"


def test_not_an_openai_server(tmp_path, capsys):
    """A server that answers but lists no model (here: a plain file server)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port := closed_port())],
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        code, err = 1, ""
        deadline = time.monotonic() + 60  # until http.server listens (slow on a loaded box)
        while time.monotonic() < deadline:
            code, _, err = _capture(capsys, "--url", f"http://127.0.0.1:{port}")
            if "unreachable" not in err:
                break
            time.sleep(0.05)
        assert code == 1 and "no served model listed (HTTP 404)" in _one_error_line(err)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_pid_that_is_not_the_server(tmp_path, capsys):
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        with openai_server(tmp_path) as srv:
            code, out, err = _capture(capsys, "--url", srv.url, "--pid", other.pid)
            assert code == 1 and out == ""
            assert f"--pid {other.pid} is not the server at port" in _one_error_line(err)
            assert f"pid {srv.pid} listens there" in err
            code, out, err = _capture(capsys, "--url", srv.url, "--pid", srv.pid)
            assert code == 0 and json.loads(out)["launch"]["source"] == "pid", err
    finally:
        other.kill()
        other.wait()


@pytest.mark.parametrize("server_takes_basic", [True, False])
def test_url_credentials(tmp_path, capsys, monkeypatch, server_takes_basic):
    monkeypatch.delenv("FLASHNEXT_API_KEY", raising=False)
    basic = "alice:s3cr3t-pw" if server_takes_basic else None
    with openai_server(tmp_path, key=KEY, basic=basic) as srv:
        url = srv.url.replace("http://", "http://alice:s3cr3t-pw@")
        code, out, err = _capture(capsys, "--url", url)
        assert "s3cr3t-pw" not in out + err
        if server_takes_basic:
            assert code == 0, err
            assert json.loads(out)["url"] == srv.url.replace("http://", "http://<redacted>@")
        else:
            assert code == 1 and "user:password@ was sent as HTTP Basic auth" in err
            assert "wrong" not in err


def _record(cwd: str, **container: object) -> dict:
    launch = {"source": "container" if container else "pid", "cwd": cwd, "env": {"A": "1"},
              "argv": ["python", "-m", "vllm.entrypoints.openai.api_server", "--port", "8000"],
              "container": container}  # fmt: skip
    return make_record(DEPLOY_RECORD, {"server": {}, "launch": launch})


@pytest.mark.parametrize(
    "a, b",
    [
        (_record("/srv/a"), _record("/srv/b")),
        (_record("/w", image="img", restart_policy="no"),
         _record("/w", image="img", restart_policy="always")),
    ],
)  # fmt: skip
def test_diff_sees_what_restore_uses(tmp_path, capsys, a, b):
    paths = []
    for name, rec in (("a", a), ("b", b)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(dumps(rec))
    restores = [run_in_process(["record", "restore", p], capsys) for p in paths]
    assert restores[0][0] == restores[1][0] == 0 and restores[0][1] != restores[1][1]
    code, out, err = run_in_process(["record", "diff", *paths], capsys)
    assert code == 1 and "no changes" not in out, out + err

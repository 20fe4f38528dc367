"""Issue 42: a server's HTML error page becomes one short line in ab.md, not the whole page.

The server is Python's own ``http.server`` (a real web server that is no OpenAI server: every
/v1 route is its HTML 404 page), as when --baseline points at the wrong port.
"""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from flashnext.validate.client import brief

from ..cli.runner import run


def test_ab_md_says_an_html_404_in_one_short_line(tmp_path: Path) -> None:
    port_file = tmp_path / "port"
    code = ("import http.server, sys; s = http.server.ThreadingHTTPServer(('127.0.0.1', 0), "
            "http.server.SimpleHTTPRequestHandler); open(sys.argv[1], 'w').write(str("
            "s.server_address[1])); s.serve_forever()")  # fmt: skip
    web = subprocess.Popen([sys.executable, "-c", code, str(port_file)], cwd=tmp_path,
                           stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        while not port_file.exists() or not port_file.read_text():
            assert web.poll() is None
            time.sleep(0.02)
        url = f"http://127.0.0.1:{port_file.read_text()}"
        try:
            urllib.request.urlopen(f"{url}/v1/models", timeout=10)
        except urllib.error.HTTPError as exc:  # what it sends: a whole HTML page
            assert exc.code == 404 and b"<html" in exc.read().lower()
        out = tmp_path / "ab"
        p = run("validate", "ab", "--baseline", url, "--candidate", url + "/", "--no-png",
                "--timeout", "5", "--out", out)  # fmt: skip
    finally:
        web.kill()
        web.wait()
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    md = (out / "ab.md").read_text()
    said = [line for line in md.splitlines() if "GET /v1/models" in line]
    assert said and all("<" not in line and len(line) < 420 for line in said), said
    assert "HTML page: Error response" in said[0], said


def test_brief_is_one_bounded_line_on_any_text() -> None:
    assert brief("  not\n found \t") == "not found"
    assert brief('{"detail": "x"}') == '{"detail": "x"}'
    page = "<!DOCTYPE html><html><head><title>404 Not Found</title></head><body>" + "x" * 5000
    assert brief(page).startswith("HTML page: 404 Not Found")
    untitled = "<html><body><h1>Oops</h1>\n<p>gone</p></body></html>"
    assert brief(untitled) == "HTML page: Oops gone"
    long = "word " * 10_000
    cut = brief(long)
    assert len(cut) < 340 and cut.endswith("(50000 characters)") and "\n" not in cut
    huge = "<html>" + "<title" * 200_000 + "<" * 1_000_000  # adversarial input: cut, one line
    said = brief(huge)
    assert "\n" not in said and said.endswith(f"({len(huge)} characters)")

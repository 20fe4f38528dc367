"""Early vLLM boots: servers that selected tests will need, launched before those tests run.

A test marked ``@pytest.mark.early_boot(NAME, *EXTRA_ARGS, supervise=False, env={}, at="server",
fork=False)``
gets, from the ``early_boots`` fixture (tests/conftest.py), a ``VllmServer`` of the tiny model by
NAME, with those extra arguments and environment variables, launched without waiting for health:

- ``at="server"``: together with the session's shared server (tests/validate/conftest.py), so the
  boots overlap it and wait idle (~3% of a core each) only until their test;
- ``at="session"``: at the session's first test, for a boot nobody waits on before its test (a
  boot meant to fail: it exits on its own and then costs nothing).

A test's boots not launched yet are launched when it asks for its servers. A start is mostly
vLLM's single-threaded imports, so boots side by side on a 2-core machine cost less than one
after another; the test itself waits for health (``wait_healthy``) or for the process to end.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from devtools.vllm_cpu import VllmServer

MARKER = "early_boot"
MARKER_HELP = (
    "early_boot(name, *extra_args, supervise=False, env={}, at='server', fork=False): a vLLM "
    "server of the "
    "tiny model for this test, launched early (see tests/early_boots.py)"
)


class EarlyBoots:
    """The selected tests' marked servers; :meth:`launch` starts those of one moment."""

    def __init__(
        self,
        items: list[pytest.Item],
        python: Path,
        model: Path,
        tmp_path_factory: pytest.TempPathFactory,
    ) -> None:
        self._pending: dict[tuple[str, str], tuple[pytest.Mark, str]] = {}
        for item in items:
            for mark in item.iter_markers(MARKER):
                self._pending[item.nodeid, mark.args[0]] = (mark, mark.kwargs.get("at", "server"))
        self._python, self._model, self._tmp = python, model, tmp_path_factory
        self.servers: dict[tuple[str, str], VllmServer] = {}

    def launch(self, at: str | None = None, test: str | None = None) -> None:
        """Launch the pending boots marked ``at``, or those of test ``test``."""
        for key, (mark, when) in list(self._pending.items()):
            if (at is not None and when != at) or (test is not None and key[0] != test):
                continue
            del self._pending[key]
            _, *extra = mark.args
            logs = self._tmp.mktemp(f"early-{key[1]}")
            server = VllmServer(
                self._python, self._model, logs, list(extra), mark.kwargs.get("env"),
                fork=mark.kwargs.get("fork", False),
            )  # fmt: skip
            self.servers[key] = server.launch(mark.kwargs.get("supervise", False))

    def of_test(self, nodeid: str) -> dict[str, VllmServer]:
        """The servers of test ``nodeid`` by name, launching those still pending."""
        self.launch(test=nodeid)
        return {name: s for (test, name), s in self.servers.items() if test == nodeid}

    def stop_all(self) -> None:
        for server in self.servers.values():
            server.stop()


def any_marked(items: list[pytest.Item], at: str) -> bool:
    """Whether a selected test has an early boot to launch at moment ``at``."""
    return any(m.kwargs.get("at", "server") == at for i in items for m in i.iter_markers(MARKER))

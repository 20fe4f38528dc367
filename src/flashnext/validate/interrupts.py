"""SIGINT/SIGTERM during a run: the first stops the work in progress so that the report of what
finished is still written; a second ends the process at once.

Shared by ``flashnext validate`` (:mod:`flashnext.validate.stages.runner`) and ``flashnext
validate ab`` (:mod:`flashnext.validate.ab`): one rule for every report (issue 22, rule 2).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Iterator
from typing import Any

SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Hold SIGINT and SIGTERM back for the block (writing and printing a finished report), so
    a signal then cannot leave the report half written; one that arrived acts at the end."""
    try:
        old = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    except (AttributeError, ValueError, OSError):  # no sigmask here: nothing to hold back
        yield
        return
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


class Interrupts:
    """While :meth:`installed`, the first SIGINT/SIGTERM sets :attr:`signal`, calls
    :meth:`on_interrupt` and cancels :attr:`task` (the work in progress, when one is set)."""

    def __init__(self) -> None:
        self.signal: signal.Signals | None = None
        self.task: asyncio.Future[Any] | None = None

    @contextlib.contextmanager
    def installed(self) -> Iterator[Interrupts]:
        """Own SIGINT and SIGTERM on the running event loop for the block."""
        loop = asyncio.get_running_loop()
        added = []
        for sig in SIGNALS:
            # Only the main thread may own signals; a run in another thread is not interruptible.
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.add_signal_handler(sig, self._on_signal, sig)
                added.append(sig)
        try:
            yield self
        finally:
            for sig in added:
                loop.remove_signal_handler(sig)

    def on_interrupt(self, sig: signal.Signals) -> None:
        """Called once, on the first signal, before the task is cancelled (a hook)."""

    def _on_signal(self, sig: signal.Signals) -> None:
        if self.signal is not None:
            signal.signal(sig, signal.SIG_DFL)
            os.kill(os.getpid(), sig)
            return
        self.signal = sig
        self.on_interrupt(sig)
        if self.task is not None:
            self.task.cancel()

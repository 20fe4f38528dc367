"""SIGINT/SIGTERM during a run: the first stops the work in progress so that the report of what
finished is still written; a second ends the process at once.

Three pieces cover every moment from the first request to the written report:
:class:`Interrupts` while the event loop runs the work; :func:`kept_for_later` around the
whole command (before the loop starts and after it ends, when no loop owns the signals: the
first signal is only noted, so the finished results are still written); :func:`deferred`
around writing and printing the report. :meth:`Interrupts.installed` hands the signals back to
the handler that was there before (``kept_for_later``'s) with both blocked, with a signal it
noted too late to act on, so no signal falls between two owners onto the default action
(which would end the process with no report) or is lost.

Shared by ``flashnext validate`` (:mod:`flashnext.validate.stages.runner`) and ``flashnext
validate ab`` (:mod:`flashnext.validate.ab`): one rule for every report (issue 22, rule 2).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Iterator
from types import FrameType
from typing import Any

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Kept:
    """The signal :func:`kept_for_later` noted (None: none arrived)."""

    def __init__(self) -> None:
        self.signal: signal.Signals | None = None


@contextlib.contextmanager
def kept_for_later() -> Iterator[Kept]:
    """For the block (main thread only), the first SIGINT/SIGTERM is noted in the returned
    :class:`Kept` and the work goes on; a second ends the process at once. Wrap a whole
    command whose finished results must be written whatever moment a signal arrives."""
    kept = Kept()

    def note(signum: int, frame: FrameType | None) -> None:
        if kept.signal is not None:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        kept.signal = signal.Signals(signum)

    try:
        previous = {sig: signal.signal(sig, note) for sig in SIGNALS}
    except ValueError:  # not the main thread: signals are not ours to hold
        yield kept
        return
    try:
        yield kept
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def _blocked() -> Iterator[None]:
    try:
        old = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    except (AttributeError, ValueError, OSError):
        yield
        return
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Hold SIGINT and SIGTERM back for the block (writing and printing a finished report), so
    a signal then cannot leave the report half written; one that arrived acts at the end."""
    with _blocked():
        yield


class Interrupts:
    """While :meth:`installed`, the first SIGINT/SIGTERM sets :attr:`signal`, then (on the loop)
    calls :meth:`on_interrupt` and cancels :attr:`task` (the work in progress, when one is set).

    A signal that arrives too late for the loop to act on it (the work has just ended) is sent
    again, on the way out, to the handler that was there before (:func:`kept_for_later`'s in
    the CLI), so it is never lost between two owners."""

    def __init__(self) -> None:
        self.signal: signal.Signals | None = None
        self.task: asyncio.Future[Any] | None = None
        self._acted = False
        self._closed = False

    @contextlib.contextmanager
    def installed(self) -> Iterator[Interrupts]:
        """Own SIGINT and SIGTERM for the block (main thread only, on the running loop)."""
        loop = asyncio.get_running_loop()

        def handler(signum: int, frame: FrameType | None) -> None:
            if self.signal is not None:  # a second signal ends the process at once
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)
                return
            self.signal = signal.Signals(signum)
            loop.call_soon_threadsafe(self._act)

        try:
            previous = {sig: signal.signal(sig, handler) for sig in SIGNALS}
        except ValueError:  # not the main thread: a run there is not interruptible
            yield self
            return
        try:
            yield self
        finally:
            with _blocked():  # a signal now waits for the restored handler
                self._closed = True
                for sig, old in previous.items():
                    signal.signal(sig, old if old is not None else signal.SIG_DFL)
                if self.signal is not None and not self._acted:
                    os.kill(os.getpid(), self.signal)  # pending until unblocked: theirs now

    def on_interrupt(self, sig: signal.Signals) -> None:
        """Called once, on the first signal, before the task is cancelled (a hook)."""

    def _act(self) -> None:
        if self._acted or self._closed or self.signal is None:
            return
        self._acted = True
        self.on_interrupt(self.signal)
        if self.task is not None:
            self.task.cancel()

"""SIGTERM as an exception, so that a terminated command cleans up like an interrupted one.

By default SIGTERM ends Python at once: temporary directories stay, worker pools leave their
semaphores to the resource tracker ("leaked semaphore"), locks are dropped only by the kernel.
Inside :func:`terminate_cleanly` it raises :class:`Terminated` instead, so every ``with`` and
``finally`` on the way out runs; the CLI then exits 143 (128 + SIGTERM) with one line.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType

import click


class Terminated(SystemExit):
    """Raised in the main thread when SIGTERM arrives inside :func:`terminate_cleanly`."""

    def __init__(self) -> None:
        super().__init__(128 + signal.SIGTERM)


@contextlib.contextmanager
def terminate_cleanly() -> Iterator[None]:
    """Turn SIGTERM into :class:`Terminated` for the duration (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_terminated(signum: int, frame: FrameType | None) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends it at once
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        yield
    except Terminated:
        click.echo("error: terminated (SIGTERM)", err=True)
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)

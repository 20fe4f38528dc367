"""A hook at an exact step of a real ``flashnext`` subprocess, instead of a sleep.

:func:`hooked` gives the argv of a Python process that wraps one function of flashnext
(``MODULE:ATTR``, ATTR may be ``Class.method``) so that its NTH call sends a signal to its own
process, right before the call or right ``after`` it returns, then runs the CLI. The signal
arrives at that step every time: SIGTERM/SIGINT to test the interrupt window, SIGSTOP to hold a
writer still while it holds its destination's lock.
"""

from __future__ import annotations

import sys

DRIVER = r"""
import asyncio, functools, importlib, os, signal, sys
where, when, nth, sig = sys.argv[1], sys.argv[2], int(sys.argv[3]), signal.Signals[sys.argv[4]]
module_name, _, path = where.partition(":")
owner = importlib.import_module(module_name)
*parents, attr = path.split(".")
for part in parents:
    owner = getattr(owner, part)
original = getattr(owner, attr)
calls = [0]

def fire(stage):
    calls[0] += stage == "before"
    if calls[0] == nth and stage == when:
        os.kill(os.getpid(), sig)

if asyncio.iscoroutinefunction(original):
    @functools.wraps(original)
    async def wrapper(*args, **kwargs):
        fire("before")
        try:
            return await original(*args, **kwargs)
        finally:
            fire("after")
else:
    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        fire("before")
        try:
            return original(*args, **kwargs)
        finally:
            fire("after")
setattr(owner, attr, wrapper)
from flashnext.cli import main
main(sys.argv[5:])
"""


def hooked(point: tuple[str, str, int], sig: str, *argv: object) -> list[str]:
    """The argv running ``flashnext ARGV`` with ``point`` = (``MODULE:ATTR``, ``before`` or
    ``after``, NTH call) sending ``sig`` (a name: ``SIGTERM``) to the process."""
    where, when, nth = point
    return [sys.executable, "-c", DRIVER, where, when, str(nth), sig, *map(str, argv)]

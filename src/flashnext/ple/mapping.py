"""What Python's ``mmap`` module lacks: which pages of a map are in the page cache
(``mincore``), and ``madvise`` without holding the GIL (``mmap.madvise`` holds it, so a
``MADV_POPULATE_READ`` that reads 16 MiB from disk stalls every other Python thread, the
lookups' callers included). Linux and macOS; elsewhere ``cached_pages`` gives None and
``advise`` falls back to ``mmap.madvise``."""

from __future__ import annotations

import ctypes
import functools
import mmap
import os

import numpy as np


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:  # Windows
        return None
    if not hasattr(libc, "mincore"):
        return None
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def _address(view: mmap.mmap) -> int:
    """The address of ``view``'s first byte (``view`` must not be empty)."""
    probe = np.frombuffer(view, np.uint8, count=1)
    address = int(probe.ctypes.data)
    del probe  # a map cannot close while an array holds it
    return address


def cached_pages(view: mmap.mmap) -> np.ndarray | None:
    """uint8 [pages of ``view``]: 1 where the page is in the page cache, or None where
    ``mincore`` is unavailable or fails."""
    libc = _libc()
    if libc is None or len(view) == 0:
        return None
    vec = np.zeros(-(-len(view) // mmap.PAGESIZE), np.uint8)
    if libc.mincore(ctypes.c_void_p(_address(view)), len(view), vec.ctypes.data) != 0:
        return None
    return vec & 1


def advise(view: mmap.mmap, advice: int, offset: int = 0, length: int | None = None) -> None:
    """``view.madvise(advice, offset, length)``, with the GIL released during the call
    (ctypes releases it). ``offset`` must be a multiple of the page size.

    Raises:
        OSError: the kernel refused the advice (e.g. ``EINVAL`` for an advice it lacks).
    """
    size = len(view) - offset if length is None else min(length, len(view) - offset)
    if size <= 0:
        return
    libc = _libc()
    if libc is None:
        view.madvise(advice, offset, size)
        return
    if libc.madvise(ctypes.c_void_p(_address(view) + offset), size, advice) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"madvise({advice}) failed: {os.strerror(errno)}")

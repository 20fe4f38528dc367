"""A staged lookup that can live inside a CUDA graph: the GPU waits on a host-written flag.

FreeToken's design: the graph's PLE step is ``wait until flag == 1 (a pinned host word) ->
dequantize kernel reading the pinned slot through UVA -> write flag = 0 (the slot is free
again)``, or with ``copy_slot=True`` ``wait -> H2D copy of the whole staging slot -> write
flag = 0 -> kernel`` (FreeToken's original order). The host fills the slot for a step whenever
it knows the step's ids, before or after the graph was launched, and sets the flag; the GPU
runs whatever the graph holds before the PLE step meanwhile. Everything in
:meth:`GraphStagedTable.lookup` has a fixed size (one graph per ``[T, heads]``), so capture and
replay need no host decision.

The wait is a one-warp kernel polling the flag (``wait="spin"``, the default) or the driver's
``cuStreamWaitValue32`` (``wait="stream"``). Measured on the H200 (T = 32, the host filling
after the launch, as a decode step does; BENCHMARKS.md): 54 us a step polling against 68 with
the stream wait behind a 2 GB cache, 66 against 72 without one. The stream wait holds no SM
while it waits.

Without the copy the kernel reads only the bytes the step uses (the ids' inverse index and the
staged rows, not the whole slot sized for every id missing the cache), and the flag is reset
after the kernel instead of after the copy.

The stream memory operations come from the driver library itself (``libcuda``, through
ctypes), so no extra package is needed. The flag lives in pinned memory that the device reads
through unified addressing, as the pinned tables do.
"""

from __future__ import annotations

import ctypes
import time
from typing import Any

import numpy as np

from flashnext.errors import KernelError
from flashnext.kernels._staging import flat_ids
from flashnext.kernels.staged import StagedBatch, StagedTable
from flashnext.kernels.table import UvaPointer, _lookup, torch
from flashnext.ple.table import PLETable

#: How the GPU can wait for the host's flag (GraphStagedTable's ``wait``).
WAITS = ("spin", "stream", "fused", "relay", "stream-fused")
_WAIT_EQ = 1  # CU_STREAM_WAIT_VALUE_EQ
_WRITE_DEFAULT = 0  # CU_STREAM_WRITE_VALUE_DEFAULT
_driver: Any = None


def _cuda_driver() -> Any:
    """libcuda with the two stream memory operations' argument types declared."""
    global _driver
    if _driver is None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise KernelError(f"graph-staged lookups need the CUDA driver library: {exc}") from exc
        for name in ("cuStreamWaitValue32_v2", "cuStreamWriteValue32_v2"):
            fn = getattr(lib, name)
            fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
            fn.restype = ctypes.c_int
        lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        _driver = lib
    return _driver


def _check(fn: str, rc: int) -> None:
    if rc:
        msg = ctypes.c_char_p()
        _cuda_driver().cuGetErrorString(rc, ctypes.byref(msg))
        text = msg.value.decode() if msg.value else "unknown error"
        raise KernelError(f"{fn} failed: CUDA error {rc} ({text})")


class GraphStagedTable(StagedTable):
    """Staged lookups of a fixed ``[T, heads]`` that can be captured in a CUDA graph.

    One pinned staging slot (and one device slot it is copied to); a pinned int32 flag hands
    the slot over (1: filled by the host, 0: taken by the GPU). Call :meth:`stage` once per
    launch of the captured (or eager) :meth:`lookup`, in either order; :meth:`stage` blocks
    until the GPU has taken the previous step's slot.

    Args:
        table: an opened table (any residency; ids outside its row range give zero rows).
        shape: ``(T, heads)`` of every step's ids.
        device, prefault, workers: as for :class:`StagedTable`.
        copy_slot: copy the whole slot to the device before the kernel (True), or let the
            kernel read the pinned slot through UVA (False, the default: no device slot, no
            copy; measured faster on the H200 at T = 32, 512 and 8192 with and without a
            device cache, BENCHMARKS.md).
        wait: how the GPU waits for the flag: ``"spin"`` (a one-warp kernel polls it; the
            default) or ``"stream"`` (``cuStreamWaitValue32``); see the module docstring.

    Raises:
        KernelError: not a CUDA device, ``wait`` is neither, or the driver library is missing.
    """

    def __init__(
        self,
        table: PLETable,
        shape: tuple[int, int],
        device: Any = "cuda",
        prefault: bool = True,
        workers: int | None = None,
        copy_slot: bool = False,
        wait: str = "spin",
    ):
        if torch.device(device).type != "cuda":
            raise KernelError(f"graph-staged lookups need a CUDA device, found {device!r}")
        if wait not in WAITS:
            raise KernelError(f"wait is {wait!r}, expected one of {', '.join(WAITS)}")
        self.shape = (int(shape[0]), int(shape[1]))
        super().__init__(table, self.shape[0] * self.shape[1], 1, device, prefault, workers)
        self._flag = torch.zeros(1, dtype=torch.int32, device="cpu", pin_memory=True)
        self._flag_np = self._flag.numpy()
        self._flag_uva = UvaPointer(self._flag)
        self.wait = wait
        self._lib = _cuda_driver()
        self.copy_slot = bool(copy_slot)
        if not self.copy_slot:
            self._dev = []  # the kernel reads the pinned slot
        if wait in ("fused", "relay", "stream-fused") and self.copy_slot:
            raise KernelError(f"wait={wait!r} reads the pinned slot: it needs copy_slot=False")
        self._done = torch.zeros(2, dtype=torch.int32, device=self.device)

    def stage(self, ids: Any, timeout_s: float = 30.0) -> StagedBatch:
        """Fill the slot with the rows of int ids ``[T, heads]`` and raise the flag.

        Raises:
            KernelError: ids of another shape, or the GPU did not take the previous step
                within ``timeout_s`` (no lookup was launched for it).
        """
        arr = np.asarray(ids)
        if arr.shape != self.shape or arr.dtype.kind not in "iu":
            raise KernelError(
                f"graph-staged ids must be int {list(self.shape)}, found {arr.dtype} "
                f"{list(arr.shape)}"
            )
        t_start = time.perf_counter()
        deadline = t_start + timeout_s
        while self._flag_np[0] != 0:  # the GPU has not copied the last step yet
            if time.perf_counter() > deadline:
                raise KernelError(
                    f"the GPU did not take the staged step within {timeout_s} s: launch "
                    "lookup() (or its graph) once per stage()"
                )
        t_fill = time.perf_counter()
        flat = flat_ids(arr)
        n_unique = self._fill(0, flat)
        t_flag = time.perf_counter()
        self._flag_np[0] = 1  # x86 keeps store order: the slot's bytes are visible first
        return StagedBatch(
            0,
            self.shape,
            int(flat.size),
            n_unique,
            {
                "wait_us": (t_fill - t_start) * 1e6,
                "dedup_gather_us": (t_flag - t_fill) * 1e6,
            },
        )

    def lookup(self, out: Any = None) -> Any:  # type: ignore[override]
        """Enqueue wait-for-flag, the slot's copy, flag reset and the kernel on the current
        stream (without ``copy_slot``: wait, the kernel on the pinned slot, flag reset);
        returns bf16 ``out`` ``[T, heads * width]``. Fixed sizes: capturable.

        Raises:
            KernelError: ``out`` has the wrong shape or dtype, or a driver call failed.
        """
        out = self._out(self.shape, out)
        stream = ctypes.c_void_p(torch.cuda.current_stream(self.device).cuda_stream)
        if self.wait in ("fused", "relay", "stream-fused"):
            if self.wait == "stream-fused":
                _check(
                    "cuStreamWaitValue32",
                    self._lib.cuStreamWaitValue32_v2(stream, int(self._flag.data_ptr()), 1, _WAIT_EQ),
                )
            handover = (self._flag_uva, self._done, self.wait == "relay")
            self._launch(self._host[0], self.max_ids, self.max_ids, out, True, handover)
            return out
        flag = int(self._flag.data_ptr())
        if self.wait == "spin":
            _lookup.launch_wait(self._flag_uva)
        else:
            _check(
                "cuStreamWaitValue32",
                self._lib.cuStreamWaitValue32_v2(stream, flag, 1, _WAIT_EQ),
            )
        if self.copy_slot:
            self._dev[0].copy_(self._host[0], non_blocking=True)
        else:
            self._launch(self._host[0], self.max_ids, self.max_ids, out, pinned=True)
        _check(
            "cuStreamWriteValue32",
            self._lib.cuStreamWriteValue32_v2(stream, flag, 0, _WRITE_DEFAULT),
        )
        if self.copy_slot:
            self._launch(self._dev[0], self.max_ids, self.max_ids, out)
        return out

    def release(self) -> None:
        """Raise the flag without new rows, so a launched lookup stuck waiting completes
        (its output is then stale); for error paths."""
        self._flag_np[0] = 1

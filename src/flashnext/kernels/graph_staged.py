"""A staged lookup that can live inside a CUDA graph: the GPU waits on a host-written flag.

FreeToken's design: the graph's PLE step waits until a pinned host word, the flag, is 1 (the
host filled the staging slot), reads the slot, and writes the flag back to 0 (the slot is free
again). The host fills the slot for a step whenever it knows the step's ids, before or after
the graph was launched, and sets the flag. Everything in :meth:`GraphStagedTable.lookup` has a
fixed size (one graph per ``[T, heads]``), so capture and replay need no host decision.

With ``wait="spin"`` (the default for steps of up to ``SPIN_MAX_IDS`` ids: decode) the step is
one node, the lookup kernel itself: the first of its programs to start polls the flag through
UVA and relays it to the others through a word in device memory (they poll that in L2); no
program reads the slot (the inverse index, then the staged rows it names) before it has seen
the flag, since its first slot address depends on the flag's value; the last program to
finish writes the flag back to 0. No wait kernel before it, no driver write after it. The
spinning kernel holds its programs' places on the SMs while the host fills (512 programs of 8
warps at T = 32 x 16 heads), so other branches of a graph running meanwhile get fewer.

With ``wait="stream"`` (the default for bigger steps, and with ``copy_slot=True``) the driver's
``cuStreamWaitValue32`` waits for the flag, holding no SM, then the kernel reads the pinned
slot (or, with ``copy_slot=True``, FreeToken's original order: an H2D copy of the whole slot,
then the kernel on the copy), and ``cuStreamWriteValue32`` writes the flag back (after the
kernel, or after the copy). Without the copy the kernel reads only the bytes the step uses (the
ids' inverse index and the staged rows, not the whole slot sized for every id missing the
cache).

Measured on the H200 (the host filling after the launch, as a decode step does; 2 GB cache):
T = 32, 42.7 us a step median with the spinning lookup kernel
against 44.8 with the earlier one-warp wait kernel and the driver's write (replay + GPU +
synchronize with the slot already filled 16.3 against 17.1 us) and 46.5 with the stream wait;
T = 512 all within noise; T = 8192 the spinning kernel's GPU part ~10% slower (hence the
stream wait for big steps).

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
from flashnext.host.table import PLETable
from flashnext.kernels.gather import prefault_pages
from flashnext.kernels.staged import SlotsFront, StagedBatch, StagingSlots
from flashnext.kernels.stager import StageKnobs, flat_ids
from flashnext.kernels.table import UvaPointer, torch

#: How the GPU can wait for the host's flag (GraphStagedTable's ``wait``).
WAITS = ("spin", "stream")
#: Steps of at most this many ids wait with ``"spin"`` by default, bigger ones with ``"stream"``
#: (H200: the spinning kernel ~1 us faster at T = 32 x 16 heads, even at T = 512, ~10% slower
#: on the GPU at T = 8192; BENCHMARKS.md#staged-cache).
SPIN_MAX_IDS = 8192
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


class GraphStagedTable(SlotsFront):
    """Staged lookups of a fixed ``[T, heads]`` that can be captured in a CUDA graph: the
    sibling of :class:`~flashnext.kernels.staged.StagedTable` on the same
    :class:`~flashnext.kernels.staged.StagingSlots`.

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
        wait: how the GPU waits for the flag: ``"spin"`` (the lookup kernel polls it; the
            default without ``copy_slot`` for up to ``SPIN_MAX_IDS`` ids a step) or
            ``"stream"`` (``cuStreamWaitValue32``; the default otherwise, and the only wait
            with ``copy_slot``); see the module docstring.

    Raises:
        KernelError: not a CUDA device, ``wait`` is neither (or ``"spin"`` with
            ``copy_slot``), or the driver library is missing.

    ``cold_hints`` is :class:`StagedTable`'s.
    """

    def __init__(
        self,
        table: PLETable,
        shape: tuple[int, int],
        device: Any = "cuda",
        *,
        prefault: bool = True,
        workers: int | None = None,
        copy_slot: bool = False,
        wait: str | None = None,
        cold_hints: str = "off",
    ):
        if torch.device(device).type != "cuda":
            raise KernelError(f"graph-staged lookups need a CUDA device, found {device!r}")
        n_ids = int(shape[0]) * int(shape[1])
        wait = wait or ("spin" if not copy_slot and n_ids <= SPIN_MAX_IDS else "stream")
        if wait not in WAITS:
            raise KernelError(f"wait is {wait!r}, expected one of {', '.join(WAITS)}")
        if wait == "spin" and copy_slot:
            raise KernelError(
                "wait='spin' is the lookup kernel polling the flag before it reads the pinned "
                "slot; a copied slot (copy_slot=True) waits with wait='stream'"
            )
        self.shape = (int(shape[0]), int(shape[1]))
        knobs = StageKnobs(workers=workers or 0, cold_hints=cold_hints)
        self.copy_slot = bool(copy_slot)  # else the kernel reads the pinned slot: no device slot
        self.slots = StagingSlots(table, n_ids, 1, device, device_slots=self.copy_slot, knobs=knobs)
        self.table, self.layout, self.device = table, self.slots.layout, self.slots.device
        self.max_ids = n_ids
        self._flag = torch.zeros(1, dtype=torch.int32, device="cpu", pin_memory=True)
        self._flag_np = self._flag.numpy()
        self._flag_uva = UvaPointer(self._flag)
        self.wait = wait
        self._lib = _cuda_driver()
        # the kernel's ticket/finish counter and the word it relays the flag through
        self._counts = torch.zeros(2, dtype=torch.int32, device=self.device)
        if prefault:
            prefault_pages(table)

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
        n_unique = self.slots.stager.fill(0, flat)  # a decode step's whole host work: one call
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

    def lookup(self, out: Any = None) -> Any:
        """Enqueue the step on the current stream: with ``wait="spin"`` the lookup kernel on the
        pinned slot, which waits for the flag and writes it back to 0 when done; with
        ``"stream"`` the driver's wait for the flag, the slot's copy (``copy_slot``), the
        kernel on the pinned slot or the copy, and the flag's reset (after the copy, or after
        the kernel). Returns bf16 ``out`` ``[T, heads * width]``. Fixed sizes: capturable.

        Raises:
            KernelError: ``out`` has the wrong shape or dtype, or a driver call failed.
        """
        slots = self.slots
        out = slots.out(self.shape, out)
        if self.wait == "spin":
            handover = (self._flag_uva, self._counts)
            slots.launch(slots.host[0], self.max_ids, self.max_ids, out, pinned=True,
                         handover=handover)  # fmt: skip
            return out
        stream = ctypes.c_void_p(torch.cuda.current_stream(self.device).cuda_stream)
        flag = int(self._flag.data_ptr())
        _check("cuStreamWaitValue32", self._lib.cuStreamWaitValue32_v2(stream, flag, 1, _WAIT_EQ))
        if self.copy_slot:
            slots.dev[0].copy_(slots.host[0], non_blocking=True)
        else:
            slots.launch(slots.host[0], self.max_ids, self.max_ids, out, pinned=True)
        _check(
            "cuStreamWriteValue32",
            self._lib.cuStreamWriteValue32_v2(stream, flag, 0, _WRITE_DEFAULT),
        )
        if self.copy_slot:
            slots.launch(slots.dev[0], self.max_ids, self.max_ids, out)
        return out

    def rows_into(self, ids: Any, out: Any) -> None:
        """:class:`~flashnext.kernels.rows.Rows`: :meth:`stage` (ids as torch or numpy int
        ``shape``) then :meth:`lookup` into ``out`` (eager: a captured graph calls
        :meth:`stage` and replays its :meth:`lookup` instead)."""
        self.stage(ids.cpu().numpy() if hasattr(ids, "cpu") else ids)
        self.lookup(out)

    def release(self) -> None:
        """Raise the flag without new rows, so a launched lookup stuck waiting completes
        (its output is then stale); for error paths."""
        self._flag_np[0] = 1

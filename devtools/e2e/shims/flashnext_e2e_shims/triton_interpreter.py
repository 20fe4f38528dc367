"""Shim: two fixes to Triton's interpreter (``TRITON_INTERPRET=1``), patched into
``triton.runtime.interpreter.InterpreterBuilder.binary_op`` right after that module is imported,
and one speed-up (below).

Upstream gaps (Triton 3.6 through 3.9, ``triton/runtime/interpreter.py``):

1. A comparison keeps its left operand's dtype: ``binary_op`` labels every result with
   ``lhs.dtype`` and casts numpy's bool back to it, so ``h <= STATE_LEN - 1`` on scalars is an
   int32 tensor, and a mask built from it fails in ``tl.load`` with ``mask has unsupported dtype``
   (vLLM's PLE conv kernel, ``common/ops/ple.py``). Fixed: compares return int1 (numpy bool).
2. bf16 is held as raw uint16 and ``binary_op`` applies numpy's op to those bits, so bf16
   ``a + b`` adds two integers. This is silent: vLLM's PLE conv output came out near 1e36 and
   every token became 0. Fixed: when an operand is bf16, both are widened to fp32, the op runs
   there and the result is rounded to nearest-even bf16 (what torch does for a bf16 op); bf16
   compares compare the values, not the bit patterns.

Drop it once Triton's interpreter gives compares an int1 result and computes bf16 arithmetic in
fp32 (check with tests/e2e/test_shims.py, which fails on the unpatched interpreter).

And one change of speed, not of results: a call of a ``@triton.jit`` function from inside a kernel
(``tl.sum``, ``tl.sigmoid``, ...) re-patches the ``triton.language`` modules it sees on every call
(``InterpretedFunction.__call__`` -> ``_patch_lang``, walking every member of each module), and
never undoes it. When those modules are patched already (their builtins are the interpreter's
wrappers) the walk would install equal wrappers again, so it is skipped: ~15% of an e2e server's
time (:func:`skip_repatching`, the shim ``triton_repatch``; tests/e2e/test_shims.py checks that
kernels give the same bits with and without it).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np

MODULE = "triton.runtime.interpreter"
COMPARES = (np.less, np.less_equal, np.greater, np.greater_equal, np.equal, np.not_equal)
FLOAT_OPS = (
    np.add, np.subtract, np.multiply, np.divide, np.fmod,
    np.minimum, np.maximum, np.fmin, np.fmax,
)  # fmt: skip
_MARK = "__flashnext_e2e_fixed__"


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """uint16 bf16 bit patterns (any shape) -> float32 values of the same shape."""
    return (np.asarray(bits).astype(np.uint32) << np.uint32(16)).view(np.float32)


def f32_to_bf16_bits(values: np.ndarray) -> np.ndarray:
    """float32 values -> uint16 bf16 bit patterns, rounded to nearest-even (NaN stays NaN)."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    quiet_nan = (bits >> np.uint32(16)) | np.uint32(0x0040)
    return np.where(np.isnan(values), quiet_nan, rounded).astype(np.uint16)


def patch(interpreter: ModuleType) -> None:
    """Wrap ``interpreter.InterpreterBuilder.binary_op`` (idempotent)."""
    import triton.language as tl

    builder = interpreter.InterpreterBuilder
    original = builder.binary_op
    if getattr(original, _MARK, False):
        return
    handle = interpreter.TensorHandle

    def value(h: Any) -> Any:
        # bf16 operands are bit patterns: compute on what they stand for
        return bf16_bits_to_f32(h.data) if h.dtype.scalar == tl.bfloat16 else h.data

    def binary_op(self: Any, lhs: Any, rhs: Any, op: Any) -> Any:
        if op in COMPARES:
            return handle(np.asarray(op(value(lhs), value(rhs)), dtype=np.bool_), tl.int1)
        if lhs.dtype.scalar == tl.bfloat16 and op in FLOAT_OPS:
            out = np.asarray(op(value(lhs), value(rhs)), dtype=np.float32)
            return handle(f32_to_bf16_bits(out), tl.bfloat16)
        return original(self, lhs, rhs, op)

    setattr(binary_op, _MARK, True)
    builder.binary_op = binary_op


def skip_repatching(interpreter: ModuleType) -> None:
    """Wrap ``interpreter.InterpretedFunction.__call__`` to skip ``_patch_lang`` when it would
    change nothing (idempotent; the shim named ``triton_repatch``)."""
    import triton.language as tl

    cls = interpreter.InterpretedFunction
    original = cls.__call__
    if getattr(original, _MARK, False):
        return
    langs: dict[Any, list[ModuleType]] = {}

    def patched(lang: ModuleType) -> bool:
        # _patch_lang replaces every builtin of the module at once; `load` stands for them all
        return not tl.core.is_builtin(lang.load)

    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        seen = langs.get(self.fn)
        if seen is None:  # the modules _patch_lang would patch for this function
            seen = [v for v in self.fn.__globals__.values() if v is tl or v is tl.core]
            langs[self.fn] = seen
        if not seen or not all(patched(lang) for lang in seen):
            return original(self, *args, **kwargs)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # as the original: the interpreter's error type
            raise interpreter.InterpreterError(repr(e)) from e

    setattr(call, _MARK, True)
    cls.__call__ = call

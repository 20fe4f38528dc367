"""Shim: two fixes to Triton's interpreter (``TRITON_INTERPRET=1``), patched into
``triton.runtime.interpreter.InterpreterBuilder.binary_op`` right after that module is imported.

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

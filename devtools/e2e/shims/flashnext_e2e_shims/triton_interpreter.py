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

And three more of speed only (:func:`fast_paths`, the shim ``triton_fast_paths``):

- a bf16 <-> fp32 cast goes through ``_convert_float``, a field-by-field float re-encoder (~0.2 ms
  a call), where a 16-bit shift gives the same bits for every input but subnormals (which still
  take the re-encoder);
- ``_get_np_dtype`` builds a 20-entry dict on every call (~15 us, ~60 calls per program), here
  looked up once per Triton dtype;
- every integer add, sub and mul is redone in int64 and compared with the int32 range
  (``binary_op_sanitize_overflow_impl``, ~0.5 ms each) to feed a ``device_assert`` that does
  nothing unless the interpreter's ``debug`` option is on (it is off, and nothing sets it): with
  ``debug`` off the check is switched off (``sanitize_overflow=False``), as the GPU backends do.

A fourth, in the same shim: block types and block tensors' shapes of one element type and
shape are built once and copied after (:func:`_built_once`; ~15-20% of an e2e server's serving,
the same tokens and logprobs).

The first three together halve the time of vLLM's hyper-connection kernels in a 48-token
prefill (970 -> 453 ms) and take an A/B of the e2e prompts against one server from 49 s to 32 s
(2-vCPU AMD EPYC VM); the same bits (tests/e2e/test_shims.py, special values included).
"""

from __future__ import annotations

import dataclasses
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
#: The interpreter's (private) Triton dtype -> numpy dtype function, memoized by fast_paths.
_NP_DTYPE = "_get_np_dtype"


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


def fast_paths(interpreter: ModuleType) -> None:
    """Faster bf16 <-> fp32 casts, a memoized ``_get_np_dtype``, no integer-overflow check
    while ``debug`` is off and block types built once (idempotent; the shim named
    ``triton_fast_paths``): the same bits as the interpreter's own code."""
    import triton.language as tl

    builder = interpreter.InterpreterBuilder
    original_cast = builder.cast_impl
    if getattr(original_cast, _MARK, False):
        return
    handle = interpreter.TensorHandle
    original_np_dtype = getattr(interpreter, _NP_DTYPE)
    np_dtypes: dict[Any, np.dtype] = {}

    def get_np_dtype(tt_dtype: Any) -> np.dtype:
        scalar = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        if isinstance(scalar, tl.pointer_type):
            return np.dtype(np.uint64)
        found = np_dtypes.get(scalar)
        if found is None:
            found = np_dtypes[scalar] = original_np_dtype(scalar)
        return found

    def cast_impl(self: Any, src: Any, dst_type: Any) -> Any:
        have, want, data = src.dtype.scalar, dst_type.scalar, src.data
        if have == tl.bfloat16 and want == tl.float32 and data.dtype == np.uint16:
            if not _has_subnormal(data, 0x7F80, 0x7F):
                wide = data.astype(np.uint32, order="C")
                wide <<= np.uint32(16)
                return handle(wide.view(np.float32), want)
        elif have == tl.float32 and want == tl.bfloat16 and data.dtype == np.float32:
            bits = data.view(np.uint32)
            if not _has_subnormal(bits, 0x7F800000, 0x7FFFFF):
                # the interpreter truncates here (no rounding mode): the high half of the bits
                narrow = (bits >> np.uint32(16)).astype(np.uint16)  # a numpy scalar if 0-d
                return handle(np.ascontiguousarray(narrow).reshape(data.shape), want)
        return original_cast(self, src, dst_type)

    setattr(cast_impl, _MARK, True)
    builder.cast_impl = cast_impl
    setattr(interpreter, _NP_DTYPE, get_np_dtype)
    _built_once(tl.core)
    options = interpreter.interpreter_builder.options
    if not options.debug:  # the overflow check only feeds device_assert, a no-op without debug
        interpreter.interpreter_builder.options = dataclasses.replace(
            options, sanitize_overflow=False
        )


def _built_once(core: ModuleType) -> None:
    """Every ``block_type`` of one element type and shape, and every block tensor's shape
    (``constexpr`` numel and a Triton tuple of ``constexpr`` sizes), built once and then copied:
    the interpreter builds both for each value of each op of each program, with the shape
    validated and re-wrapped each time (~20% of an e2e server's serving). Types are compared by
    value and never changed once built, so a copy of the first one's attributes is the same
    type. Element types that cannot be hashed (pointers) are built as before."""
    block_type, tensor, constexpr, triton_tuple = (
        core.block_type,
        core.tensor,
        core.constexpr,
        core.tuple,
    )
    make_type, make_tensor = block_type.__init__, tensor.__init__
    types: dict[tuple[Any, tuple[int, ...]], Any] = {}
    shapes: dict[tuple[int, ...], tuple[Any, Any]] = {}

    def ints(shape: Any) -> tuple[int, ...] | None:
        sizes = []
        for size in shape.values if isinstance(shape, triton_tuple) else shape:
            if type(size) is constexpr:
                size = size.value
            if type(size) is not int:
                return None
            sizes.append(size)
        return tuple(sizes)

    def type_init(self: Any, element_ty: Any, shape: Any) -> None:
        key = None
        if type(element_ty).__hash__ is not None and isinstance(shape, (list, tuple, triton_tuple)):
            sizes = ints(shape)
            key = None if sizes is None else (element_ty, sizes)
        built = types.get(key) if key is not None else None
        if built is None:
            make_type(self, element_ty, shape)
            if key is not None:
                types[key] = self
        else:
            self.__dict__.update(built.__dict__)

    def tensor_init(self: Any, handle: Any, ty: Any) -> None:
        if not isinstance(ty, block_type):
            make_tensor(self, handle, ty)
            return
        sizes = tuple(ty.shape.values)
        built = shapes.get(sizes)
        if built is None:
            make_tensor(self, handle, ty)
            shapes[sizes] = (self.numel, self.shape)
            return
        self.handle, self.type, self.dtype = handle, ty, ty.scalar
        self.numel, self.shape = built

    block_type.__init__ = type_init
    tensor.__init__ = tensor_init


def _has_subnormal(bits: np.ndarray, exponent_mask: int, mantissa_mask: int) -> bool:
    """Whether any float (as its bit patterns) has a zero exponent and a nonzero mantissa, the
    inputs ``_convert_float`` re-normalizes (so a shift would not give its bits)."""
    return bool(np.any(((bits & exponent_mask) == 0) & ((bits & mantissa_mask) != 0)))

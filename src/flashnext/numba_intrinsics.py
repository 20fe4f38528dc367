"""Address intrinsics for numba kernels, shared by the host lookups and the staged path.

The CPU lookup kernels (:mod:`flashnext.host.lookup_kernels`) and the staged path's dedup and
gather (:mod:`flashnext.kernels`) read stored rows by integer address; these are the few LLVM
operations they need that numba does not expose. A low module of their own so that neither
side imports the other for them.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

_I32, _I64 = ir.IntType(32), ir.IntType(64)


@intrinsic
def ptr(typingctx, address):  # type: ignore[no-untyped-def]
    """An integer address as a ``void*`` for :func:`numba.carray`."""
    if not isinstance(address, types.Integer):
        return None

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.inttoptr(args[0], cgutils.voidptr_t)

    return types.voidptr(address), codegen


@intrinsic
def prefetch(typingctx, address):  # type: ignore[no-untyped-def]
    """Hint the CPU to load the cache line at ``address`` (never faults)."""
    if not isinstance(address, types.Integer):
        return None

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        at = builder.inttoptr(args[0], cgutils.voidptr_t)
        fnty = ir.FunctionType(ir.VoidType(), [cgutils.voidptr_t, _I32, _I32, _I32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
        builder.call(fn, [at, _I32(0), _I32(3), _I32(1)])  # read, keep in all levels, data
        return context.get_dummy_value()

    return types.none(address), codegen


@intrinsic
def popcount(typingctx, word):  # type: ignore[no-untyped-def]
    """Set bits of a uint64."""
    if not isinstance(word, types.Integer):
        return None

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        value = builder.zext(args[0], _I64) if args[0].type.width < 64 else args[0]
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(_I64, [_I64]), "llvm.ctpop.i64"
        )
        return builder.call(fn, [value])

    return types.int64(word), codegen


@intrinsic
def memcpy(typingctx, dst, src, nbytes):  # type: ignore[no-untyped-def]
    """``memcpy(dst, src, nbytes)`` between integer addresses."""
    if not all(isinstance(a, types.Integer) for a in (dst, src, nbytes)):
        return None

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        d, s, n = args
        to_ptr = [builder.inttoptr(a, cgutils.voidptr_t) for a in (d, s)]
        cgutils.raw_memcpy(builder, to_ptr[0], to_ptr[1], n, 1)
        return context.get_dummy_value()

    return types.none(dst, src, nbytes), codegen

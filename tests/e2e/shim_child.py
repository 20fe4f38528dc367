"""Child for test_shims.py, run in the e2e runtime: each shimmed behaviour, as JSON on stdout.

Runs with or without the shims (``FLASHNEXT_E2E_SHIMS_OFF``); every case reports what happened
instead of raising, so the parent can check both sides. Inputs come from ``argv[1]`` (a seed).
"""

from __future__ import annotations

import json
import sys


def torchvision_case() -> str:
    try:
        import torchvision  # noqa: F401
    except Exception as exc:  # the CUDA build's import error is the point of the case
        return f"{type(exc).__name__}: {exc}"
    return "imported"


def triton_cases(seed: int) -> dict[str, object]:
    import numpy as np
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def binary(a, b, add, sub, mul, lt, N: tl.constexpr):
        offs = tl.arange(0, N)
        x, y = tl.load(a + offs), tl.load(b + offs)
        tl.store(add + offs, x + y)
        tl.store(sub + offs, x - y)
        tl.store(mul + offs, x * y)
        tl.store(lt + offs, (x < y).to(tl.int8))

    @triton.jit
    def scalar_mask(x, out, LIMIT: tl.constexpr, N: tl.constexpr):
        # vLLM's PLE conv kernel builds masks this way: a compare of scalars, splatted
        h = tl.program_id(0)
        offs = tl.arange(0, N)
        keep = h <= LIMIT - 1
        tl.store(out + h * N + offs, tl.load(x + h * N + offs, mask=(offs < N) & keep, other=0.0))

    gen = torch.Generator().manual_seed(seed)
    a = (torch.randn(256, generator=gen) * 4).to(torch.bfloat16)
    b = (torch.randn(256, generator=gen) * 4).to(torch.bfloat16)
    outs = [torch.empty_like(a) for _ in range(3)] + [torch.empty(256, dtype=torch.int8)]
    result: dict[str, object] = {}
    try:
        binary[(1,)](a, b, *outs, N=256)
        refs = [a + b, a - b, a * b, (a < b).to(torch.int8)]  # torch: fp32 math, RNE to bf16
        result["bf16_equal_to_torch"] = [bool(torch.equal(o, r)) for o, r in zip(outs, refs)]
    except Exception as exc:
        result["bf16_equal_to_torch"] = f"{type(exc).__name__}: {exc}"
    x = torch.randn(6, 16, generator=gen)
    out = torch.full_like(x, float("nan"))
    try:
        scalar_mask[(6,)](x, out, LIMIT=4, N=16)
        ref = x.numpy().copy()
        ref[4:] = 0.0
        result["mask_equal_to_numpy"] = bool(np.array_equal(out.numpy(), ref))
    except Exception as exc:
        result["mask_equal_to_numpy"] = f"{type(exc).__name__}: {exc}"

    @triton.jit
    def nested(x, out, N: tl.constexpr):
        # tl.sum, tl.max and tl.sigmoid are @triton.jit functions: calls the interpreter
        # re-patches for (the triton_repatch shim skips that)
        h = tl.program_id(0)
        v = tl.load(x + h * N + tl.arange(0, N))
        tl.store(out + h, tl.sum(tl.sigmoid(v) * v, axis=0) + tl.max(v, axis=0))

    x = torch.randn(8, 64, generator=gen) * 3
    out = torch.empty(8)
    try:
        nested[(8,)](x, out, N=64)
        result["nested_bits"] = out.numpy().view(np.uint32).tolist()
    except Exception as exc:
        result["nested_bits"] = f"{type(exc).__name__}: {exc}"
    result.update(fast_path_cases(gen))
    from triton.backends import backends

    result["cpu_backend"] = "cpu" in backends
    return result


def special_bits(width: int) -> list[int]:
    """Bit patterns of a float of ``width`` bits (16: bf16, 32: fp32) the casts must keep, each
    with either sign: zero, the smallest and largest subnormals, the smallest normal, the largest
    finite, infinity, a signalling NaN (payload 1: for fp32 only in the low half, which bf16
    drops) and the quiet NaN; for fp32 also a subnormal with mantissa bits in both halves."""
    mantissa = 7 if width == 16 else 23
    sign, inf = 1 << (width - 1), ((1 << (width - 1 - mantissa)) - 1) << mantissa
    top = (1 << mantissa) - 1
    plus = [0, 1, top, 1 << mantissa, inf - 1, inf, inf | 1, inf | (1 << (mantissa - 1))]
    if width == 32:
        plus.append(0x0001_0001)
    return [b for p in plus for b in (p, p | sign)]


def fast_path_cases(gen: object) -> dict[str, object]:
    """What the ``triton_fast_paths`` shim touches, as bits: bf16 -> fp32 and fp32 -> bf16
    casts of random and special values (with and without subnormals in a block), and int32
    index arithmetic that overflows (wraps: the interpreter's overflow check feeds a
    device_assert that is off)."""
    import numpy as np
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def casts(h, f, h_to_f, f_to_h, N: tl.constexpr):
        offs = tl.program_id(0) * N + tl.arange(0, N)
        tl.store(h_to_f + offs, tl.load(h + offs).to(tl.float32))
        tl.store(f_to_h + offs, tl.load(f + offs).to(tl.bfloat16))
        # and scalars (0-d values), into the block's last element
        last = tl.program_id(0) * N + N - 1
        tl.store(h_to_f + last, tl.load(h + last - 1).to(tl.float32))
        tl.store(f_to_h + last, tl.load(f + last - 1).to(tl.bfloat16))

    @triton.jit
    def wrap(x, out, K: tl.constexpr, N: tl.constexpr):
        offs = tl.arange(0, N)
        v = tl.load(x + offs)
        tl.store(out + offs, v * K + v - K)

    n = 64
    half = torch.randint(0, 1 << 16, (4 * n,), dtype=torch.int32, generator=gen).to(torch.int16)
    full = torch.randint(-(1 << 31), 1 << 31, (4 * n,), dtype=torch.int64, generator=gen)
    full = full.to(torch.int32)
    # block 0 starts with the special values (subnormals: the slow path), the others have none
    h_bits, f_bits = special_bits(16), special_bits(32)
    half[: len(h_bits)] = torch.tensor(h_bits, dtype=torch.int32)
    full[: len(f_bits)] = torch.tensor(np.array(f_bits, dtype=np.uint32).view(np.int32))
    for block in (1, 2, 3):  # no subnormal in these blocks
        h, f = half[block * n : (block + 1) * n], full[block * n : (block + 1) * n]
        h[(h & 0x7F80) == 0] |= 0x0080
        f[(f & 0x7F800000) == 0] |= 0x00800000
    h_to_f = torch.empty(4 * n, dtype=torch.float32)
    f_to_h = torch.empty(4 * n, dtype=torch.bfloat16)
    out: dict[str, object] = {}
    try:
        casts[(4,)](half.view(torch.bfloat16), full.view(torch.float32), h_to_f, f_to_h, N=n)
        out["cast_bits"] = [h_to_f.view(torch.int32).tolist(), f_to_h.view(torch.int16).tolist()]
    except Exception as exc:
        out["cast_bits"] = f"{type(exc).__name__}: {exc}"
    x = torch.randint(1 << 29, 1 << 31, (32,), dtype=torch.int64, generator=gen).to(torch.int32)
    wrapped = torch.empty_like(x)
    try:
        wrap[(1,)](x, wrapped, K=7, N=32)
        out["int_wrap"] = [wrapped.tolist(), ((x.long() * 8 - 7 + 2**31) % 2**32 - 2**31).tolist()]
    except Exception as exc:
        out["int_wrap"] = f"{type(exc).__name__}: {exc}"
    out["tile_norm"] = tile_norm_case(gen)
    return out


def tile_norm_case(gen: object) -> object:
    """What the type cache of ``triton_fast_paths`` touches: blocks of one shape and several
    element types (int32 offsets, bf16, fp32, pointers), a scalar splat, 1-D -> 2-D
    broadcasts and two-axis reductions, as in vLLM's hyper-connection kernels. Returns
    ``[bits of y, max |y - float64 reference|]``."""
    import numpy as np
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def tile_norm(x, w, y, EPS: tl.constexpr, TILES: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.arange(0, TILES)[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
        v = tl.load(x + row * TILES * BLOCK + offs).to(tl.float32)
        scale = tl.sum(tl.sum(v * v, axis=1), axis=0)
        rrms = tl.rsqrt(scale / (TILES * BLOCK) + EPS)
        g = tl.load(w + tl.arange(0, BLOCK))[None, :].to(tl.float32)
        tl.store(y + row * TILES * BLOCK + offs, v * rrms * (1.0 + g))

    rows, tiles, block = 3, 4, 16
    x = (torch.randn(rows, tiles * block, generator=gen) * 2).to(torch.bfloat16)
    w = torch.randn(block, generator=gen).to(torch.bfloat16)
    y = torch.empty(rows, tiles * block)
    try:
        tile_norm[(rows,)](x, w, y, EPS=1e-6, TILES=tiles, BLOCK=block)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    v = x.double().numpy()
    ref = v / np.sqrt((v * v).mean(axis=1, keepdims=True) + 1e-6)
    ref = ref * (1.0 + np.tile(w.double().numpy(), tiles))
    return [y.view(torch.int32).flatten().tolist(), float(np.abs(y.double().numpy() - ref).max())]


if __name__ == "__main__":
    report = {"torchvision": torchvision_case(), **triton_cases(int(sys.argv[1]))}
    print(json.dumps(report))

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
    from triton.backends import backends

    result["cpu_backend"] = "cpu" in backends
    return result


if __name__ == "__main__":
    report = {"torchvision": torchvision_case(), **triton_cases(int(sys.argv[1]))}
    print(json.dumps(report))

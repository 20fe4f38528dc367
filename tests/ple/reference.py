"""Float64 reference dequantizers written from the card's spec, sharing no code with flashnext."""

import ml_dtypes
import numpy as np

# E2M1: code = magnitude index | sign << 3 (the card's table)
E2M1 = {i: v for i, v in enumerate([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])}
E2M1.update({i | 8: -v for i, v in list(E2M1.items())})


def nibbles(packed):
    """uint8 [n, w/2] -> int [n, w], low nibble first."""
    packed = np.asarray(packed).astype(np.int64)
    out = np.empty((packed.shape[0], packed.shape[1] * 2), dtype=np.int64)
    out[:, 0::2] = packed % 16
    out[:, 1::2] = packed // 16
    return out


def dequant64(fmt, t):
    """The card's formulas in float64."""
    if fmt == "bf16":
        return np.asarray(t["weight"]).astype(np.float64)
    if fmt == "fp8":
        q = np.asarray(t["weight_fp8"]).astype(np.float64)
        return q * np.asarray(t["weight_scale"]).astype(np.float64).reshape(-1, 1)
    if fmt == "int4":
        nib = nibbles(t["weight_i4"]).astype(np.float64)
        scale = np.repeat(np.asarray(t["weight_scale"]).astype(np.float64), 16, axis=1)
        return (nib - 8) * scale
    if fmt == "nvfp4":
        lut = np.array([E2M1[c] for c in range(16)])
        vals = lut[nibbles(t["weight_e2m1"])]
        scale = np.asarray(t["weight_scale"]).astype(np.float64)
        scale = np.repeat(scale, 16, axis=1)
        s2 = np.asarray(t["weight_scale_2"], dtype=np.float64).reshape(-1, 1)
        return vals * scale * s2
    raise ValueError(fmt)


def card_tensors(fmt, rows, rng):
    """Random but valid stored tensors of a format, as another tool might write them."""
    if fmt == "bf16":
        return {"weight": rng.standard_normal((rows, 160)).astype(ml_dtypes.bfloat16)}
    if fmt == "fp8":
        q = rng.integers(0, 256, size=(rows, 160), dtype=np.uint8)
        q[(q & 0x7F) == 0x7F] = 0x11  # no NaN codes
        return {
            "weight_fp8": q.view(ml_dtypes.float8_e4m3fn),
            "weight_scale": rng.random(rows).astype(np.float32) * 0.01,
        }
    if fmt == "int4":
        return {
            "weight_i4": rng.integers(0, 256, size=(rows, 80), dtype=np.uint8),
            "weight_scale": (rng.random((rows, 10)) * 0.02).astype(np.float16),
        }
    if fmt == "nvfp4":
        s = rng.integers(0x08, 0x70, size=(rows, 10), dtype=np.uint8)
        return {
            "weight_e2m1": rng.integers(0, 256, size=(rows, 80), dtype=np.uint8),
            "weight_scale": s.view(ml_dtypes.float8_e4m3fn),
            "weight_scale_2": np.array(rng.random() * 1e-3 + 1e-5, dtype=np.float32),
        }
    raise ValueError(fmt)

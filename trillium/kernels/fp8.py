"""fp8 KV cache formats: ranges, quantization, exact widening (torch; no Triton).

A cache of float8_e4m3fn (3 mantissa bits, largest value 448) or
float8_e5m2 (2 bits, 57344) holds keys and values divided by a per-tensor
float32 scale (k_scale, v_scale: one element each, on the cache's device;
None means 1.0):

    write      cache = fp8(clamp(x / scale, -fp8_max, fp8_max))   rounded to nearest even
    read       K = float(cache_k) * k_scale, V = float(cache_v) * v_scale

Saturating (not inf) keeps one outlier from poisoning a whole softmax. The
read is exact up to the scale multiply: every fp8 value is a float32,
bfloat16 and float16 value. `reference.py` and the Triton kernels both
follow these semantics.
"""

from __future__ import annotations

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of an fp8 format: 448 (e4m3fn), 57344 (e5m2)."""
    return float(torch.finfo(dtype).max)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """x / scale, clamped to the format's range (saturate, never inf), rounded to `dtype`."""
    xf = x.float() if scale is None else x.float() / scale
    limit = fp8_max(dtype)
    return xf.clamp(-limit, limit).to(dtype)  # NOTE: not clamp_: x.float() may be x itself


def widen_fp8(src: torch.Tensor, out: torch.Tensor, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """fp8 `src` -> `out` (a float dtype, same shape), exactly; returns `out`.

    `scratch`: an optional int16 buffer of at least src.numel() elements.

    WHY bits for e4m3fn on CPU: torch's e4m3fn cast is a scalar loop there
    (~2.7 ns an element: 10x a whole float32 decode attention). The code's
    bits shifted into a float16 hold value / 256 exactly, subnormals
    included, and int16 / float16 ops are vectorized: ~0.3 ns an element.
    (torch's e5m2 cast is already fast.)
    NOTE: NaN codes (0x7F, 0xFF) read as +-480; writes saturate, so only a
    NaN key or value can leave one.
    """
    if src.dtype != torch.float8_e4m3fn or src.device.type != "cpu":
        return out.copy_(src)
    if scratch is None:
        bits = torch.empty(src.shape, dtype=torch.int16)
    else:
        bits = scratch[: src.numel()].view(src.shape)
    bits.copy_(src.view(torch.int8))  # sign-extended: bits 15..7 hold the sign
    bits <<= 7  # exponent and mantissa to float16's places, the sign to bit 15 (and 14)
    bits &= ~0x4000  # clear bit 14: e4m3's exponent is 4 bits, float16's 5
    return out.copy_(bits.view(torch.float16)).mul_(256.0)

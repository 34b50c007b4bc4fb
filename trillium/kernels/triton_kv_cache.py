"""Triton kernel for write_kv_cache: scatter new K/V rows into the paged cache.

Cache layout (see `metadata.py`): [num_blocks, block_size, KH, D], so one
token's slot is a contiguous run of KH * D elements at slot * KH * D. One
program copies one token's K and V rows (cast to the cache dtype). An fp8
cache gets them divided by its per-tensor scale and saturated to the
format's range first, as `reference.write_kv_cache` defines.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from trillium.kernels.fp8 import FP8_DTYPES

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def fp8_cache_supported(cache: torch.Tensor) -> bool:
    """Can Triton kernels read and write this cache's dtype on its device?

    NOTE: Triton has float8_e4m3fn ("fp8e4nv") from sm_89 (Ada, Hopper) on;
    float8_e5m2 compiles everywhere. Float caches answer True.
    """
    if cache.dtype not in FP8_DTYPES:
        return True
    if cache.dtype == torch.float8_e4m3fn and cache.is_cuda:
        return torch.cuda.get_device_capability(cache.device) >= (8, 9)
    return True


@triton.jit
def _to_cache(x, scale, cache_ptr):
    """One row for the cache: as is for a float cache; x / scale, saturated, for fp8."""
    if cache_ptr.dtype.element_ty.is_fp8():
        x = x.to(tl.float32) / scale
        if cache_ptr.dtype.element_ty == tl.float8e5:
            x = tl.clamp(x, -57344.0, 57344.0)
        else:
            x = tl.clamp(x, -448.0, 448.0)
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    slot_ptr,
    stride_k_t,
    stride_v_t,
    row_elems,
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    # NOTE: a negative slot (vLLM's marker for padding tokens) is skipped;
    # the torch reference would raise on it instead of writing out of bounds.
    if slot >= 0:
        # Float caches never load the scales (their pointers are placeholders).
        k_scale = 1.0
        v_scale = 1.0
        if k_cache_ptr.dtype.element_ty.is_fp8():
            k_scale = tl.load(k_scale_ptr)
            v_scale = tl.load(v_scale_ptr)
        for start in range(0, row_elems, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < row_elems
            k = tl.load(k_ptr + token * stride_k_t + offs, mask=mask)
            v = tl.load(v_ptr + token * stride_v_t + offs, mask=mask)
            tl.store(k_cache_ptr + slot * row_elems + offs, _to_cache(k, k_scale, k_cache_ptr), mask=mask)
            tl.store(v_cache_ptr + slot * row_elems + offs, _to_cache(v, v_scale, v_cache_ptr), mask=mask)


def scale_or_one(scale: torch.Tensor | None, cache: torch.Tensor) -> torch.Tensor:
    """The scale pointer for a launch: the given scale (checked), 1.0 for an fp8 cache
    without one, or the cache itself as a never-loaded placeholder for a float cache."""
    if cache.dtype not in FP8_DTYPES:
        return cache
    if scale is None:
        return torch.ones((), dtype=torch.float32, device=cache.device)
    assert scale.numel() == 1 and scale.dtype == torch.float32, f"scale: {tuple(scale.shape)} {scale.dtype}"
    assert scale.device == cache.device, f"scale on {scale.device}, cache on {cache.device}"
    return scale


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """k, v: [T, KH, D] (each token's heads contiguous) -> caches at slot_mapping [T], in place."""
    assert k_cache.dim() == 4, "k_cache must be [num_blocks, block_size, KH, D]"
    assert k_cache.shape == v_cache.shape, f"{tuple(k_cache.shape)} != {tuple(v_cache.shape)}"
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "caches must be contiguous"
    _, _, num_kv_heads, head_dim = k_cache.shape
    num_tokens = k.shape[0]
    for name, t in (("k", k), ("v", v)):
        assert t.shape == (num_tokens, num_kv_heads, head_dim), f"{name} {tuple(t.shape)} vs cache"
        assert t.stride(2) == 1 and t.stride(1) == head_dim, f"{name}: heads of a token must be contiguous"
        assert t.dtype in _FLOAT_DTYPES, f"{name}: unsupported dtype {t.dtype}"
    assert k_cache.dtype == v_cache.dtype, f"cache dtypes {k_cache.dtype} != {v_cache.dtype}"
    assert k_cache.dtype in _FLOAT_DTYPES + FP8_DTYPES, f"unsupported cache dtype {k_cache.dtype}"
    assert slot_mapping.shape == (num_tokens,), f"slot_mapping {tuple(slot_mapping.shape)}"
    assert slot_mapping.dtype in (torch.int32, torch.int64), f"slot_mapping dtype {slot_mapping.dtype}"
    assert k.device == k_cache.device == slot_mapping.device
    if num_tokens == 0:
        return
    row_elems = num_kv_heads * head_dim
    block = min(2048, triton.next_power_of_2(row_elems))
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, scale_or_one(k_scale, k_cache), scale_or_one(v_scale, v_cache),
        slot_mapping.contiguous(), k.stride(0), v.stride(0), row_elems,
        BLOCK=block, num_warps=4,
    )  # fmt: skip

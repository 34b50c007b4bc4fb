"""Triton kernel for write_kv_cache: scatter new K/V rows into the paged cache.

Cache layout (see `metadata.py`): [num_blocks, block_size, KH, D], so one
token's slot is a contiguous run of KH * D elements at slot * KH * D. One
program copies one token's K and V rows (cast to the cache dtype).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
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
        for start in range(0, row_elems, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < row_elems
            k = tl.load(k_ptr + token * stride_k_t + offs, mask=mask)
            v = tl.load(v_ptr + token * stride_v_t + offs, mask=mask)
            tl.store(k_cache_ptr + slot * row_elems + offs, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
            tl.store(v_cache_ptr + slot * row_elems + offs, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
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
    assert k_cache.dtype in _FLOAT_DTYPES and v_cache.dtype in _FLOAT_DTYPES
    assert slot_mapping.shape == (num_tokens,), f"slot_mapping {tuple(slot_mapping.shape)}"
    assert slot_mapping.dtype in (torch.int32, torch.int64), f"slot_mapping dtype {slot_mapping.dtype}"
    assert k.device == k_cache.device == slot_mapping.device
    if num_tokens == 0:
        return
    row_elems = num_kv_heads * head_dim
    block = min(2048, triton.next_power_of_2(row_elems))
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping.contiguous(), k.stride(0), v.stride(0), row_elems,
        BLOCK=block, num_warps=4,
    )  # fmt: skip

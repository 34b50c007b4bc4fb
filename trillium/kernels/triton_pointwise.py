"""Triton kernels for the row-wise ops: rms_norm, silu_and_mul, rotary_embedding.

Each launcher checks shapes, strides and dtypes, then launches one program
per token row. Semantics are those of `reference.py` (all math in float32,
one rounding to the output dtype at the end).

Imported lazily by `dispatch.py` only when a CUDA tensor arrives, and by the
interpreter tests (TRITON_INTERPRET=1) on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# One program holds a whole row in registers; wider rows fall back to torch.
MAX_ROW_ELEMENTS = 65536


def _check_float(name: str, t: torch.Tensor) -> None:
    assert t.dtype in _FLOAT_DTYPES, f"{name}: unsupported dtype {t.dtype}"


# ---------------------------------------------------------------- rms_norm


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    row_stride_x,
    row_stride_y,
    n_cols,
    eps,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * row_stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    mean_sq = tl.sum(x * x, axis=0) / n_cols
    rstd = tl.rsqrt(mean_sq + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = x * rstd * w
    tl.store(y_ptr + row * row_stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Inputs this kernel handles; everything else goes to the torch reference."""
    return (
        x.shape[-1] <= MAX_ROW_ELEMENTS
        and x.stride(-1) == 1
        and x.dtype in _FLOAT_DTYPES
        and weight.dtype in _FLOAT_DTYPES
        and weight.is_contiguous()
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., N] (last dim contiguous), weight: [N] -> y like x."""
    _check_float("x", x)
    _check_float("weight", weight)
    n_cols = x.shape[-1]
    assert weight.shape == (n_cols,), f"weight {tuple(weight.shape)} != ({n_cols},)"
    assert weight.is_contiguous(), "weight must be contiguous"
    assert x.stride(-1) == 1, "x: last dim must be contiguous"
    assert n_cols <= MAX_ROW_ELEMENTS, f"rows of {n_cols} > {MAX_ROW_ELEMENTS}"
    assert x.device == weight.device
    x2 = x.reshape(-1, n_cols)
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0] > 0:
        block = triton.next_power_of_2(n_cols)
        _rms_norm_kernel[(x2.shape[0],)](
            x2, weight, y, x2.stride(0), y.stride(0), n_cols, eps,
            BLOCK=block, num_warps=min(16, max(1, block // 256)),
        )  # fmt: skip
    return y.view(x.shape)


# ------------------------------------------------------------ silu_and_mul


@triton.jit
def _silu_and_mul_kernel(x_ptr, y_ptr, row_stride_x, row_stride_y, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * row_stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * row_stride_x + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(y_ptr + row * row_stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2I] as [gate | up] (last dim contiguous) -> [..., I]."""
    _check_float("x", x)
    assert x.shape[-1] % 2 == 0, f"last dim {x.shape[-1]} must be even"
    assert x.stride(-1) == 1, "x: last dim must be contiguous"
    n_cols = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * n_cols)
    y = torch.empty((x2.shape[0], n_cols), dtype=x.dtype, device=x.device)
    if x2.shape[0] > 0 and n_cols > 0:
        block = min(1024, triton.next_power_of_2(n_cols))
        grid = (x2.shape[0], triton.cdiv(n_cols, block))
        _silu_and_mul_kernel[grid](x2, y, x2.stride(0), y.stride(0), n_cols, BLOCK=block, num_warps=4)
    return y.view(*x.shape[:-1], n_cols)


# -------------------------------------------------------- rotary_embedding


@triton.jit
def _rotate_heads(
    src_ptr,
    dst_ptr,
    token,
    stride_src_t,
    stride_dst_t,
    num_heads,
    head_dim,
    cos,
    sin,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """Neox rotation of all heads of one token; rows are heads, cols half-dims."""
    half = head_dim // 2
    heads = tl.arange(0, BLOCK_H)[:, None]
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < num_heads) & (cols < half)
    src = src_ptr + token * stride_src_t + heads * head_dim + cols
    dst = dst_ptr + token * stride_dst_t + heads * head_dim + cols
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + half, mask=mask, other=0.0).to(tl.float32)
    out_ty = dst_ptr.dtype.element_ty
    tl.store(dst, (x1 * cos - x2 * sin).to(out_ty), mask=mask)
    tl.store(dst + half, (x2 * cos + x1 * sin).to(out_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    pos_ptr,
    cache_ptr,
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    stride_cache,
    stride_q_t,
    stride_k_t,
    stride_qo_t,
    stride_ko_t,
    num_q_heads,
    num_k_heads,
    head_dim,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    half = head_dim // 2
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    cmask = cols < half
    cos = tl.load(cache_ptr + pos * stride_cache + cols, mask=cmask, other=0.0).to(tl.float32)
    sin = tl.load(cache_ptr + pos * stride_cache + half + cols, mask=cmask, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr, q_out_ptr, token, stride_q_t, stride_qo_t, num_q_heads, head_dim,
                  cos, sin, BLOCK_HQ, BLOCK_HALF)  # fmt: skip
    _rotate_heads(k_ptr, k_out_ptr, token, stride_k_t, stride_ko_t, num_k_heads, head_dim,
                  cos, sin, BLOCK_HK, BLOCK_HALF)  # fmt: skip


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] int; q [T, H, D]; k [T, KH, D]; cos_sin_cache [max_pos, D] -> new (q, k).

    q and k may be token-strided views (e.g. slices of a fused qkv tensor) as
    long as each token's heads are contiguous. Positions are not range-checked
    on the device (the reference raises on out-of-range positions).
    """
    _check_float("q", q)
    _check_float("k", k)
    _check_float("cos_sin_cache", cos_sin_cache)
    assert q.dim() == 3 and k.dim() == 3, "q, k must be [T, heads, D]"
    num_tokens, num_q_heads, head_dim = q.shape
    assert k.shape[0] == num_tokens and k.shape[2] == head_dim, f"k {tuple(k.shape)} vs q {tuple(q.shape)}"
    assert head_dim % 2 == 0, f"head_dim {head_dim} must be even"
    assert positions.shape == (num_tokens,), f"positions {tuple(positions.shape)}"
    assert positions.dtype in (torch.int32, torch.int64), f"positions dtype {positions.dtype}"
    assert cos_sin_cache.dim() == 2 and cos_sin_cache.shape[1] == head_dim, (
        f"cos_sin_cache {tuple(cos_sin_cache.shape)} must be [max_pos, {head_dim}]"
    )
    assert cos_sin_cache.stride(1) == 1, "cos_sin_cache rows must be contiguous"
    for name, t in (("q", q), ("k", k)):
        assert t.stride(2) == 1 and t.stride(1) == head_dim, f"{name}: heads of a token must be contiguous"
    positions = positions.contiguous()
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens > 0:
        _rotary_kernel[(num_tokens,)](
            positions, cos_sin_cache, q, k, q_out, k_out,
            cos_sin_cache.stride(0), q.stride(0), k.stride(0), q_out.stride(0), k_out.stride(0),
            num_q_heads, k.shape[1], head_dim,
            BLOCK_HQ=triton.next_power_of_2(num_q_heads),
            BLOCK_HK=triton.next_power_of_2(k.shape[1]),
            BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
            num_warps=4,
        )  # fmt: skip
    return q_out, k_out

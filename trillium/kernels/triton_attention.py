"""Triton kernel for paged_attention: one varlen kernel for prefill, chunked prefill and decode.

The idea (flash attention over a paged cache, GQA packed into rows):

    grid = (num_tokens // BLOCK_Q + num_seqs, num_kv_heads)

    Sequence b owns the query blocks from query_start[b] // BLOCK_Q + b on
    (always enough for its q_len; a few trailing ones exit at once), found by
    a binary search. Unlike a (num_seqs, cdiv(max_query_len, BLOCK_Q)) grid,
    one long prompt among many decodes launches no flood of empty programs.

    one program = BLOCK_Q query tokens of one sequence x the G query heads
    that share one KV head, laid out as BLOCK_M = BLOCK_Q * G_PAD rows:

        row r -> query token  q_block * BLOCK_Q + r // G_PAD
                 query head   kv_head * G + r % G_PAD   (rows with r % G_PAD >= G idle)

    It walks the sequence's keys in tiles of BLOCK_N positions. Each key
    position p is looked up through the block table (block_tables[b, p //
    block_size], offset p % block_size), so a tile may span several cache
    blocks and any block size works. Scores are masked causally (query i sits
    at position seq_len - q_len + i) and folded into an online softmax in
    float32 (exp2 with the scale pre-multiplied by log2(e)).

Packing the G heads into rows makes decode (q_len 1) fill a 16-row tile with
useful work for G >= 4 and reads each K/V tile once per KV head, not per
query head. Semantics are those of `reference.paged_attention`.

fp8 caches: K/V tiles are loaded as fp8 (a quarter of float32's bytes) and
widened to q's dtype (exact), so the dots run as for a float cache; k_scale
is folded into the score scale and v_scale into the final normalization.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from trillium.kernels.fp8 import FP8_DTYPES
from trillium.kernels.metadata import AttentionMetadata
from trillium.kernels.triton_kv_cache import fp8_cache_supported, scale_or_one

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256
_LOG2_E = 1.4426950408889634


@triton.jit
def _find_seq(query_start_ptr, q_block_global, num_seqs, BLOCK_Q: tl.constexpr):
    """Last sequence b with query_start[b] // BLOCK_Q + b <= q_block_global."""
    left: tl.int32 = 0
    right = num_seqs
    while left < right:
        mid = (left + right) // 2
        first_block = tl.load(query_start_ptr + mid) // BLOCK_Q + mid
        if first_block <= q_block_global:
            left = mid + 1
        else:
            right = mid
    return left - 1


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    out_ptr,
    query_start_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    stride_q_t,
    stride_q_h,
    stride_o_t,
    stride_o_h,
    stride_bt,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    scale_log2,
    num_queries_per_kv,
    head_dim,
    num_seqs,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    G_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_FP32: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    q_block_global = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_seq(query_start_ptr, q_block_global, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_ptr + seq)
    q_block = q_block_global - (q_start // BLOCK_Q + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    q_idx = q_block * BLOCK_Q + rows // G_PAD
    group_idx = rows % G_PAD
    row_valid = (q_idx < q_len) & (group_idx < num_queries_per_kv)
    head = kv_head * num_queries_per_kv + group_idx
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < head_dim
    token = (q_start + q_idx).to(tl.int64)

    q_mask = row_valid[:, None] & dim_valid[None, :]
    q_offs = token[:, None] * stride_q_t + head[:, None] * stride_q_h + dims[None, :]
    q = tl.load(q_ptr + q_offs, mask=q_mask, other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    qk_scale = scale_log2
    if k_cache_ptr.dtype.element_ty.is_fp8():  # static: float caches never load the scales
        qk_scale = scale_log2 * tl.load(k_scale_ptr)
    q_pos = context_len + q_idx
    # The last query row of this program sees keys up to its own position.
    kv_end = tl.minimum(seq_len, context_len + (q_block + 1) * BLOCK_Q)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    head_off = kv_head.to(tl.int64) * stride_cache_head
    for start in range(0, kv_end, BLOCK_N):
        k_pos = start + tl.arange(0, BLOCK_N)
        k_valid = k_pos < kv_end
        block = tl.load(table_row + k_pos // BLOCK_SIZE, mask=k_valid, other=0).to(tl.int64)
        slot_off = block * stride_cache_block + (k_pos % BLOCK_SIZE) * stride_cache_slot + head_off
        kv_offs = slot_off[:, None] + dims[None, :]
        kv_mask = k_valid[:, None] & dim_valid[None, :]
        k = tl.load(k_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        if k_cache_ptr.dtype.element_ty.is_fp8():
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * qk_scale
        visible = (k_pos[None, :] <= q_pos[:, None]) & k_valid[None, :]
        s = tl.where(visible, s, float("-inf"))
        # INVARIANT: the first tile holds key 0, visible to every row, so
        # m_new is finite from the first iteration on (no inf - inf).
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if v_cache_ptr.dtype.element_ty.is_fp8():
        out = out * tl.load(v_scale_ptr)
    out_offs = token[:, None] * stride_o_t + head[:, None] * stride_o_h + dims[None, :]
    tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def paged_attention_supported(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Inputs this kernel handles; everything else goes to the torch reference."""
    return (
        q.dtype in _FLOAT_DTYPES
        and k_cache.dtype == v_cache.dtype
        and (k_cache.dtype == q.dtype or (k_cache.dtype in FP8_DTYPES and fp8_cache_supported(k_cache)))
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and q.shape[-1] <= MAX_HEAD_DIM
        and k_cache.shape[2] > 0
        and q.shape[1] % k_cache.shape[2] == 0
    )


def _check_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata) -> None:
    assert q.dim() == 3, f"q must be [T, H, D], got {tuple(q.shape)}"
    assert k_cache.dim() == 4, "k_cache must be [num_blocks, block_size, KH, D]"
    assert k_cache.shape == v_cache.shape, f"{tuple(k_cache.shape)} != {tuple(v_cache.shape)}"
    num_tokens, num_heads, head_dim = q.shape
    _, _, num_kv_heads, cache_head_dim = k_cache.shape
    assert cache_head_dim == head_dim, f"head_dim {head_dim} != cache {cache_head_dim}"
    assert num_heads % num_kv_heads == 0, f"H={num_heads} not a multiple of KH={num_kv_heads}"
    assert head_dim <= MAX_HEAD_DIM, f"head_dim {head_dim} > {MAX_HEAD_DIM}"
    assert q.dtype in _FLOAT_DTYPES, f"unsupported dtype {q.dtype}"
    assert k_cache.dtype == v_cache.dtype and k_cache.dtype in (q.dtype, *FP8_DTYPES), (
        f"dtypes {q.dtype}/{k_cache.dtype}/{v_cache.dtype}"
    )
    assert q.stride(2) == 1, "q: head_dim must be contiguous"
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "caches must be contiguous"
    num_seqs = meta.num_seqs
    assert meta.query_start_loc.shape == (num_seqs + 1,) and meta.query_start_loc.dtype == torch.int32
    assert meta.seq_lens.shape == (num_seqs,) and meta.seq_lens.dtype == torch.int32
    assert meta.block_tables.dim() == 2 and meta.block_tables.shape[0] == num_seqs
    assert meta.block_tables.dtype == torch.int32 and meta.block_tables.stride(1) == 1
    assert meta.query_start_loc.is_contiguous() and meta.seq_lens.is_contiguous()
    assert meta.num_tokens == num_tokens, f"meta has {meta.num_tokens} tokens, q has {num_tokens}"
    for t in (k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables):
        assert t.device == q.device, f"tensor on {t.device}, q on {q.device}"


def _interpreting() -> bool:
    """True when Triton was imported with TRITON_INTERPRET=1 (kernels run in numpy)."""
    return isinstance(_paged_attention_kernel, InterpretedFunction)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [T, H, D] over caches [num_blocks, block_size, KH, D] -> out [T, H, D] (contiguous).

    fp8 caches: k_scale / v_scale are float32 one-element tensors on q's device (None: 1.0).
    """
    _check_inputs(q, k_cache, v_cache, meta)
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0 or meta.max_query_len == 0:
        return out
    group = num_heads // num_kv_heads
    g_pad = triton.next_power_of_2(group)
    block_m = max(16, g_pad, min(64, triton.next_power_of_2(meta.max_query_len) * g_pad))
    block_q = block_m // g_pad
    block_d = max(16, triton.next_power_of_2(head_dim))
    # fp32 tiles at head_dim 128 would need ~115 KB of shared memory with 64 keys.
    block_n = 64 if block_d * q.element_size() <= 256 else 32
    # WHY: the interpreter's tl.dot mis-handles bfloat16 (stored as uint16 in
    # numpy); upcasting the operands keeps the CPU tests meaningful. On GPU
    # bf16/fp16 tiles go to the tensor cores, and fp32 uses exact ("ieee")
    # products to match the reference instead of TF32.
    dot_fp32 = _interpreting() and q.dtype == torch.bfloat16
    precision = "ieee" if q.dtype == torch.float32 or dot_fp32 else "tf32"
    grid = (num_tokens // block_q + meta.num_seqs, num_kv_heads)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, scale_or_one(k_scale, k_cache), scale_or_one(v_scale, v_cache), out,
        meta.query_start_loc, meta.seq_lens, meta.block_tables,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        meta.block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        scale * _LOG2_E, group, head_dim, meta.num_seqs,
        BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_Q=block_q, G_PAD=g_pad,
        BLOCK_N=block_n, BLOCK_D=block_d, DOT_FP32=dot_fp32, INPUT_PRECISION=precision,
        num_warps=4, num_stages=2,
    )  # fmt: skip
    return out

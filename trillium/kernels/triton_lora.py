"""Triton kernels for the batched LoRA ops: SGMV shrink and expand over slot segments.

Semantics are those of `lora_reference.py`. The idea (punica's SGMV):

    grid = (num_tokens // BLOCK_M + num_segments, column blocks)

    Segment s owns the row tiles from seg_starts[s] // BLOCK_M + s on
    (always enough for its length; trailing ones exit at once), found by a
    binary search, as in `triton_attention`. A long prefill next to many
    one-token decodes launches no flood of empty programs, and the grid
    needs no device-to-host read of the segment lengths.

    one program = BLOCK_M tokens of one segment x one block of columns:
        shrink: y[rows, ranks]  = x[rows, :] @ A[slot, ranks, :].T   (loop over in-features)
        expand: out[rows, cols] += y[rows, :] @ B[slot, cols, :].T   (loop over ranks)

Segments of slot -1 (base model) exit before touching memory: their y rows
stay zero (y is allocated zeroed) and their out rows stay unchanged.
Products accumulate in float32; float32 inputs use exact ("ieee") dots to
match the reference rather than TF32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from trillium.kernels.lora_reference import check_expand_shapes, check_segments

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _find_segment(seg_start_ptr, tile_global, num_segs, BLOCK_M: tl.constexpr):
    """Last segment s with seg_starts[s] // BLOCK_M + s <= tile_global."""
    left: tl.int32 = 0
    right = num_segs
    while left < right:
        mid = (left + right) // 2
        first_tile = tl.load(seg_start_ptr + mid) // BLOCK_M + mid
        if first_tile <= tile_global:
            left = mid + 1
        else:
            right = mid
    return left - 1


@triton.jit
def _lora_shrink_kernel(
    x_ptr,
    a_ptr,
    y_ptr,
    seg_start_ptr,
    seg_len_ptr,
    seg_slot_ptr,
    stride_x_t,
    stride_a_slot,
    stride_a_rank,
    stride_y_t,
    rank,
    in_features,
    num_segs,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    tile_global = tl.program_id(0)
    seg = _find_segment(seg_start_ptr, tile_global, num_segs, BLOCK_M)
    if seg < 0:
        return  # a tile before the first segment (rows no segment covers)
    start = tl.load(seg_start_ptr + seg)
    tile = tile_global - (start // BLOCK_M + seg)
    seg_len = tl.load(seg_len_ptr + seg)
    slot = tl.load(seg_slot_ptr + seg)
    if (slot < 0) | (tile * BLOCK_M >= seg_len):
        return
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_valid = rows < seg_len
    token = (start + rows).to(tl.int64)
    ranks = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    rank_valid = ranks < rank
    a_base = a_ptr + slot.to(tl.int64) * stride_a_slot + ranks[None, :].to(tl.int64) * stride_a_rank
    acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_valid = ks < in_features
        x = tl.load(x_ptr + token[:, None] * stride_x_t + ks[None, :],
                    mask=row_valid[:, None] & k_valid[None, :], other=0.0)  # fmt: skip
        a = tl.load(a_base + ks[:, None], mask=k_valid[:, None] & rank_valid[None, :], other=0.0)
        acc += tl.dot(x, a, input_precision=INPUT_PRECISION)
    y_offs = token[:, None] * stride_y_t + ranks[None, :]
    tl.store(y_ptr + y_offs, acc, mask=row_valid[:, None] & rank_valid[None, :])


@triton.jit
def _lora_expand_kernel(
    y_ptr,
    b_ptr,
    out_ptr,
    seg_start_ptr,
    seg_len_ptr,
    seg_slot_ptr,
    stride_y_t,
    stride_b_slot,
    stride_b_out,
    stride_out_t,
    out_offset,
    out_features,
    rank,
    num_segs,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    tile_global = tl.program_id(0)
    seg = _find_segment(seg_start_ptr, tile_global, num_segs, BLOCK_M)
    if seg < 0:
        return  # a tile before the first segment (rows no segment covers)
    start = tl.load(seg_start_ptr + seg)
    tile = tile_global - (start // BLOCK_M + seg)
    seg_len = tl.load(seg_len_ptr + seg)
    slot = tl.load(seg_slot_ptr + seg)
    if (slot < 0) | (tile * BLOCK_M >= seg_len):
        return
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_valid = rows < seg_len
    token = (start + rows).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_valid = cols < out_features
    b_base = b_ptr + slot.to(tl.int64) * stride_b_slot + cols[None, :].to(tl.int64) * stride_b_out
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, rank, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_valid = ks < rank
        y = tl.load(y_ptr + token[:, None] * stride_y_t + ks[None, :],
                    mask=row_valid[:, None] & k_valid[None, :], other=0.0)  # fmt: skip
        b = tl.load(b_base + ks[:, None], mask=k_valid[:, None] & col_valid[None, :], other=0.0)
        # WHY: y is float32; half-precision B runs the dot in B's dtype (tensor
        # cores), as punica does, float32 B exactly.
        acc += tl.dot(y.to(b.dtype), b, input_precision=INPUT_PRECISION)
    mask = row_valid[:, None] & col_valid[None, :]
    out_offs = token[:, None] * stride_out_t + out_offset + cols[None, :]
    current = tl.load(out_ptr + out_offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + out_offs, (current + acc).to(out_ptr.dtype.element_ty), mask=mask)


def _block_m(num_tokens: int, num_segs: int) -> int:
    """Row tile from the mean segment length: 16 for decode-like batches, up to 64 for prefill."""
    mean_len = triton.cdiv(num_tokens, max(num_segs, 1))
    return max(16, min(64, triton.next_power_of_2(mean_len)))


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def lora_shrink_supported(x: torch.Tensor, a_stack: torch.Tensor) -> bool:
    """Inputs this kernel handles; everything else goes to the torch reference."""
    return (
        x.dtype in _FLOAT_DTYPES
        and a_stack.dtype == x.dtype
        and x.dim() == 2
        and x.stride(1) == 1
        and a_stack.dim() == 3
        and a_stack.stride(2) == 1
    )


def lora_expand_supported(y: torch.Tensor, b_stack: torch.Tensor, out: torch.Tensor) -> bool:
    return (
        y.dtype == torch.float32
        and b_stack.dtype in _FLOAT_DTYPES
        and out.dtype in _FLOAT_DTYPES
        and y.dim() == 2
        and y.stride(1) == 1
        and b_stack.dim() == 3
        and b_stack.stride(2) == 1
        and out.dim() == 2
        and out.stride(1) == 1
    )


def _check_devices(*tensors: torch.Tensor) -> None:
    device = tensors[0].device
    for t in tensors[1:]:
        assert t.device == device, f"tensor on {t.device}, expected {device}"


def lora_shrink(
    x: torch.Tensor,
    a_stack: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_lens: torch.Tensor,
    seg_slots: torch.Tensor,
) -> torch.Tensor:
    """x: [T, in] (rows may be strided), a_stack: [num_slots, R, in] -> y: [T, R] float32."""
    check_segments(seg_starts, seg_lens, seg_slots)
    assert lora_shrink_supported(x, a_stack), (
        f"unsupported shrink inputs: x {tuple(x.shape)} {x.dtype} stride {x.stride()}, "
        f"a_stack {tuple(a_stack.shape)} {a_stack.dtype} stride {a_stack.stride()}"
    )
    assert a_stack.shape[2] == x.shape[1], f"a_stack in-features {a_stack.shape[2]} != x {x.shape[1]}"
    _check_devices(x, a_stack, seg_starts, seg_lens, seg_slots)
    num_tokens, in_features = x.shape
    rank = a_stack.shape[1]
    num_segs = seg_starts.shape[0]
    y = torch.zeros((num_tokens, rank), dtype=torch.float32, device=x.device)
    if num_tokens == 0 or num_segs == 0 or rank == 0:
        return y
    block_m = _block_m(num_tokens, num_segs)
    block_r = max(16, min(64, triton.next_power_of_2(rank)))
    block_k = max(16, min(128, triton.next_power_of_2(in_features)))
    grid = (num_tokens // block_m + num_segs, triton.cdiv(rank, block_r))
    _lora_shrink_kernel[grid](
        x, a_stack, y, seg_starts, seg_lens, seg_slots,
        x.stride(0), a_stack.stride(0), a_stack.stride(1), y.stride(0),
        rank, in_features, num_segs,
        BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k, INPUT_PRECISION=_precision(x.dtype),
        num_warps=4, num_stages=2,
    )  # fmt: skip
    return y


def lora_expand(
    y: torch.Tensor,
    b_stack: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_lens: torch.Tensor,
    seg_slots: torch.Tensor,
    out: torch.Tensor,
    out_offset: int,
) -> None:
    """out[:, out_offset : out_offset + out_features] += y @ b_stack[slot].T per segment (in place)."""
    check_segments(seg_starts, seg_lens, seg_slots)
    assert lora_expand_supported(y, b_stack, out), (
        f"unsupported expand inputs: y {tuple(y.shape)} {y.dtype} stride {y.stride()}, "
        f"b_stack {tuple(b_stack.shape)} {b_stack.dtype}, out {tuple(out.shape)} {out.dtype} stride {out.stride()}"
    )
    check_expand_shapes(y, b_stack, out, out_offset)
    _, out_features, rank = b_stack.shape
    _check_devices(y, b_stack, out, seg_starts, seg_lens, seg_slots)
    num_tokens = y.shape[0]
    num_segs = seg_starts.shape[0]
    if num_tokens == 0 or num_segs == 0 or rank == 0 or out_features == 0:
        return
    block_m = _block_m(num_tokens, num_segs)
    block_n = max(16, min(64, triton.next_power_of_2(out_features)))
    block_k = max(16, min(64, triton.next_power_of_2(rank)))
    grid = (num_tokens // block_m + num_segs, triton.cdiv(out_features, block_n))
    _lora_expand_kernel[grid](
        y, b_stack, out, seg_starts, seg_lens, seg_slots,
        y.stride(0), b_stack.stride(0), b_stack.stride(1), out.stride(0),
        out_offset, out_features, rank, num_segs,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, INPUT_PRECISION=_precision(b_stack.dtype),
        num_warps=4, num_stages=2,
    )  # fmt: skip

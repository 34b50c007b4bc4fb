"""Torch reference for the batched LoRA ops (CPU path, test oracle).

Punica-style SGMV over *segments*: runs of consecutive tokens of the flat
varlen batch that use the same adapter slot.

    tokens:  [ seg0: slot 1 | seg1: slot -1 (base) | seg2: slot 0 | ... ]
    seg_starts[s], seg_lens[s]: the rows of segment s (int32, [S])
    seg_slots[s]:               its slot in the stacked weights, -1 = none

    lora_shrink(x [T, in], a_stack [num_slots, R, in], seg_*) -> y [T, R] float32
        y[rows of s] = x[rows] @ a_stack[slot].T     (rows of slot -1: zero)
    lora_expand(y [T, R], b_stack [num_slots, out, R], seg_*, out [T, N], out_offset)
        out[rows of s, out_offset:out_offset+out] += y[rows] @ b_stack[slot].T

INVARIANT (segments): seg_starts is non-decreasing, segments do not overlap
and lie in [0, T); rows outside every segment are left alone like slot -1.
The Triton kernels rely on the ordering (their grid is T // BLOCK_M + S).

Products accumulate in float32; y is float32 and `out` is updated with one
rounding to its dtype. LoRA scaling is expected folded into b_stack, and
ranks below R zero-padded in both stacks (padding adds exact zeros).
"""

from __future__ import annotations

import threading

import torch


def check_segments(seg_starts: torch.Tensor, seg_lens: torch.Tensor, seg_slots: torch.Tensor) -> None:
    """Shape and dtype checks shared by the reference and the Triton launchers."""
    num_segs = seg_starts.shape[0]
    for name, t in (("seg_starts", seg_starts), ("seg_lens", seg_lens), ("seg_slots", seg_slots)):
        assert t.shape == (num_segs,), f"{name}: shape {tuple(t.shape)}, expected ({num_segs},)"
        assert t.dtype in (torch.int32, torch.int64), f"{name}: dtype {t.dtype}"


def check_expand_shapes(y: torch.Tensor, b_stack: torch.Tensor, out: torch.Tensor, out_offset: int) -> None:
    """Expand's shape checks, shared by the reference and the Triton launcher."""
    _, out_features, rank = b_stack.shape
    assert y.shape[1] == rank, f"y rank {y.shape[1]} != b_stack rank {rank}"
    assert out.shape[0] == y.shape[0], f"out has {out.shape[0]} rows, y {y.shape[0]}"
    assert 0 <= out_offset and out_offset + out_features <= out.shape[1], (
        f"columns [{out_offset}, {out_offset + out_features}) outside out width {out.shape[1]}"
    )


def _segments(starts: list[int], lens: list[int], slots: list[int], num_tokens: int) -> list[tuple[int, int, int]]:
    """(start, len, slot) of each non-empty adapter segment, checked against T."""
    segments = []
    end_prev = 0
    for start, length, slot in zip(starts, lens, slots):
        assert length >= 0 and start >= end_prev and start + length <= num_tokens, (
            f"segment ({start}, {length}) overlaps, is out of order or outside {num_tokens} tokens"
        )
        end_prev = start + length
        if length > 0 and slot >= 0:
            segments.append((start, length, slot))
    return segments


# Segments shorter than this are gathered per slot (see _row_groups).
_GATHER_BELOW_TOKENS = 16
# WHY a one-entry memo: one step's segments serve every LoRA call of every
# layer (up to 11 per layer); planning them once per step instead of per call
# saves ~3 ms of Python per decode step of the bench model at batch 32. Keyed
# on the segment values (three short host lists), per thread.
_plan_cache = threading.local()


def _row_groups(
    seg_starts: torch.Tensor, seg_lens: torch.Tensor, seg_slots: torch.Tensor, num_tokens: int, device: torch.device
) -> list[tuple[int, slice | torch.Tensor]]:
    """(slot, rows) jobs: a slice per long segment, one row-index tensor per slot for short ones.

    WHY: a decode batch whose requests alternate between adapters has one
    segment per token; a matmul per segment doubled a CPU decode step at
    batch 32 (bench model), one gathered matmul per slot costs little.
    """
    check_segments(seg_starts, seg_lens, seg_slots)
    key = (seg_starts.tolist(), seg_lens.tolist(), seg_slots.tolist(), num_tokens, device)
    last = getattr(_plan_cache, "last", None)
    if last is not None and last[0] == key:
        return last[1]
    jobs: list[tuple[int, slice | torch.Tensor]] = []
    short: dict[int, list[int]] = {}
    for start, length, slot in _segments(*key[:4]):
        if length >= _GATHER_BELOW_TOKENS:
            jobs.append((slot, slice(start, start + length)))
        else:
            short.setdefault(slot, []).extend(range(start, start + length))
    for slot, rows in short.items():
        if len(rows) == rows[-1] - rows[0] + 1:  # one run: a slice is cheaper than a gather
            jobs.append((slot, slice(rows[0], rows[-1] + 1)))
        else:
            jobs.append((slot, torch.tensor(rows, dtype=torch.int64, device=device)))
    _plan_cache.last = (key, jobs)
    return jobs


def lora_shrink(
    x: torch.Tensor,
    a_stack: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_lens: torch.Tensor,
    seg_slots: torch.Tensor,
) -> torch.Tensor:
    """x: [T, in], a_stack: [num_slots, R, in] -> y: [T, R] float32 (zero rows for slot -1)."""
    assert x.dim() == 2 and a_stack.dim() == 3, f"x {tuple(x.shape)}, a_stack {tuple(a_stack.shape)}"
    assert a_stack.shape[2] == x.shape[1], f"a_stack in-features {a_stack.shape[2]} != x {x.shape[1]}"
    num_slots, rank, _ = a_stack.shape
    y = torch.zeros((x.shape[0], rank), dtype=torch.float32, device=x.device)
    for slot, rows in _row_groups(seg_starts, seg_lens, seg_slots, x.shape[0], x.device):
        assert slot < num_slots, f"slot {slot} >= {num_slots}"
        a = a_stack[slot].float().t()
        if isinstance(rows, slice):
            torch.mm(x[rows].float(), a, out=y[rows])
        else:
            y.index_copy_(0, rows, x.index_select(0, rows).float() @ a)
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
    assert y.dim() == 2 and b_stack.dim() == 3 and out.dim() == 2
    check_expand_shapes(y, b_stack, out, out_offset)
    num_slots, out_features, _ = b_stack.shape
    columns = out[:, out_offset : out_offset + out_features]
    for slot, rows in _row_groups(seg_starts, seg_lens, seg_slots, y.shape[0], y.device):
        assert slot < num_slots, f"slot {slot} >= {num_slots}"
        b = b_stack[slot].float().t()
        if isinstance(rows, slice):
            dst = columns[rows]
            delta = y[rows].float() @ b
            if dst.dtype == torch.float32:
                dst.add_(delta)
            else:
                dst.copy_(dst.float() + delta)
        else:
            delta = y.index_select(0, rows).float() @ b
            if columns.dtype == torch.float32:
                columns.index_add_(0, rows, delta)
            else:
                columns.index_copy_(0, rows, (columns.index_select(0, rows).float() + delta).to(columns.dtype))

"""Random operands for the batched LoRA ops (shrink / expand over segments), and the segment layouts to try.

Shared by the LoRA kernel tests (reference vs a naive loop) and their Triton
interpreter cases (lora_interpret_cases.py, run in a child pytest).
"""

from __future__ import annotations

import attrs
import torch

@attrs.frozen
class LoraCase:
    x: torch.Tensor  # [T, in] (possibly a strided view)
    a_stack: torch.Tensor  # [num_slots, R, in]
    b_stack: torch.Tensor  # [num_slots, out, R]
    out: torch.Tensor  # [T, width] initial contents of the expand target
    out_offset: int
    seg_starts: torch.Tensor
    seg_lens: torch.Tensor
    seg_slots: torch.Tensor

    @property
    def segments(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.seg_starts, self.seg_lens, self.seg_slots


def make_case(
    seg_lens: list[int],
    seg_slots: list[int],
    *,
    rank: int,
    in_features: int,
    out_features: int,
    num_slots: int = 3,
    first_row: int = 0,
    dtype: torch.dtype = torch.float32,
    strided_x: bool = False,
    seed: int = 0,
) -> LoraCase:
    """Random operands for contiguous segments starting at `first_row` (rows before it uncovered)."""
    gen = torch.Generator().manual_seed(seed)
    num_tokens = first_row + sum(seg_lens)
    starts = [first_row]
    for n in seg_lens[:-1]:
        starts.append(starts[-1] + n)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    x = randn(num_tokens, in_features + 5)[:, 3 : 3 + in_features] if strided_x else randn(num_tokens, in_features)
    out_offset = 7
    ints = dict(dtype=torch.int32)
    return LoraCase(
        x=x,
        a_stack=randn(num_slots, rank, in_features) / in_features**0.5,
        b_stack=randn(num_slots, out_features, rank) / rank**0.5,
        out=randn(num_tokens, out_offset + out_features + 4),
        out_offset=out_offset,
        seg_starts=torch.tensor(starts, **ints),
        seg_lens=torch.tensor(seg_lens, **ints),
        seg_slots=torch.tensor(seg_slots, **ints),
    )


# Ragged prefill, decode-like one-token segments, empty and base (-1)
# segments, a batch all base, uncovered leading rows.
SEGMENT_LAYOUTS = {
    "ragged": ([5, 17, 1, 9], [0, 2, 1, 0]),
    "decode": ([1] * 9, [0, 1, -1, 2, 0, 0, -1, 1, 2]),
    "empty_and_base": ([4, 0, 6, 0, 3, 11], [1, 0, -1, 2, 2, -1]),
    "all_base": ([3, 8], [-1, -1]),
    "long": ([70, 2], [2, 0]),
}

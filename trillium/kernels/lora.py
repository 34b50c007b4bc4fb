"""Batched LoRA ops, dispatched like `dispatch.py`: Triton on CUDA, the torch reference elsewhere.

    lora_shrink(x [T, in], a_stack [num_slots, R, in], seg_starts, seg_lens, seg_slots) -> y [T, R] float32
    lora_expand(y [T, R], b_stack [num_slots, out, R], seg_starts, seg_lens, seg_slots,
                out [T, N], out_offset) -> None   (adds into out[:, out_offset : out_offset + out])

Segments, slots and the rounding rules are defined in `lora_reference.py`.
A call goes to `triton_lora` when its input is on CUDA, Triton imports and
TRILLIUM_KERNELS is not "reference"; layouts the kernels do not take
(e.g. a non-contiguous last dim) fall back to the reference. Importing this
module never imports Triton.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

from trillium.kernels import lora_reference
from trillium.kernels.dispatch import wants_triton


def _triton() -> ModuleType:
    return importlib.import_module("trillium.kernels.triton_lora")


def lora_shrink(
    x: torch.Tensor,
    a_stack: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_lens: torch.Tensor,
    seg_slots: torch.Tensor,
) -> torch.Tensor:
    if wants_triton(x):
        kernels = _triton()
        if kernels.lora_shrink_supported(x, a_stack):
            return kernels.lora_shrink(x, a_stack, seg_starts, seg_lens, seg_slots)
    return lora_reference.lora_shrink(x, a_stack, seg_starts, seg_lens, seg_slots)


def lora_expand(
    y: torch.Tensor,
    b_stack: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_lens: torch.Tensor,
    seg_slots: torch.Tensor,
    out: torch.Tensor,
    out_offset: int,
) -> None:
    if wants_triton(y):
        kernels = _triton()
        if kernels.lora_expand_supported(y, b_stack, out):
            kernels.lora_expand(y, b_stack, seg_starts, seg_lens, seg_slots, out, out_offset)
            return
    lora_reference.lora_expand(y, b_stack, seg_starts, seg_lens, seg_slots, out, out_offset)

"""LoRABatch: which adapter slot each token of one forward step uses.

    LoRABatch.build(slots, num_tokens_per_request, slot_per_request) -> LoRABatch
    batch.layer(i).apply(projection, x, out)    called by the model after each fused projection

Built once per step by the executor, next to `AttentionMetadata`, and
shared by every layer. Requests are contiguous in the flat batch; adjacent
requests with the same slot merge into one segment (slot -1 = base model):

    requests:  [ r0: 5 tok, slot 1 | r1: 1 tok, slot 1 | r2: 3 tok, -1 | r3: 2 tok, slot 0 ]
    segments:  seg_starts [0, 6, 9]   seg_lens [6, 3, 2]   seg_slots [1, -1, 0]

`apply` runs one shrink over the projection's stacked A and one expand per
output slice that some slot of this batch adapts; projections no slot in
the batch adapts cost nothing, so an all-base batch does no LoRA work.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs
import torch

from trillium.kernels.lora import lora_expand, lora_shrink
from trillium.lora.slots import PROJECTIONS, LoRASlots, ProjectionBuffers


@attrs.frozen(eq=False)
class LoRABatch:
    slots: LoRASlots
    seg_starts: torch.Tensor  # [S] int32, on the slots' device
    seg_lens: torch.Tensor  # [S] int32
    seg_slots: torch.Tensor  # [S] int32, -1 = base model
    num_tokens: int
    # projection -> indices of its output slices that some slot in this batch
    # adapts; projections with none are absent.
    active_slices: Mapping[str, tuple[int, ...]]

    @staticmethod
    def build(
        slots: LoRASlots, num_tokens_per_request: Sequence[int], slot_per_request: Sequence[int]
    ) -> LoRABatch:
        """Segments for requests laid out back to back (the engine's flat varlen order).

        Raises ValueError for mismatched lengths, negative counts or a slot
        outside [-1, max_loras).
        """
        if len(num_tokens_per_request) != len(slot_per_request):
            raise ValueError(f"{len(num_tokens_per_request)} token counts but {len(slot_per_request)} slots")
        starts: list[int] = []
        lens: list[int] = []
        seg_slots: list[int] = []
        used: set[int] = set()
        position = 0
        for num_tokens, slot in zip(num_tokens_per_request, slot_per_request):
            num_tokens, slot = int(num_tokens), int(slot)
            if num_tokens < 0:
                raise ValueError(f"negative token count {num_tokens}")
            if not -1 <= slot < slots.max_loras:
                raise ValueError(f"LoRA slot {slot} out of range [-1, {slots.max_loras})")
            if num_tokens == 0:
                continue
            if seg_slots and seg_slots[-1] == slot:
                lens[-1] += num_tokens
            else:
                starts.append(position)
                lens.append(num_tokens)
                seg_slots.append(slot)
            position += num_tokens
            if slot >= 0:
                used.add(slot)
        modules = frozenset().union(*(slots.targets(s) for s in used))
        active = {
            name: tuple(i for i, m in enumerate(members) if m in modules) for name, members in PROJECTIONS.items()
        }

        # One host-to-device copy for the three rows (each a contiguous view).
        packed = torch.tensor([starts, lens, seg_slots], dtype=torch.int32).reshape(3, -1).to(slots.device)
        return LoRABatch(
            slots=slots,
            seg_starts=packed[0],
            seg_lens=packed[1],
            seg_slots=packed[2],
            num_tokens=position,
            active_slices={name: idx for name, idx in active.items() if idx},
        )

    @property
    def has_work(self) -> bool:
        """False when no request of the batch uses an adapter that adapts anything."""
        return bool(self.active_slices)

    def layer(self, index: int) -> LayerLoRA:
        return LayerLoRA(self, self.slots.layers[index])


@attrs.frozen(eq=False)
class LayerLoRA:
    """The batch's view of one layer's slot buffers."""

    batch: LoRABatch
    buffers: Mapping[str, ProjectionBuffers]

    def apply(self, projection: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """out += the LoRA delta of `projection` for input x (in place; out [T, sum of slice widths])."""
        slices = self.batch.active_slices.get(projection)
        if not slices:
            return
        batch, buf = self.batch, self.buffers[projection]
        segments = (batch.seg_starts, batch.seg_lens, batch.seg_slots)
        y = lora_shrink(x, buf.a, *segments)
        rank = batch.slots.max_rank
        for i in slices:
            lora_expand(y[:, i * rank : (i + 1) * rank], buf.b[i], *segments, out, buf.out_offsets[i])

"""A fixed schedule of mixed-adapter paged steps, and the driver that runs a model through it with LoRA.

`run_phase(model, slots, slot_of_seq, sequences)` feeds `SCHEDULE` through
`support.paged_runner.run_schedule`, adding each step's `LoRABatch` (one slot
per sequence, -1 for the base model), and returns every sequence's logits.
Used by the multi-LoRA model tests and the Triton LoRA interpreter cases.
"""

from __future__ import annotations

from support.paged_runner import run_schedule
from trillium.lora import LoRABatch, LoRASlots

# Four requests; 1 and 2 are adjacent in the first step (same slot in phase 1:
# one merged segment). Step 2 is chunked prefill with context next to
# decodes, step 3 decodes in another order.
LENGTHS = (7, 10, 6, 9)
SCHEDULE = (
    ((0, 5), (1, 6), (2, 4), (3, 7)),
    ((0, 1), (1, 3), (2, 1), (3, 1)),
    ((3, 1), (0, 1), (2, 1), (1, 1)),
)


class LoraDriver:
    """Looks like the model to `run_schedule`, adding each step's LoRABatch (per-sequence slots)."""

    def __init__(self, model, slots: LoRASlots, slot_of_seq: list[int], schedule) -> None:
        self.model, self.slots, self.slot_of_seq = model, slots, slot_of_seq
        self.steps = iter(schedule)

    def __call__(self, input_ids, positions, kv_caches, meta):
        step = next(self.steps)
        batch = LoRABatch.build(self.slots, [n for _, n in step], [self.slot_of_seq[s] for s, _ in step])
        assert batch.num_tokens == input_ids.shape[0]
        return self.model(input_ids, positions, kv_caches, meta, lora=batch)

    def __getattr__(self, name):
        return getattr(self.model, name)


def run_phase(model, slots, slot_of_seq, sequences):
    return run_schedule(LoraDriver(model, slots, slot_of_seq, SCHEDULE), sequences, schedule=SCHEDULE)

"""Multi-LoRA runtime: PEFT adapters, device slots, and per-step batches.

    adapter.py  load_adapter(path, model_config, max_rank) -> LoRAAdapter  (AdapterError on any problem)
    slots.py    LoRASlots(model_config, max_loras, max_rank, dtype, device): load(slot, adapter), clear(slot)
    batch.py    LoRABatch.build(slots, num_tokens_per_request, slot_per_request) -> LoRABatch
    kernels     trillium.kernels.lora: lora_shrink / lora_expand (torch reference, Triton on CUDA)

How the pieces fit (one forward step serves the base model and several
adapters together, as punica / vLLM / SGLang do):

- An adapter is read once, on the CPU (`load_adapter`): per layer and HF
  module (q/k/v/o_proj, gate/up/down_proj) a raw A [r, in] and B [out, r],
  plus scaling (alpha / r, or alpha / sqrt(r) under rsLoRA).
- `LoRASlots` holds `max_loras` adapters on the device in stacked buffers
  allocated once, per layer and per *fused projection* of our model:
  `qkv_proj` (slices q, k, v), `o_proj`, `gate_up_proj` (gate, up),
  `down_proj`. Loading folds the scaling into B and zero-pads ranks up to
  `max_rank`; untargeted modules stay zero. Zeros are exact, so a slot
  needs no rank or module mask at run time.
- Each step the executor builds a `LoRABatch` from per-request slot ids
  (-1 = base) and token counts: adjacent requests of one slot merge into a
  *segment* of the flat varlen batch.
- After each fused projection the model calls
  `lora.layer(i).apply(projection, x, out)`: one shrink of x against the
  projection's stacked A (all slices at once: y [T, n_slices * R]), then per
  adapted slice one expand of its R columns of y into that slice's columns
  of `out` (q at 0, k at q_size, v at q_size + kv_size; gate at 0, up at
  intermediate). Segments of slot -1 are skipped by both kernels.
- `LlamaForCausalLM.forward(..., lora=None)` does no LoRA work at all;
  with a batch, projections no slot of the step adapts are skipped too.

Owned elsewhere: which adapter sits in which slot and the host cache of
read adapters (the executor's LoRA manager), the scheduler's limit of
`max_loras` distinct adapters per step, the HTTP load/unload endpoints.
NOTE: build a step's LoRABatch after loading its slots: `build` records
which projections the step's slots adapt.
"""

from trillium.lora.adapter import AdapterError, LoRAAdapter, LoRAWeights, load_adapter
from trillium.lora.batch import LayerLoRA, LoRABatch
from trillium.lora.request import LoRARequest
from trillium.lora.slots import PROJECTIONS, LoRASlots

__all__ = [
    "PROJECTIONS",
    "AdapterError",
    "LayerLoRA",
    "LoRAAdapter",
    "LoRABatch",
    "LoRARequest",
    "LoRASlots",
    "LoRAWeights",
    "load_adapter",
]

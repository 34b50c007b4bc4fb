"""A LoRA adapter's shard for one tensor-parallel rank (pure torch, no collectives).

    shard_adapter(adapter, tp_shard) -> LoRAAdapter   this rank's A and B, views of the full ones

The delta of a module is x @ A.T @ B.T with A [r, in] and B [out, r], so W's
rows are B's rows and W's columns are A's columns. Each pair is cut where the
base weight is cut (`models/tensor_parallel.py`), as vLLM's LoRA layers do
(vllm-project/vllm, vllm/lora/layers/column_parallel_linear.py: slice_lora_b
by rank, A whole, KV by `tp_rank // num_kv_head_replicas`;
row_parallel_linear.py: slice_lora_a on the input dim, B whole):

    q/k/v_proj, gate/up_proj   column-parallel: B's rows of this rank's heads / MLP slice, A whole
    o_proj, down_proj          row-parallel: A's columns of this rank's heads / MLP slice, B whole;
                               the partial deltas join the layer's all-reduce (llama.project_with_lora)

The rank r stays whole on every rank (vLLM's default, not its
`fully_sharded_loras`), so the shrink needs no collective.
"""

from __future__ import annotations

import attrs

from trillium.lora.adapter import LoRAAdapter, LoRAWeights


def _weight_name(layer: int, module: str) -> str:
    parent = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
    return f"model.layers.{layer}.{parent}.{module}.weight"


def shard_adapter(adapter: LoRAAdapter, tp_shard) -> LoRAAdapter:
    """`adapter` as rank `tp_shard.rank` of `tp_shard.size` holds it (the same object on one rank)."""
    if tp_shard.size == 1:
        return adapter
    weights = {}
    for (layer, module), w in adapter.weights.items():
        name = _weight_name(layer, module)
        dim = tp_shard.split_dim(name)
        if dim == 0:  # the weight's rows: B's rows
            w = LoRAWeights(a=w.a, b=tp_shard.shard(name, w.b).contiguous())
        elif dim == 1:  # the weight's columns: A's columns
            w = LoRAWeights(a=tp_shard.shard(name, w.a).contiguous(), b=w.b)
        weights[(layer, module)] = w
    return attrs.evolve(adapter, weights=weights)

"""Megatron sharding of the dense Llama family: N ranks' shards compute the unsharded model.

Each rank is a thread (support/tp_threads.py) holding the real sharded model
that `load_model(..., tp=group)` builds, reading only its slices of the
safetensors file; the collectives are exchanged in memory. Compared: every
position's logits of a paged schedule (prefill, chunked prefill, decode)
against the same checkpoint unsharded. The layout follows vLLM's
(vllm-project/vllm, vllm/model_executor/layers/linear.py: QKVParallelLinear
replicates KV heads when tp_size > num_kv_heads; RowParallelLinear adds its
bias on rank 0 only; vocab_parallel_embedding.py masks ids outside a rank's
rows and all-reduces).
"""

from __future__ import annotations

import pytest
import torch

from support.paged_runner import random_sequences, run_schedule
from support.tp_threads import run_ranks
from trillium.models.loader import load_model


def _sharded_logits(path, size, sequences):
    def work(group):
        model, _ = load_model(path, dtype="float32", progress=False, tp=group)
        return run_schedule(model, sequences, num_blocks=32)

    return run_ranks(size, work)[0]


@pytest.mark.parametrize("variant, size, overrides", [
    ("llama", 2, {}),                      # GQA 4/2: one KV head per rank
    ("llama", 4, {}),                      # GQA 4/2 on 4 ranks: each KV head replicated twice
    ("mistral", 2, {}),                    # one KV head, replicated
    ("llama-tied", 2, {"vocab_size": 509}),  # tied embedding; the last rank's vocab rows padded
    ("qwen2", 2, {}),                      # q/k/v bias
    ("qwen3", 2, {"attention_bias": True}),  # q/k norm, and an o_proj bias (added once)
])
def test_shards_compute_the_whole_model(checkpoint, variant, size, overrides):
    path = checkpoint(variant, **overrides)
    whole, config = load_model(path, dtype="float32", progress=False)
    sequences = random_sequences(config.vocab_size)
    expected = run_schedule(whole, sequences, num_blocks=32)
    got = _sharded_logits(path, size, sequences)
    for ours, ref in zip(got, expected):
        assert ours.shape == ref.shape
        assert (ours - ref).abs().max().item() < 1e-4
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_full_tensors_are_sliced_like_the_loader_reads(checkpoint):
    """A live update hands load_weights full HF tensors: each rank keeps what it loaded from disk."""
    from safetensors.torch import load_file

    path = checkpoint("qwen2")
    full = load_file(str(next(path.glob("*.safetensors"))))

    def work(group):
        model, _ = load_model(path, dtype="float32", progress=False, tp=group)
        before = {n: p.clone() for n, p in model.named_parameters()}
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        model.load_weights(list(full.items()))
        return all(torch.equal(before[n], p) for n, p in model.named_parameters())

    assert run_ranks(2, work) == [True, True]


@pytest.mark.parametrize("kwargs, named", [
    ({"runner": "pooling"}, "--runner pooling"),
])
def test_features_not_sharded_are_refused_at_start(kwargs, named):
    from trillium.config import EngineConfig

    with pytest.raises(ValueError, match=f"--tensor-parallel-size 2: not supported together with {named}"):
        EngineConfig.build(model="m", tensor_parallel_size=2, **kwargs)


@pytest.mark.parametrize("variant, size, message", [
    ("qwen2-moe", 2, "Qwen2MoeForCausalLM is not sharded"),
    ("gemma2", 2, "Gemma2ForCausalLM is not sharded"),
    ("llama", 3, "4 attention heads do not split over 3 ranks"),
])
def test_models_that_do_not_split_are_refused_at_start(checkpoint, variant, size, message):
    from trillium.config import EngineConfig

    with pytest.raises(ValueError, match=message):
        EngineConfig(model=str(checkpoint(variant)), tensor_parallel_size=size, kv_cache_memory="1MiB").resolve()


def test_kv_budget_is_per_rank(checkpoint):
    """A rank holds half the KV heads: the same --kv-cache-memory holds twice the blocks."""
    from trillium.config import EngineConfig

    path = str(checkpoint("llama"))
    one, two = (EngineConfig(model=path, tensor_parallel_size=n, kv_cache_memory="1MiB").resolve() for n in (1, 2))
    assert two.num_blocks == 2 * one.num_blocks

"""fp8 KV under tensor parallelism: each rank quantizes its own KV heads, with its own scales.

Each rank is a thread (support/tp_threads.py) holding the real sharded
model; its KV cache holds only its KV heads (`local_config`) in fp8, and
every layer's k_scale / v_scale is calibrated on that rank from the keys and
values of its heads (models/kv_cache.py: the first write sets them), as one
rank calibrates from all of them. vLLM keeps its per-layer scales per rank
the same way (vllm-project/vllm, vllm/attention/layer.py: `_k_scale` /
`_v_scale` are attributes of each rank's Attention module, computed from
the local key / value when calculate_kv_scales). Compared: the logits of a
paged schedule (prefill, chunked prefill, decode) on 2 ranks against the
same fp8 schedule on one, and both against float32 KV within the fp8 path's
own tolerance (tests/kernels/test_fp8_kv_cache.py).
"""

from __future__ import annotations

import torch

from support.paged_runner import random_sequences, run_schedule
from support.tp_threads import run_ranks
from trillium.models.loader import load_model


def _run(model, sequences, kv_dtype):
    """Logits of the default schedule, and each layer's (k_scale, v_scale) after it."""
    caches = []
    allocate = model.allocate_kv_caches
    model.allocate_kv_caches = lambda *a: caches.extend(allocate(*a)) or caches
    try:
        logits = run_schedule(model, sequences, num_blocks=32, kv_dtype=kv_dtype)
    finally:
        del model.allocate_kv_caches  # the class's method again
    scales = [(float(c.k_scale), float(c.v_scale)) for c in caches] if caches[0].k_scale is not None else None
    return logits, scales, caches[0].k_cache.shape[2]


def test_sharded_fp8_kv_matches_one_rank(checkpoint, kv_dtype="fp8_e4m3"):  # --kv-cache-dtype fp8
    path = checkpoint("llama")  # GQA 4 heads / 2 KV heads: one KV head per rank
    whole, config = load_model(path, dtype="float32", progress=False)
    sequences = random_sequences(config.vocab_size)
    exact, _, _ = _run(whole, sequences, None)
    one, one_scales, one_heads = _run(whole, sequences, kv_dtype)

    def work(group):
        model, _ = load_model(path, dtype="float32", progress=False, tp=group)
        return _run(model, sequences, kv_dtype)

    (got, scales, heads), (_, scales1, _) = run_ranks(2, work)
    assert (one_heads, heads) == (2, 1)  # each rank's cache holds its own KV head only
    for s in (scales, scales1):  # every layer calibrated on its rank (the fp8 path's powers of two)
        assert all(k > 0 and v > 0 and torch.log2(torch.tensor([k, v])).frac().abs().max() == 0 for k, v in s)
    # A rank's amax is at most the whole's, so its scales are never above one rank's; on this
    # checkpoint rank 1's own heads calibrate smaller scales than the whole: they are its own.
    for rank_scales in (scales, scales1):
        assert all(k <= k1 and v <= v1 for (k, v), (k1, v1) in zip(rank_scales, one_scales))
    assert scales1 != one_scales
    for ours, ref, full in zip(got, one, exact):
        assert ours.shape == ref.shape
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))
        assert (ours - ref).abs().max().item() < 1e-4  # the same quantized KV, summed in another order
        # and fp8 still close to float32 KV (mean |delta logprob|, the fp8 path's own test's measure)
        delta = (ours.log_softmax(-1) - full.log_softmax(-1)).abs().mean().item()
        assert delta < 0.1, delta


def test_fp8_kv_starts_under_tp_with_its_budget_per_rank(checkpoint):
    """No longer refused: a rank's fp8 block is its KV heads at one byte an element."""
    from trillium.config import EngineConfig

    path = str(checkpoint("llama"))
    one, two = (EngineConfig(model=path, tensor_parallel_size=n, kv_cache_dtype="fp8",
                             kv_cache_memory="1MiB").resolve() for n in (1, 2))
    assert (one.kv_cache_dtype, two.kv_cache_dtype) == ("fp8_e4m3", "fp8_e4m3")
    assert two.num_blocks == 2 * one.num_blocks

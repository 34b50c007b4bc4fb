"""The paged model matches transformers on every synthetic variant (float32, 1e-4)."""

from __future__ import annotations

import pytest
import torch

from support.paged_runner import hf_logits, load_hf, max_abs_diff, random_sequences, run_schedule
from trillium.models import load_model
from trillium.models.synthetic import VARIANTS
from trillium.models.synthetic_variants import POOLING_VARIANTS

# Pooling variants have no LM head: tests/models/test_models_pooling.py compares them.
SMALL_VARIANTS = [v for v in VARIANTS if v != "bench" and v not in POOLING_VARIANTS]


@pytest.mark.parametrize("variant", SMALL_VARIANTS)
def test_paged_logits_match_transformers(checkpoint, variant):
    path = checkpoint(variant)
    model, config = load_model(path, progress=False)
    sequences = random_sequences(config.vocab_size, seed=1)
    ours = run_schedule(model, sequences)
    ref = hf_logits(load_hf(path), sequences)
    assert max_abs_diff(ours, ref) < 1e-4
    # Greedy picks agree everywhere (the synthetic logits are not near-ties).
    for a, b in zip(ours, ref):
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_bench_variant_matches_transformers(checkpoint):
    path = checkpoint("bench")
    model, config = load_model(path, progress=False)
    assert (config.hidden_size, config.num_layers, config.vocab_size) == (512, 8, 8192)
    num_params = sum(p.numel() for p in model.parameters())
    assert 30e6 < num_params < 35e6
    schedule = (((0, 5), (1, 3)), ((0, 1), (1, 1)), ((0, 1), (1, 1)))
    sequences = random_sequences(config.vocab_size, lengths=(7, 5), seed=2)
    ours = run_schedule(model, sequences, schedule=schedule, block_size=4, num_blocks=8)
    ref = hf_logits(load_hf(path), sequences)
    assert max_abs_diff(ours, ref) < 1e-4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_smoke(checkpoint, dtype):
    path = checkpoint("llama")
    model, config = load_model(path, dtype=dtype, progress=False)
    assert model.dtype == dtype and config.dtype == str(dtype).removeprefix("torch.")
    assert model.cos_sin_cache.dtype == torch.float32
    caches = model.allocate_kv_caches(4, 4)
    assert caches[0][0].dtype == dtype
    sequences = random_sequences(config.vocab_size, seed=3)
    ours = run_schedule(model, sequences)
    ref = hf_logits(load_hf(path), sequences)
    for a, b in zip(ours, ref):
        assert a.dtype == torch.float32 and torch.isfinite(a).all()
        assert (a - b).abs().mean() < 0.05
        assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.8

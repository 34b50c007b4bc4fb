"""Sliding-window masking and logit soft-capping in the reference paged attention.

Oracle: `support.paged_batches.dense_causal_attention` (float64, per head),
with transformers' semantics: masking_utils.py `sliding_window_overlay`
(key j visible from query p iff p - window < j <= p) and Gemma 2's
soft-capping (cap * tanh(scores / cap) before the mask and softmax).
"""

from __future__ import annotations

import pytest
import torch

from support.paged_batches import dense_causal_attention, make_paged_batch
from trillium import kernels
from trillium.kernels import reference

# Decodes of mixed lengths, a fresh prefill and a chunk with context, in one batch.
QUERY_LENS = [1, 1, 1, 12, 5]
SEQ_LENS = [3, 20, 37, 12, 30]


@pytest.mark.parametrize("window", [1, 4, 9, 16, 100])
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_window_and_softcap_match_dense_attention(window, softcap):
    batch = make_paged_batch(QUERY_LENS, SEQ_LENS, num_heads=4, num_kv_heads=2, head_dim=16, block_size=4, seed=3)
    out = reference.paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, batch.scale,
                                    sliding_window=window, softcap=softcap)  # fmt: skip
    expected = dense_causal_attention(batch, sliding_window=window, softcap=softcap)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=1e-5)


def test_full_and_windowed_layers_share_a_step():
    """Gemma alternates: the plan cached in the metadata must not leak from one kind of layer to the other."""
    batch = make_paged_batch(QUERY_LENS, SEQ_LENS, num_heads=4, num_kv_heads=4, head_dim=8, block_size=4, seed=5)
    args = (batch.q, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    for window in (None, 6, None, 6):
        out = kernels.paged_attention(*args, sliding_window=window)
        torch.testing.assert_close(out.double(), dense_causal_attention(batch, sliding_window=window),
                                   atol=2e-5, rtol=1e-5)  # fmt: skip
    windowed = kernels.paged_attention(*args, sliding_window=6)
    assert not torch.allclose(windowed, kernels.paged_attention(*args))


@pytest.mark.parametrize("window", [4, 9, 16])
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_window_never_gathers_blocks_behind_it(window, softcap):
    """The scheduler frees the blocks behind a sliding window (kv_tiers/block_pool.py, as vLLM's
    SlidingWindowManager, vllm-project/vllm vllm/v1/core/single_type_kv_cache_manager.py
    `remove_skipped_blocks`): NaN in them, or in the NULL_BLOCK a table may point to, changes nothing."""
    batch = make_paged_batch(QUERY_LENS, SEQ_LENS, num_heads=4, num_kv_heads=2, head_dim=16, block_size=4, seed=3)
    table = batch.meta.block_tables
    for b, (qlen, slen) in enumerate(zip(QUERY_LENS, SEQ_LENS)):
        first_visible = max(0, slen - qlen - window + 1)  # the first query's first key
        for i in range(first_visible // 4):
            batch.k_cache[table[b, i]] = float("nan")
            batch.v_cache[table[b, i]] = float("nan")
            table[b, i] = 0  # NULL_BLOCK, poisoned too
    batch.k_cache[0] = float("nan")
    batch.v_cache[0] = float("nan")
    assert torch.isnan(batch.k_cache).any()
    out = reference.paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, batch.scale,
                                    sliding_window=window, softcap=softcap)  # fmt: skip
    expected = dense_causal_attention(batch, sliding_window=window, softcap=softcap)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=1e-5)

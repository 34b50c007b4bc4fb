"""The opaque attention op of compiled decode (models/graph_attention.py), run eagerly (no compile).

Padded rows (a batch of 3 in a graph of 4) are neither written to the cache
nor attended: rows 0..2 equal `KvCache.attend` on the same inputs, row 3 is
zeros, and no other cache slot changes. Warm-up (no metadata) touches no
cache and leaves an fp8 cache uncalibrated (its first real write sets the
scales, kv_cache.py).
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from trillium.kernels import AttentionMetadata
from trillium.models.graph_attention import GraphAttentionContext, graph_kv_slots
from trillium.models.kv_cache import allocate_kv_caches


def _config() -> SimpleNamespace:
    return SimpleNamespace(num_layers=1, num_kv_heads=2, head_dim=16)  # what allocate_kv_caches reads


@pytest.mark.parametrize("kv_dtype", ["float32", "fp8_e4m3"])
def test_padded_rows_are_skipped_and_warm_up_touches_nothing(kv_dtype):
    generator = torch.Generator().manual_seed(0)
    caches = allocate_kv_caches(_config(), 8, 4, kv_dtype, "cpu")
    ctx = GraphAttentionContext(kv_caches=caches)
    slot = graph_kv_slots(ctx, 1)[0]
    q = torch.randn(4, 4, 16, generator=generator)
    k, v = torch.randn(4, 2, 16, generator=generator), torch.randn(4, 2, 16, generator=generator)

    warm = slot.attend(q, k, v, None, 0.25, sliding_window=None, softcap=None)  # ctx.meta is None
    assert torch.equal(warm, torch.zeros_like(q))
    assert caches[0].calibrated == (kv_dtype == "float32")
    assert not caches[0].k_cache.view(torch.uint8).any()

    # 3 sequences decoding one token each at positions 2, 4, 1 (blocks 0, 1, 2); row 3 is padding.
    meta = AttentionMetadata.build([1, 1, 1], [3, 5, 2], [[0], [1, 2], [3]], 4)
    expected_cache = copy.deepcopy(caches[0])
    expected = expected_cache.attend(q[:3], k[:3], v[:3], meta, 0.25)
    ctx.meta = meta
    out = slot.attend(q, k, v, None, 0.25, sliding_window=None, softcap=None)
    assert torch.equal(out[:3], expected)
    assert torch.equal(out[3], torch.zeros_like(out[3]))
    for got, want in ((caches[0].k_cache, expected_cache.k_cache), (caches[0].v_cache, expected_cache.v_cache)):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert caches[0].calibrated

"""The torch reference kernels against plain math (the oracle of the Triton tests).

paged_attention is checked against per-sequence dense causal attention over
unpaged K/V, with shuffled block tables and ragged lengths, for prefill,
prefill over a cached prefix, chunked prefill, decode (one chunk and split
into several gather chunks) and mixed batches.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from support.paged_batches import dense_causal_attention, make_paged_batch, rope_cache
from trillium.kernels import reference
from trillium.kernels.metadata import AttentionMetadata

TOLERANCE = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=3e-3, rtol=3e-3),
    torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 64), (2, 3, 96)])
def test_rms_norm_matches_formula(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=gen).to(dtype)
    w = torch.randn(shape[-1], generator=gen).to(dtype)
    xd = x.double()
    expected = xd / torch.sqrt((xd * xd).mean(-1, keepdim=True) + 1e-6) * w.double()
    y = reference.rms_norm(x, w, 1e-6)
    assert y.dtype == dtype and y.shape == x.shape
    torch.testing.assert_close(y.double(), expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_silu_and_mul_matches_formula(dtype: torch.dtype) -> None:
    x = torch.randn((4, 2 * 24), generator=torch.Generator().manual_seed(2)).to(dtype)
    gate, up = x.double()[:, :24], x.double()[:, 24:]
    y = reference.silu_and_mul(x)
    assert y.shape == (4, 24) and y.dtype == dtype
    torch.testing.assert_close(y.double(), gate * torch.sigmoid(gate) * up, **TOLERANCE[dtype])


@pytest.mark.parametrize("head_dim", [8, 64])
def test_rotary_is_complex_rotation_of_half_pairs(head_dim: int) -> None:
    """Neox: pair (x[i], x[i + D/2]) is the complex number rotated by pos * freq_i."""
    gen = torch.Generator().manual_seed(3)
    num_tokens, half = 5, head_dim // 2
    positions = torch.tensor([0, 1, 7, 31, 2])
    q = torch.randn((num_tokens, 4, head_dim), generator=gen)
    k = torch.randn((num_tokens, 2, head_dim), generator=gen)
    cache = rope_cache(32, head_dim)
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    rot = torch.polar(torch.ones(num_tokens, half, dtype=torch.float64), positions[:, None] * inv_freq)

    def naive(x: torch.Tensor) -> torch.Tensor:
        z = torch.complex(x[..., :half].double(), x[..., half:].double()) * rot[:, None, :]
        return torch.cat((z.real, z.imag), dim=-1)

    q_out, k_out = reference.rotary_embedding(positions, q, k, cache)
    torch.testing.assert_close(q_out.double(), naive(q), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_out.double(), naive(k), atol=1e-5, rtol=1e-5)


def test_write_kv_cache_puts_each_token_at_its_slot() -> None:
    gen = torch.Generator().manual_seed(4)
    k = torch.randn((6, 2, 8), generator=gen)
    v = torch.randn((6, 2, 8), generator=gen)
    k_cache = torch.zeros((5, 16, 2, 8), dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([17, 3, 79, 40, 0, 41])
    reference.write_kv_cache(k, v, k_cache, v_cache, slots)
    for t, slot in enumerate(slots.tolist()):
        assert torch.equal(k_cache[slot // 16, slot % 16], k[t].bfloat16())
        assert torch.equal(v_cache[slot // 16, slot % 16], v[t].bfloat16())
    assert int((k_cache != 0).any(-1).any(-1).sum()) == 6  # nothing else written


# (query_lens, seq_lens) per scenario; context = seq_len - query_len.
SCENARIOS = {
    "prefill": ([17, 5, 33], [17, 5, 33]),
    "prefill_with_context": ([9, 20, 2], [40, 55, 18]),
    "decode": ([1] * 7, [1, 16, 17, 33, 64, 100, 5]),
    "mixed_interleaved": ([1, 12, 1, 1, 7, 1], [30, 12, 1, 50, 20, 17]),
    "decodes_then_prefill": ([1, 1, 1, 24], [20, 49, 3, 40]),
    "decodes_between_prefills": ([3, 1, 1, 1, 4, 1, 1], [10, 40, 30, 50, 60, 20, 33]),
}


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (6, 2), (8, 2)])
def test_paged_attention_matches_dense(scenario: str, block_size: int, num_heads: int, num_kv_heads: int) -> None:
    qlens, slens = SCENARIOS[scenario]
    batch = make_paged_batch(
        qlens, slens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=64, block_size=block_size, seed=5
    )
    out = reference.paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    assert out.shape == batch.q.shape and out.dtype == batch.q.dtype and out.is_contiguous()
    torch.testing.assert_close(out.double(), dense_causal_attention(batch), **TOLERANCE[torch.float32])


@pytest.mark.parametrize("chunk_bytes", [1, 40_000, 100_000])
@pytest.mark.parametrize("scenario", ["decode", "mixed_interleaved", "decodes_between_prefills"])
def test_decode_split_into_gather_chunks(monkeypatch: pytest.MonkeyPatch, scenario: str, chunk_bytes: int) -> None:
    """Small gather budgets split decodes into several SDPA calls (one per sequence at 1 byte)."""
    monkeypatch.setattr(reference, "_GATHER_CHUNK_BYTES", chunk_bytes)
    qlens, slens = SCENARIOS[scenario]
    batch = make_paged_batch(qlens, slens, num_heads=6, num_kv_heads=2, head_dim=32, block_size=16, seed=6)
    out = reference.paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    torch.testing.assert_close(out.double(), dense_causal_attention(batch), **TOLERANCE[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_paged_attention_half_precision(dtype: torch.dtype) -> None:
    qlens, slens = SCENARIOS["mixed_interleaved"]
    batch = make_paged_batch(qlens, slens, num_heads=8, num_kv_heads=2, head_dim=64, block_size=16, dtype=dtype)
    out = reference.paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), dense_causal_attention(batch), **TOLERANCE[dtype])


def test_chunked_prefill_equals_whole_prefill() -> None:
    """A 70-token prompt run as chunks of 32, 32, 6 (each over the cached prefix) = one causal pass."""
    seq_len, block_size = 70, 16
    whole = make_paged_batch([seq_len], [seq_len], num_heads=4, num_kv_heads=2, head_dim=64, block_size=block_size)
    table = [whole.meta.block_tables[0, : (seq_len + 15) // 16].tolist()]
    outs, done = [], 0
    for chunk in (32, 32, 6):
        meta = AttentionMetadata.build([chunk], [done + chunk], table, block_size)
        q = whole.q[done : done + chunk]
        outs.append(reference.paged_attention(q, whole.k_cache, whole.v_cache, meta, whole.scale))
        done += chunk
    torch.testing.assert_close(torch.cat(outs).double(), dense_causal_attention(whole), **TOLERANCE[torch.float32])


def test_tiny_head_dim_and_strided_query() -> None:
    """head_dim 8 (the 260K model) with q a strided view into a fused qkv tensor."""
    qlens, slens = SCENARIOS["mixed_interleaved"]
    batch = make_paged_batch(qlens, slens, num_heads=8, num_kv_heads=4, head_dim=8, block_size=32)
    num_tokens = batch.q.shape[0]
    qkv = torch.cat((batch.q.reshape(num_tokens, -1), torch.zeros(num_tokens, 64)), dim=1)
    q_view = qkv[:, :64].view(num_tokens, 8, 8)
    assert not q_view.is_contiguous()
    out = reference.paged_attention(q_view, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    torch.testing.assert_close(out.double(), dense_causal_attention(batch), **TOLERANCE[torch.float32])


def test_workspace_reuse_never_aliases_outputs() -> None:
    """Outputs stay intact when a later call reuses the gather workspace."""
    first = make_paged_batch([1, 1, 1], [40, 9, 70], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, seed=7)
    second = make_paged_batch([1, 1], [90, 33], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, seed=8)
    out1 = reference.paged_attention(first.q, first.k_cache, first.v_cache, first.meta, first.scale)
    kept = out1.clone()
    reference.paged_attention(second.q, second.k_cache, second.v_cache, second.meta, second.scale)
    assert torch.equal(out1, kept)
    torch.testing.assert_close(out1.double(), dense_causal_attention(first), **TOLERANCE[torch.float32])


def test_paged_attention_equals_sdpa_on_contiguous_cache() -> None:
    """Decode over a paged cache = SDPA over the same keys laid out as a static cache."""
    slens = [37, 64, 5, 100]
    batch = make_paged_batch([1] * 4, slens, num_heads=8, num_kv_heads=4, head_dim=64, block_size=16, seed=9)
    max_len = max(slens)
    static_k = torch.zeros(4, 4, max_len, 64)
    static_v = torch.zeros(4, 4, max_len, 64)
    for b, (k, v) in enumerate(zip(batch.keys, batch.values)):
        static_k[b, :, : len(k)] = k.transpose(0, 1)
        static_v[b, :, : len(v)] = v.transpose(0, 1)
    mask = torch.arange(max_len)[None, :] < torch.tensor(slens)[:, None]
    expected = F.scaled_dot_product_attention(
        batch.q[:, :, None], static_k, static_v, attn_mask=mask[:, None, None], scale=batch.scale, enable_gqa=True
    )[:, :, 0]
    out = reference.paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_float32_rms_norm_is_bit_identical_to_the_formula() -> None:
    """The fused float32 path rounds exactly like the six-op formula it replaced."""
    gen = torch.Generator().manual_seed(2)
    for shape in [(1, 512), (33, 576), (7, 8, 64)]:
        x = torch.randn(shape, generator=gen) * 3
        w = torch.randn(shape[-1], generator=gen)
        expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w
        assert torch.equal(reference.rms_norm(x, w, 1e-5), expected)


def test_plan_is_built_once_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every layer of a step shares one plan in meta.derived; a new geometry gets its own."""
    qlens, slens = SCENARIOS["decodes_between_prefills"]
    batch = make_paged_batch(qlens, slens, num_heads=6, num_kv_heads=2, head_dim=32, block_size=16, seed=3)
    first = reference.paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    (plan,) = batch.meta.derived.values()
    again = reference.paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    assert torch.equal(first, again)
    assert list(batch.meta.derived.values()) == [plan]
    monkeypatch.setattr(reference, "_GATHER_CHUNK_BYTES", 1)
    split = reference.paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    assert len(batch.meta.derived) == 2
    torch.testing.assert_close(split, first, **TOLERANCE[torch.float32])


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(8, 8), (8, 4), (12, 2)])
def test_grouped_decode_matches_sdpa_with_gqa(num_heads: int, num_kv_heads: int) -> None:
    """Decode rows feed each KV head's query heads as its query rows; same result as enable_gqa."""
    slens = [3, 40, 17, 64]
    batch = make_paged_batch(
        [1] * 4, slens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=32, block_size=16, seed=4
    )
    out = reference.paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    for b, (k, v) in enumerate(zip(batch.keys, batch.values)):
        expected = F.scaled_dot_product_attention(
            batch.q[b, :, None], k.transpose(0, 1), v.transpose(0, 1), scale=batch.scale,
            enable_gqa=num_heads != num_kv_heads,
        )[:, 0]  # fmt: skip
        torch.testing.assert_close(out[b], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("qlens", "slens"), [
    ([16, 16, 16, 9, 16], [16, 16, 16, 9, 16]),  # one run of three, then single ones
    ([16, 16, 1, 12, 16, 16, 5], [16, 16, 30, 40, 16, 16, 5]),  # runs beside a decode and a chunk with context
])
def test_context_free_prefills_attend_over_the_steps_own_keys(qlens, slens) -> None:
    """fresh_prefill.py: with this step's k, v handed in, context-free prefills skip the cache
    gather and equal-length neighbours share one SDPA call; the same output as gathering."""
    batch = make_paged_batch(qlens, slens, num_heads=8, num_kv_heads=2, head_dim=64, block_size=16, seed=9)
    k = torch.cat([keys[s - n:] for keys, n, s in zip(batch.keys, qlens, slens)])
    v = torch.cat([values[s - n:] for values, n, s in zip(batch.values, qlens, slens)])
    gathered = reference.paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    fresh = reference.paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, batch.scale, k=k, v=v)
    plan = batch.meta.derived[next(key for key in batch.meta.derived if key[-1] is True)]
    assert plan.fresh and all(seq.mask is not None for seq in plan.prefill)  # only chunks with context gather
    torch.testing.assert_close(fresh, gathered, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(fresh.double(), dense_causal_attention(batch), **TOLERANCE[torch.float32])

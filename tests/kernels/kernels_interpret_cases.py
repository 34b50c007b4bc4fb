"""Triton kernels vs the torch reference, run by Triton's CPU interpreter.

NOTE: not collected by the main pytest run (the name does not match
test_*.py): `test_kernels_triton_interpret.py` runs this file in a
subprocess with TRITON_INTERPRET=1, which Triton reads once at import.
Running it by hand: TRITON_INTERPRET=1 pytest tests/kernels/kernels_interpret_cases.py

Interpreter caveats these tolerances allow for: float32 -> bfloat16 casts
truncate instead of rounding to nearest (one bf16 ulp), and tl.dot on
bfloat16 operands is wrong in the interpreter, so the attention launcher
upcasts them to float32 there (see triton_attention.py).
"""

from __future__ import annotations

import os

import pytest
import torch
from support.paged_batches import dense_causal_attention, make_paged_batch, rope_cache

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 before triton is imported", allow_module_level=True)
pytest.importorskip("triton", reason="triton is not installed")

from trillium.kernels import (  # noqa: E402
    reference,
    triton_attention,
    triton_kv_cache,
    triton_pointwise,
)

TOLERANCE = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=3e-3, rtol=3e-3),
    torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def test_kernels_run_in_interpreter() -> None:
    assert triton_attention._interpreting()


# --------------------------------------------------------------- attention

# Decode over several KV tiles, prefill, prefill over a prefix whose query
# spans several query blocks, a one-token prompt.
MIXED = ([1, 9, 1, 40, 1], [150, 9, 18, 70, 1])


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (6, 2), (4, 1)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_paged_attention_grid(head_dim: int, num_heads: int, num_kv_heads: int, block_size: int) -> None:
    qlens, slens = MIXED
    batch = make_paged_batch(
        qlens, slens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size
    )
    out = triton_attention.paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    expected = reference.paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    assert out.shape == expected.shape and out.dtype == expected.dtype
    torch.testing.assert_close(out, expected, **TOLERANCE[torch.float32])


@pytest.mark.parametrize(
    ("qlens", "slens"),
    [([1, 1, 1, 1], [33, 1, 64, 90]), ([16, 3], [16, 80]), ([5, 0, 2], [5, 7, 9])],
    ids=["decode", "chunked_prefill", "empty_query"],
)
def test_paged_attention_never_reads_unowned_slots(qlens: list[int], slens: list[int]) -> None:
    """NaN in every slot no sequence owns (incl. block 0, the table padding) stays out of the output."""
    batch = make_paged_batch(
        qlens, slens, num_heads=8, num_kv_heads=2, head_dim=32, block_size=16, fill=float("nan")
    )
    out = triton_attention.paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), dense_causal_attention(batch), **TOLERANCE[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_paged_attention_half_precision(dtype: torch.dtype) -> None:
    qlens, slens = MIXED
    batch = make_paged_batch(qlens, slens, num_heads=8, num_kv_heads=2, head_dim=64, block_size=16, dtype=dtype)
    out = triton_attention.paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    expected = reference.paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    assert out.dtype == dtype
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("head_dim", [8, 32])
def test_paged_attention_small_head_dims(head_dim: int) -> None:
    """head_dim 8 (the 260K model) pads the dot to 16 lanes."""
    qlens, slens = MIXED
    batch = make_paged_batch(qlens, slens, num_heads=8, num_kv_heads=4, head_dim=head_dim, block_size=32)
    out = triton_attention.paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    expected = reference.paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    torch.testing.assert_close(out, expected, **TOLERANCE[torch.float32])


def test_paged_attention_rejects_bad_inputs() -> None:
    batch = make_paged_batch([2], [2], num_heads=4, num_kv_heads=2, head_dim=16, block_size=16)
    with pytest.raises(AssertionError, match="dtypes"):
        triton_attention.paged_attention(batch.q.half(), batch.k_cache, batch.v_cache, batch.meta, 1.0)
    with pytest.raises(AssertionError, match="multiple"):
        triton_attention.paged_attention(batch.q[:, :3], batch.k_cache, batch.v_cache, batch.meta, 1.0)
    strided_cache = batch.k_cache.transpose(1, 2).contiguous().transpose(1, 2)
    with pytest.raises(AssertionError, match="contiguous"):
        triton_attention.paged_attention(batch.q, strided_cache, batch.v_cache, batch.meta, 1.0)


# --------------------------------------------------------------- pointwise


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 64), (2, 3, 96)])
def test_rms_norm(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=gen).to(dtype)
    w = torch.randn(shape[-1], generator=gen).to(dtype)
    y = triton_pointwise.rms_norm(x, w, 1e-5)
    assert y.shape == x.shape and y.dtype == dtype
    torch.testing.assert_close(y, reference.rms_norm(x, w, 1e-5), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype: torch.dtype) -> None:
    x = torch.randn((3, 2, 2 * 40), generator=torch.Generator().manual_seed(2)).to(dtype)
    y = triton_pointwise.silu_and_mul(x)
    assert y.shape == (3, 2, 40) and y.dtype == dtype
    torch.testing.assert_close(y, reference.silu_and_mul(x), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(4, 2, 64), (3, 1, 128), (8, 4, 8)])
def test_rotary_embedding_on_fused_qkv_views(
    num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(3)
    num_tokens = 6
    qkv = torch.randn((num_tokens, (num_heads + 2 * num_kv_heads) * head_dim), generator=gen).to(dtype)
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(num_tokens, num_kv_heads, head_dim)
    positions = torch.tensor([0, 5, 99, 3, 3, 64])
    cache = rope_cache(100, head_dim)
    q_out, k_out = triton_pointwise.rotary_embedding(positions, q, k, cache)
    q_ref, k_ref = reference.rotary_embedding(positions, q, k, cache)
    assert q_out.dtype == dtype and q_out.shape == q.shape and k_out.shape == k.shape
    torch.testing.assert_close(q_out, q_ref, **TOLERANCE[dtype])
    torch.testing.assert_close(k_out, k_ref, **TOLERANCE[dtype])
    assert torch.equal(qkv[:, : num_heads * head_dim].view_as(q), q)  # inputs untouched


def test_pointwise_launchers_check_inputs() -> None:
    with pytest.raises(AssertionError, match="weight"):
        triton_pointwise.rms_norm(torch.randn(2, 8), torch.randn(4), 1e-5)
    with pytest.raises(AssertionError, match="even"):
        triton_pointwise.silu_and_mul(torch.randn(2, 7))
    with pytest.raises(AssertionError, match="contiguous"):
        q = torch.randn(3, 2, 16).transpose(1, 2).contiguous().transpose(1, 2)
        triton_pointwise.rotary_embedding(torch.zeros(3, dtype=torch.long), q, q, rope_cache(4, 16))


# ---------------------------------------------------------------- kv cache


@pytest.mark.parametrize(
    ("src_dtype", "cache_dtype"),
    [(torch.float32, torch.float32), (torch.float16, torch.float16), (torch.float32, torch.bfloat16)],
)
def test_write_kv_cache(src_dtype: torch.dtype, cache_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(4)
    num_tokens, num_kv_heads, head_dim = 7, 2, 64
    kv = torch.randn((num_tokens, 2 * num_kv_heads, head_dim), generator=gen).to(src_dtype)
    k, v = kv[:, :num_kv_heads], kv[:, num_kv_heads:]  # token-strided views, as from fused qkv
    slots = torch.randperm(6 * 32, generator=gen)[:num_tokens]
    caches = [torch.randn((6, 32, num_kv_heads, head_dim), generator=gen).to(cache_dtype) for _ in range(2)]
    expected = [c.clone() for c in caches]
    triton_kv_cache.write_kv_cache(k, v, caches[0], caches[1], slots)
    reference.write_kv_cache(k, v, expected[0], expected[1], slots)
    assert torch.equal(caches[0], expected[0]) or cache_dtype == torch.bfloat16
    assert torch.equal(caches[1], expected[1]) or cache_dtype == torch.bfloat16
    # bf16: the interpreter truncates the fp32 -> bf16 cast (one ulp at most).
    torch.testing.assert_close(caches[0], expected[0], **TOLERANCE[cache_dtype])
    torch.testing.assert_close(caches[1], expected[1], **TOLERANCE[cache_dtype])


def test_write_kv_cache_skips_negative_slots() -> None:
    k = torch.ones(3, 1, 16)
    k_cache = torch.zeros(2, 16, 1, 16)
    v_cache = torch.zeros(2, 16, 1, 16)
    triton_kv_cache.write_kv_cache(k, 2 * k, k_cache, v_cache, torch.tensor([5, -1, 31]))
    assert k_cache.view(32, 16).sum(-1).nonzero().flatten().tolist() == [5, 31]
    assert torch.equal(v_cache.view(32, 16)[31], torch.full((16,), 2.0))

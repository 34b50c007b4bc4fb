"""Random paged-KV batches and a naive dense attention oracle for the kernel tests.

A batch holds, per sequence, dense K/V of all its positions (the oracle's
input) and the same rows scattered into a paged cache through a shuffled
block table (the kernels' input). Block 0 is never handed out, so padded
block-table entries point at it; it and every slot no sequence owns hold
`fill` (finite garbage by default, NaN to prove a kernel never reads them).
"""

from __future__ import annotations

import math
import random

import attrs
import torch

from trillium.kernels.metadata import AttentionMetadata


@attrs.frozen
class PagedBatch:
    q: torch.Tensor  # [T, H, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, KH, D]
    v_cache: torch.Tensor
    meta: AttentionMetadata
    keys: tuple[torch.Tensor, ...]  # per sequence [seq_len, KH, D]
    values: tuple[torch.Tensor, ...]
    scale: float


def make_paged_batch(
    query_lens: list[int],
    seq_lens: list[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    fill: float | None = None,
    spare_blocks: int = 3,
) -> PagedBatch:
    """fill=None: unowned slots get finite random garbage (x10); else that constant."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    blocks_per_seq = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = 1 + sum(blocks_per_seq) + spare_blocks
    ids = list(range(1, num_blocks))
    rng.shuffle(ids)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    if fill is None:
        k_cache = (torch.randn(shape, generator=gen) * 10).to(dtype)
        v_cache = (torch.randn(shape, generator=gen) * 10).to(dtype)
    else:
        k_cache = torch.full(shape, fill, dtype=dtype)
        v_cache = torch.full(shape, fill, dtype=dtype)
    tables, keys, values = [], [], []
    for seq_len, nblk in zip(seq_lens, blocks_per_seq):
        table, ids = ids[:nblk], ids[nblk:]
        tables.append(table)
        k = torch.randn((seq_len, num_kv_heads, head_dim), generator=gen).to(dtype)
        v = torch.randn((seq_len, num_kv_heads, head_dim), generator=gen).to(dtype)
        for pos in range(seq_len):
            k_cache[table[pos // block_size], pos % block_size] = k[pos]
            v_cache[table[pos // block_size], pos % block_size] = v[pos]
        keys.append(k)
        values.append(v)
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, block_size)
    q = torch.randn((sum(query_lens), num_heads, head_dim), generator=gen).to(dtype)
    return PagedBatch(q, k_cache, v_cache, meta, tuple(keys), tuple(values), head_dim**-0.5)


def dense_causal_attention(
    batch: PagedBatch, sliding_window: int | None = None, softcap: float | None = None
) -> torch.Tensor:
    """Plain per-sequence, per-head softmax(q k^T) v in float64 -> [T, H, D] float64.

    sliding_window: keys j with p - window < j <= p only (HF masking_utils
    `sliding_window_overlay`); softcap: cap * tanh(scores / cap) first (HF Gemma 2).
    """
    q = batch.q.double()
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = batch.k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.zeros((num_tokens, num_heads, head_dim), dtype=torch.float64)
    start = 0
    for qlen, slen, k, v in zip(batch.meta.query_lens_list, batch.meta.seq_lens_list, batch.keys, batch.values):
        ctx = slen - qlen
        query_pos = torch.arange(ctx, slen)[:, None]
        visible = torch.arange(slen)[None, :] <= query_pos  # [Q, S]
        if sliding_window is not None:
            visible &= torch.arange(slen)[None, :] > query_pos - sliding_window
        for h in range(num_heads):
            scores = q[start : start + qlen, h] @ k[:, h // group].double().T * batch.scale
            if softcap is not None:
                scores = torch.tanh(scores / softcap) * softcap
            scores = scores.masked_fill(~visible, float("-inf"))
            probs = torch.exp(scores - scores.max(dim=-1, keepdim=True).values)
            probs = probs / probs.sum(dim=-1, keepdim=True)
            out[start : start + qlen, h] = probs @ v[:, h // group].double()
        start += qlen
    return out


def rope_cache(max_pos: int, head_dim: int, base: float = 10000.0) -> torch.Tensor:
    """[max_pos, D] float32 = [cos | sin] of pos * base^(-2i/D), i < D/2 (HF Llama)."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat((angles.cos(), angles.sin()), dim=-1).float()

"""Attention metadata for one flat varlen batch (no padding).

Built once per step by the executor and shared by every layer.

Layout of a batch of B sequences, T = sum(query_lens) tokens:

    tokens:   [ seq0: q0 tokens | seq1: q1 tokens | ... ]   (flat, T rows)
    query_start_loc = [0, q0, q0+q1, ..., T]                 (B+1, int32)
    seq_lens[b]     = context_len[b] + q_len[b]              (B, int32)

The query tokens of sequence b sit at positions
context_len[b] .. seq_lens[b]-1 and attend causally to every cached key of
that sequence at positions 0 .. own position. Keys and values of the query
tokens are written into the paged cache (`write_kv_cache`) *before*
attention runs, so attention reads all keys from the cache.

KV cache per layer: k_cache, v_cache of shape
[num_blocks, block_size, num_kv_heads, head_dim]; token at position p of a
sequence lives in slot block_tables[b, p // block_size] * block_size
+ p % block_size. slot_mapping[t] is that slot for each query token.
"""

from __future__ import annotations

import attrs
import torch


@attrs.frozen
class AttentionMetadata:
    query_start_loc: torch.Tensor  # [B+1] int32, on device
    seq_lens: torch.Tensor  # [B] int32, on device
    block_tables: torch.Tensor  # [B, max_blocks_per_seq] int32, on device (pad with 0)
    slot_mapping: torch.Tensor  # [T] int64, on device
    max_query_len: int
    max_seq_len: int
    # Host copies, so CPU reference code never syncs with the device.
    query_lens_list: tuple[int, ...]
    seq_lens_list: tuple[int, ...]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)

    @property
    def num_tokens(self) -> int:
        return int(sum(self.query_lens_list))

    @staticmethod
    def build(
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> "AttentionMetadata":
        """Build metadata from host lists (the executor's per-step input)."""
        num_seqs = len(query_lens)
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        max_blocks = max((len(t) for t in block_tables), default=1) or 1
        table = torch.zeros((num_seqs, max_blocks), dtype=torch.int32)
        for i, row in enumerate(block_tables):
            if row:
                table[i, : len(row)] = torch.tensor(row, dtype=torch.int32)
        slots: list[int] = []
        for b in range(num_seqs):
            ctx = seq_lens[b] - query_lens[b]
            row = block_tables[b]
            for p in range(ctx, seq_lens[b]):
                slots.append(row[p // block_size] * block_size + p % block_size)
        return AttentionMetadata(
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=table.to(device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
            query_lens_list=tuple(query_lens),
            seq_lens_list=tuple(seq_lens),
        )

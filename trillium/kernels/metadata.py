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

import itertools
from collections.abc import Sequence

import attrs
import numpy as np
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
    # WHY: every layer attends over the same batch. A kernel that derives
    # something from the metadata (the CPU decode plan: chunks, index
    # tensors, masks) stores it here under its own key, once per step.
    # Not compared, hashed or printed.
    derived: dict = attrs.field(factory=dict, eq=False, hash=False, repr=False)
    # A speculative verify step (the executor sets it): each sequence's few query rows (its last
    # token and its drafts) are decode rows, and may take a decode kernel (paged_attention_cpu.py)
    # so each verified row is computed as the plain decode step it stands for.
    verify_rows: bool = False

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)

    @property
    def num_tokens(self) -> int:
        return int(sum(self.query_lens_list))

    @staticmethod
    def build(
        query_lens: Sequence[int],
        seq_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        device: torch.device | str = "cpu",
        verify_rows: bool = False,
    ) -> "AttentionMetadata":
        """Build metadata from host lists (the executor's per-step input).

        Raises IndexError when a block table is too short for its sequence.
        WHY numpy: this runs every step; per-row tensors and a per-token
        Python loop cost ~0.3 ms at batch 32, the vectorized form ~0.05 ms.
        """
        num_seqs = len(query_lens)
        qlens = np.asarray(query_lens, dtype=np.int64).reshape(num_seqs)
        slens = np.asarray(seq_lens, dtype=np.int64).reshape(num_seqs)
        starts = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(qlens, out=starts[1:])
        table, row_blocks = _block_table(block_tables)
        # Token t of sequence b sits at position context_len[b] + (t - starts[b]).
        token_seq = np.repeat(np.arange(num_seqs), qlens)
        positions = np.arange(int(starts[-1])) + np.repeat(slens - qlens - starts[:-1], qlens)
        block_index = positions // block_size
        if (block_index >= row_blocks[token_seq]).any():
            raise IndexError("a block table is too short for its sequence's tokens")
        slots = table[token_seq, block_index].astype(np.int64) * block_size + positions % block_size
        return AttentionMetadata(
            query_start_loc=torch.from_numpy(starts.astype(np.int32)).to(device),
            seq_lens=torch.from_numpy(slens.astype(np.int32)).to(device),
            block_tables=torch.from_numpy(table).to(device),
            slot_mapping=torch.from_numpy(slots).to(device),
            max_query_len=int(qlens.max(initial=0)),
            max_seq_len=int(slens.max(initial=0)),
            query_lens_list=tuple(int(n) for n in query_lens),
            seq_lens_list=tuple(int(n) for n in seq_lens),
            verify_rows=verify_rows,
        )

    @staticmethod
    def decode_steps(
        seq_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        num_steps: int,
        device: torch.device | str = "cpu",
    ) -> list["AttentionMetadata"]:
        """Metadata of `num_steps` consecutive decode steps of the same sequences (multi-step
        decode, scheduler/multi_step.py): step j feeds each sequence one token at position
        seq_lens[b] - 1 + j. The same as `build([1] * B, [n + j for n in seq_lens], ...)` per
        step, built at once (`DecodeRun`). WHY: a step's own build is ~0.1-0.3 ms of Python beside
        a ~6 ms one-sequence forward whose weight reads have just evicted the interpreter's caches.

        Raises IndexError when a block table is too short for the last step."""
        run = DecodeRun.build(seq_lens, block_tables, block_size, num_steps, device)
        return [run.step(j) for j in range(num_steps)]


@attrs.frozen
class DecodeRun:
    """The slots and key counts of `num_steps` consecutive decode steps of the same sequences, as
    [num_steps, B] arrays over one block table (the tables already hold every step's slots).
    `step(j)` is step j's AttentionMetadata; native decode's greedy run (models/native_decode.py)
    reads the arrays whole."""

    tables: torch.Tensor  # [B, max_blocks] int32
    lens: torch.Tensor  # [num_steps, B] int32: step j's key counts (its input's position + 1)
    slots: torch.Tensor  # [num_steps, B] int64: step j's cache slots
    host_lens: np.ndarray  # lens on the host
    starts: torch.Tensor  # [B + 1] int32: every step's query starts (one token a sequence)

    @property
    def num_seqs(self) -> int:
        return self.lens.shape[1]

    @property
    def num_steps(self) -> int:
        return self.lens.shape[0]

    @staticmethod
    def build(seq_lens: Sequence[int], block_tables: Sequence[Sequence[int]], block_size: int, num_steps: int,
              device: torch.device | str = "cpu") -> "DecodeRun":
        """Step j feeds each sequence one token at position seq_lens[b] - 1 + j. Raises IndexError
        when a block table is too short for the last step."""
        num_seqs = len(seq_lens)
        table, row_blocks = _block_table(block_tables)
        lens = np.asarray(seq_lens, dtype=np.int64).reshape(1, num_seqs) + np.arange(num_steps)[:, None]  # [K, B]
        positions = lens - 1
        block_index = positions // block_size
        if (block_index >= row_blocks[None, :]).any():
            raise IndexError("a block table is too short for its sequence's tokens")
        slots = table[np.arange(num_seqs)[None, :], block_index].astype(np.int64) * block_size + positions % block_size
        return DecodeRun(tables=torch.from_numpy(table).to(device),
                         lens=torch.from_numpy(lens.astype(np.int32)).to(device),
                         slots=torch.from_numpy(slots).to(device), host_lens=lens,
                         starts=torch.arange(num_seqs + 1, dtype=torch.int32).to(device))

    def step(self, j: int) -> AttentionMetadata:
        lens = self.host_lens[j]
        return AttentionMetadata(
            query_start_loc=self.starts,
            seq_lens=self.lens[j], block_tables=self.tables, slot_mapping=self.slots[j], max_query_len=1,
            max_seq_len=int(lens.max(initial=0)), query_lens_list=(1,) * self.num_seqs,
            seq_lens_list=tuple(lens.tolist()))

    def first_step(self) -> AttentionMetadata:
        return self.step(0)

    def window(self, first: int, num_steps: int) -> "DecodeRun":
        """Steps first .. first + num_steps - 1 as a run of their own (views of these arrays)."""
        if not 0 <= first < first + num_steps <= self.num_steps:
            raise IndexError(f"steps {first}..{first + num_steps - 1} of a run of {self.num_steps}")
        end = first + num_steps
        return DecodeRun(tables=self.tables, lens=self.lens[first:end], slots=self.slots[first:end],
                         host_lens=self.host_lens[first:end], starts=self.starts)


def _block_table(block_tables: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """The block tables as one int32 [B, max blocks] array (padded with 0), and each row's length."""
    num_seqs = len(block_tables)
    row_blocks = np.fromiter(map(len, block_tables), dtype=np.int64, count=num_seqs)
    max_blocks = int(row_blocks.max(initial=0)) or 1
    table = np.zeros((num_seqs, max_blocks), dtype=np.int32)
    flat = np.fromiter(itertools.chain.from_iterable(block_tables), dtype=np.int32, count=int(row_blocks.sum()))
    table[np.arange(max_blocks) < row_blocks[:, None]] = flat  # row-major: row by row
    return table, row_blocks

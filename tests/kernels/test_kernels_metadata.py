"""AttentionMetadata.build against the layout its module docstring defines.

The vectorized builder is compared with a direct per-token transcription of
the layout (slot = block_tables[b, p // block_size] * block_size
+ p % block_size) over random ragged batches, including empty ones.
"""

from __future__ import annotations

import random

import pytest
import torch

from trillium.kernels.metadata import AttentionMetadata


def _expected(query_lens, seq_lens, tables, block_size):
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    width = max((len(t) for t in tables), default=1) or 1
    padded = [list(t) + [0] * (width - len(t)) for t in tables]
    slots = [
        table[p // block_size] * block_size + p % block_size
        for table, q, s in zip(tables, query_lens, seq_lens)
        for p in range(s - q, s)
    ]
    return starts, padded, slots


@pytest.mark.parametrize("seed", range(6))
def test_build_matches_the_layout(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(40):
        num_seqs = rng.randint(0, 7)
        block_size = rng.choice([1, 4, 16])
        query_lens = [rng.choice([1, rng.randint(1, 40)]) for _ in range(num_seqs)]
        seq_lens = [q + rng.randint(0, 60) for q in query_lens]
        # Tables may be longer than needed (blocks reserved ahead) and shuffled.
        tables = [rng.sample(range(500), -(-s // block_size) + rng.randint(0, 2)) for s in seq_lens]
        meta = AttentionMetadata.build(query_lens, seq_lens, tables, block_size)
        starts, padded, slots = _expected(query_lens, seq_lens, tables, block_size)
        assert meta.query_start_loc.dtype == torch.int32 and meta.query_start_loc.tolist() == starts
        assert meta.seq_lens.dtype == torch.int32 and meta.seq_lens.tolist() == seq_lens
        assert meta.block_tables.dtype == torch.int32 and meta.block_tables.tolist() == (padded if num_seqs else [])
        assert meta.block_tables.shape == (num_seqs, len(padded[0]) if padded else 1)
        assert meta.slot_mapping.dtype == torch.int64 and meta.slot_mapping.tolist() == slots
        assert meta.max_query_len == max(query_lens, default=0)
        assert meta.max_seq_len == max(seq_lens, default=0)
        assert meta.query_lens_list == tuple(query_lens) and meta.seq_lens_list == tuple(seq_lens)
        assert meta.num_tokens == len(slots)


def test_build_rejects_a_table_too_short_for_its_tokens() -> None:
    with pytest.raises(IndexError):
        AttentionMetadata.build([3], [20], [[1]], 16)


def test_derived_data_is_per_instance_and_not_printed() -> None:
    a = AttentionMetadata.build([1], [5], [[2]], 16)
    b = AttentionMetadata.build([1], [5], [[2]], 16)
    a.derived["plan"] = object()
    assert b.derived == {}
    assert "derived" not in repr(a)


@pytest.mark.parametrize("seed", range(4))
def test_decode_steps_equal_one_build_per_step(seed: int) -> None:
    """Multi-step decode's metadata built at once (executor core `_run_ahead`) is each step's own build."""
    rng = random.Random(seed)
    block_size, num_steps = rng.choice([4, 16]), rng.randint(1, 9)
    seq_lens = [rng.randint(1, 40) for _ in range(rng.randint(1, 6))]
    tables = [rng.sample(range(100), -(-(n + num_steps - 1) // block_size)) for n in seq_lens]
    steps = AttentionMetadata.decode_steps(seq_lens, tables, block_size, num_steps)
    assert len(steps) == num_steps
    for j, got in enumerate(steps):
        want = AttentionMetadata.build([1] * len(seq_lens), [n + j for n in seq_lens], tables, block_size)
        for field in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping"):
            a, b = getattr(got, field), getattr(want, field)
            assert a.dtype == b.dtype and torch.equal(a, b), (j, field)
        assert (got.max_query_len, got.max_seq_len, got.query_lens_list, got.seq_lens_list) == \
            (want.max_query_len, want.max_seq_len, want.query_lens_list, want.seq_lens_list)
    with pytest.raises(IndexError):  # the last step's block missing from the first table
        AttentionMetadata.decode_steps(seq_lens, [tables[0][:-1], *tables[1:]], block_size, num_steps)

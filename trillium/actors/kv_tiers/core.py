"""KV tiers: where cached KV blocks live, behind one small Protocol.

Role: the seam for a hierarchy of KV caches keyed by the same chained block
hashes (`block_pool.hash_block_tokens`): the device tier (GPU memory, the
`BlockPool`) and the host-memory tier (`host.HostTier`, under the pool as
its lower tier: it takes the blocks the device evicts and its prefix hits
are loaded into device blocks before the request runs); a disk tier later.

Pure synchronous code: no trio, no zmq, no torch. The device tier holds no
tensors either; the executor owns them and the pool only counts blocks.
"""

from __future__ import annotations

from typing import Protocol, Sequence

from trillium.actors.kv_tiers.block_pool import BlockHash, BlockPool


class KvTier(Protocol):
    """One level of the KV hierarchy."""

    @property
    def name(self) -> str: ...

    @property
    def num_total_blocks(self) -> int: ...

    @property
    def num_free_blocks(self) -> int: ...

    def match_prefix(self, block_hashes: Sequence[BlockHash]) -> int:
        """Number of leading blocks of this hash chain the tier holds."""
        ...

    def reset(self) -> int:
        """Forget every cached block; returns how many were dropped."""
        ...


class DeviceTier:
    """The device KV cache as a tier: a view of the scheduler's BlockPool."""

    name = "device"

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool

    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def match_prefix(self, block_hashes: Sequence[BlockHash]) -> int:
        return self.pool.match_prefix(block_hashes)

    def reset(self) -> int:
        return self.pool.reset_prefix_cache()


def longest_prefix(tiers: Sequence[KvTier], block_hashes: Sequence[BlockHash]) -> tuple[KvTier | None, int]:
    """The tier holding the longest prefix of the chain, and its length in
    blocks; earlier tiers win ties (list the fastest first)."""
    best: KvTier | None = None
    best_blocks = 0
    for tier in tiers:
        num = tier.match_prefix(block_hashes)
        if num > best_blocks:
            best, best_blocks = tier, num
    return best, best_blocks

"""A minimal `PoolRequest`, admission as the scheduler does it, and the block pool's invariants.

For the block pool, host tier and spill tests, which drive `BlockPool` without a scheduler.
"""

from __future__ import annotations

from trillium.actors.kv_tiers.block_pool import NULL_BLOCK, BlockPool


class FakeRequest:
    """The PoolRequest protocol, nothing more."""

    def __init__(self, rid: str, tokens, lora_id: int = 0, reads_prefix_cache: bool = True,
                 cache_salt: str | None = None) -> None:
        self.request_id = rid
        self.all_token_ids = list(tokens)
        self.lora_id = lora_id
        self.cache_salt = cache_salt
        self.num_computed_tokens = 0
        self.block_hashes = []
        self.reads_prefix_cache = reads_prefix_cache

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


def admit(pool: BlockPool, req: FakeRequest, *, compute: bool = True):
    """Admit a request like the scheduler does: lookup, allocate the rest of
    the prompt, and (optionally) mark it computed and cache its full blocks."""
    pool.update_block_hashes(req)
    hit = pool.get_computed_blocks(req)
    blocks = pool.allocate_slots(req, req.num_tokens - hit.num_computed_tokens, hit)
    assert blocks is not None
    req.num_computed_tokens = hit.num_computed_tokens
    if compute:
        req.num_computed_tokens = req.num_tokens
        pool.cache_full_blocks(req)
    return hit


def check_invariants(pool: BlockPool, live: list[FakeRequest]) -> None:
    holders = [0] * pool.num_blocks
    if pool.sliding_window:  # NULL_BLOCK (0): held by the pool itself, in any number of positions
        holders[NULL_BLOCK] = 1
    for req in live:
        table = [b for b in pool.block_ids(req.request_id) if not (pool.sliding_window and b == NULL_BLOCK)]
        assert len(set(table)) == len(table)
        for b in table:
            holders[b] += 1
    assert [pool.ref_count(b) for b in range(pool.num_blocks)] == holders
    assert pool.num_free_blocks == holders.count(0)
    assert pool.num_free_blocks + sum(1 for h in holders if h) == pool.num_blocks
    for b, num in enumerate(holders):
        if num > 1:
            assert pool.is_cached(b)  # only cached (full, computed) blocks are shared

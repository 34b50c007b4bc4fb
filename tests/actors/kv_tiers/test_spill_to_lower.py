"""A sleep that keeps the prefix cache (--sleep-keep-prefix-cache): the pool's side, pure and fast.

BlockPool.spill_cached_to_lower hands every cached device block to the host
tier, then forgets them on the device. The scheduler's side (EngineControl
carries the queued copies in the Sleep it forwards, at level 1 with the flag
only) is tests/actors/scheduler/test_lifecycle_sleep_spill.py."""

from __future__ import annotations

import pytest

from support.pool_requests import FakeRequest, admit, check_invariants
from trillium.actors.kv_tiers.block_pool import BlockPool
from trillium.actors.kv_tiers.host import HostTier


def test_spill_hands_every_cached_block_down_and_forgets_them():
    tier = HostTier(8)
    pool = BlockPool(8, 4, lower_tier=tier)
    a = FakeRequest("a", range(13))  # 3 full blocks + 1 token
    admit(pool, a)
    a_blocks = pool.block_ids("a")
    pool.free(a)
    assert tier.take_transfers().empty and pool.num_cached_blocks == 3

    assert pool.spill_cached_to_lower() == 3
    t = tier.take_transfers()
    assert sorted(t.save_block_ids.tolist()) == sorted(a_blocks[:3]) and len(t.load_block_ids) == 0
    assert pool.num_cached_blocks == 0 and not any(pool.is_cached(b) for b in range(8))
    assert pool.num_free_blocks == 8 and pool.num_evicted_blocks == 0
    check_invariants(pool, [])

    # The same prompt now hits the host tier only, and loads all three blocks.
    again = FakeRequest("a2", range(13))
    pool.update_block_hashes(again)
    hit = pool.get_computed_blocks(again)
    assert hit.block_ids == () and len(hit.lower_slots) == 3 and hit.num_computed_tokens == 12


def test_spill_skips_blocks_the_host_already_holds_and_includes_blocks_in_use():
    tier = HostTier(8)
    pool = BlockPool(8, 4, lower_tier=tier)
    a = FakeRequest("a", range(9))  # 2 full blocks
    admit(pool, a)
    pool.free(a)
    pool.spill_cached_to_lower()
    assert len(tier.take_transfers().save_block_ids) == 2
    a2 = FakeRequest("a2", range(9))
    admit(pool, a2)  # loads both back; they are cached on the device again
    tier.take_transfers()
    b = FakeRequest("b", range(50, 58))  # still running: its 2 blocks are in use
    admit(pool, b)
    pool.free(a2)

    assert pool.spill_cached_to_lower() == 4
    t = tier.take_transfers()
    assert sorted(t.save_block_ids.tolist()) == sorted(pool.block_ids("b")), "copy semantics: a's are there"
    assert tier.num_used_blocks == 4 and pool.num_cached_blocks == 0
    check_invariants(pool, [b])


def test_spill_into_a_full_host_keeps_the_heads_of_the_chains():
    tier = HostTier(2)
    pool = BlockPool(8, 4, lower_tier=tier)
    a = FakeRequest("a", range(17))  # 4 full blocks
    admit(pool, a)
    pool.free(a)  # tail first into the free queue: the head leaves the device last
    pool.spill_cached_to_lower()
    t = tier.take_transfers()
    assert len(t.save_block_ids) == 2 and tier.num_used_blocks == 2
    again = FakeRequest("a2", range(17))
    pool.update_block_hashes(again)
    assert len(pool.get_computed_blocks(again).lower_slots) == 2, "the first two blocks survived"


def test_spill_needs_a_lower_tier():
    with pytest.raises(RuntimeError, match="lower KV tier"):
        BlockPool(4, 4).spill_cached_to_lower()

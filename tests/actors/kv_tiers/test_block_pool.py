"""Unit tests of the device KV block pool and its prefix cache (pure, fast)."""

from __future__ import annotations

import pytest

from support.pool_requests import FakeRequest, admit, check_invariants
from trillium.actors.kv_tiers.block_pool import NO_HIT, BlockPool, hash_block_tokens


def test_hash_is_chained_deterministic_and_keyed_by_lora():
    a = hash_block_tokens(None, [1, 2, 3, 4], 0)
    assert a == hash_block_tokens(None, [1, 2, 3, 4], 0)
    assert len(a) == 32
    assert a != hash_block_tokens(None, [1, 2, 3, 5], 0)
    assert a != hash_block_tokens(None, [1, 2, 3, 4], 1)  # LoRA id
    b = hash_block_tokens(a, [5, 6, 7, 8], 0)
    assert b != hash_block_tokens(None, [5, 6, 7, 8], 0)  # chained on the parent


def test_allocate_and_free_track_ref_counts():
    pool = BlockPool(8, 4)
    req = FakeRequest("a", range(10))
    blocks = pool.allocate_slots(req, 10)
    assert len(blocks) == 3 and pool.num_free_blocks == 5
    assert all(pool.ref_count(b) == 1 for b in blocks)
    req.num_computed_tokens = 10
    assert pool.allocate_slots(req, 2) == []  # fits in the partial third block
    assert len(pool.allocate_slots(req, 3)) == 1  # 15 tokens -> 4 blocks
    assert pool.block_ids("a") == tuple(blocks) + pool.block_ids("a")[3:]
    check_invariants(pool, [req])
    pool.free(req)
    assert pool.num_free_blocks == 8 and pool.block_ids("a") == ()
    check_invariants(pool, [])


def test_allocate_refuses_without_side_effects_when_short():
    pool = BlockPool(4, 4)
    a = FakeRequest("a", range(12))
    assert pool.allocate_slots(a, 12) is not None
    b = FakeRequest("b", range(100, 108))
    assert not pool.can_allocate(2)
    assert pool.allocate_slots(b, 8) is None
    assert pool.block_ids("b") == () and pool.num_free_blocks == 1
    check_invariants(pool, [a])


def test_prefix_hit_across_requests_shares_blocks():
    pool = BlockPool(16, 4)
    a = FakeRequest("a", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11])
    admit(pool, a)
    assert pool.num_cached_blocks == 2  # two full blocks; the partial one never
    b = FakeRequest("b", [1, 2, 3, 4, 5, 6, 7, 8, 50, 51, 52, 53, 54])
    hit = admit(pool, b, compute=False)
    assert hit.num_computed_tokens == 8
    assert hit.block_ids == pool.block_ids("a")[:2]
    for block in hit.block_ids:
        assert pool.ref_count(block) == 2
    assert pool.prefix_cache_query_tokens == 11 + 13
    assert pool.prefix_cache_hit_tokens == 8
    c = FakeRequest("c", [1, 2, 3, 4, 99, 6, 7, 8, 9])  # diverges in block 1
    assert admit(pool, c, compute=False).num_computed_tokens == 4
    check_invariants(pool, [a, b, c])


def test_never_the_whole_prompt():
    pool = BlockPool(16, 4)
    admit(pool, FakeRequest("a", range(12)))  # three full blocks cached
    same = FakeRequest("b", range(12))
    pool.update_block_hashes(same)
    hit = pool.get_computed_blocks(same)
    assert hit.num_computed_tokens == 8  # backs off the last block: 4 tokens to compute
    longer = FakeRequest("c", range(13))
    pool.update_block_hashes(longer)
    assert pool.get_computed_blocks(longer).num_computed_tokens == 12


def test_lora_id_separates_blocks():
    pool = BlockPool(16, 4)
    admit(pool, FakeRequest("a", range(9), lora_id=0))
    other = FakeRequest("b", range(9), lora_id=3)
    assert admit(pool, other, compute=False) == NO_HIT
    same = FakeRequest("c", range(9), lora_id=0)
    assert admit(pool, same, compute=False).num_computed_tokens == 8


def test_request_may_skip_the_prefix_cache():
    pool = BlockPool(16, 4)
    admit(pool, FakeRequest("a", range(9)))
    b = FakeRequest("b", range(9), reads_prefix_cache=False)
    assert admit(pool, b, compute=False) == NO_HIT
    assert pool.prefix_cache_query_tokens == 9  # b did not query


def test_free_cached_blocks_stay_findable_and_are_revived():
    pool = BlockPool(4, 4)
    a = FakeRequest("a", range(9))
    admit(pool, a)
    pool.free(a)
    assert pool.num_free_blocks == 4 and pool.num_cached_blocks == 2
    b = FakeRequest("b", range(10))
    hit = admit(pool, b, compute=False)
    assert hit.num_computed_tokens == 8
    assert pool.num_free_blocks == 1  # two revived from the free queue, one fresh
    check_invariants(pool, [b])
    c = FakeRequest("c", range(50, 58))
    assert pool.allocate_slots(c, 8) is None  # revived blocks are not free any more


def test_eviction_is_lru_and_tail_first():
    pool = BlockPool(4, 4)
    a = FakeRequest("a", range(0, 8))
    b = FakeRequest("b", range(100, 108))
    admit(pool, a)
    admit(pool, b)
    a_blocks, b_blocks = pool.block_ids("a"), pool.block_ids("b")
    pool.free(a)  # least recently freed
    pool.free(b)
    assert pool.match_prefix(a.block_hashes) == 2 and pool.match_prefix(b.block_hashes) == 2
    x = FakeRequest("x", range(200, 204))
    assert pool.allocate_slots(x, 4) == [a_blocks[1]]  # a's tail goes first
    assert pool.match_prefix(a.block_hashes) == 1
    y = FakeRequest("y", range(300, 304))
    assert pool.allocate_slots(y, 4) == [a_blocks[0]]
    assert pool.match_prefix(a.block_hashes) == 0
    assert pool.match_prefix(b.block_hashes) == 2  # b, freed later, is untouched
    z = FakeRequest("z", range(400, 404))
    assert pool.allocate_slots(z, 4) == [b_blocks[1]]
    check_invariants(pool, [x, y, z])


def test_a_hit_refreshes_lru_position():
    pool = BlockPool(4, 4)
    a = FakeRequest("a", range(0, 8))
    b = FakeRequest("b", range(100, 108))
    admit(pool, a)
    admit(pool, b)
    a_head, a_tail = pool.block_ids("a")
    b_head, b_tail = pool.block_ids("b")
    pool.free(a)
    pool.free(b)  # queue: a_tail, a_head, b_tail, b_head
    a2 = FakeRequest("a2", range(0, 5))  # hits a_head, takes a_tail fresh
    assert admit(pool, a2).block_ids == (a_head,)
    assert pool.block_ids("a2") == (a_head, a_tail)
    pool.free(a2)  # queue: a_tail (uncached now), b_tail, b_head, a_head
    x = FakeRequest("x", range(200, 204))
    assert pool.allocate_slots(x, 4) == [a_tail]
    y = FakeRequest("y", range(300, 304))
    assert pool.allocate_slots(y, 4) == [b_tail]  # b is now the least recently used
    assert pool.match_prefix(a.block_hashes) == 1  # a_head survives: it was used last


def test_uncached_blocks_are_reused_before_cached_ones():
    pool = BlockPool(4, 4)
    a = FakeRequest("a", range(6))  # one full (cached) block, one partial
    admit(pool, a)
    full, partial = pool.block_ids("a")
    pool.free(a)
    # The whole free queue is reused before a's cached block is evicted.
    x = FakeRequest("x", range(50, 62))
    new = pool.allocate_slots(x, 12)
    assert full not in new and partial in new
    assert pool.match_prefix(a.block_hashes) == 1


def test_duplicate_blocks_are_not_registered_twice():
    pool = BlockPool(8, 4)
    a, b = FakeRequest("a", range(9)), FakeRequest("b", range(9))
    for req in (a, b):  # both admitted before either computed: no hit
        pool.update_block_hashes(req)
        assert pool.get_computed_blocks(req) == NO_HIT
        pool.allocate_slots(req, 9)
    for req in (a, b):
        req.num_computed_tokens = 9
        pool.cache_full_blocks(req)
    assert pool.num_cached_blocks == 2
    assert not any(pool.is_cached(blk) for blk in pool.block_ids("b"))
    check_invariants(pool, [a, b])
    pool.free(a)
    pool.free(b)
    check_invariants(pool, [])


def test_reset_prefix_cache_forgets_everything():
    pool = BlockPool(8, 4)
    a = FakeRequest("a", range(9))
    admit(pool, a)
    b = FakeRequest("b", range(9))
    admit(pool, b, compute=False)
    assert pool.reset_prefix_cache() == 2
    assert pool.num_cached_blocks == 0 and pool.match_prefix(a.block_hashes) == 0
    c = FakeRequest("c", range(9))
    assert admit(pool, c, compute=False) == NO_HIT
    pool.free(a)
    pool.free(b)
    pool.free(c)
    assert pool.num_free_blocks == 8


def test_disabled_prefix_caching_never_hits():
    pool = BlockPool(8, 4, enable_prefix_caching=False)
    a = FakeRequest("a", range(9))
    admit(pool, a)
    assert a.block_hashes == [] and pool.num_cached_blocks == 0
    b = FakeRequest("b", range(9))
    assert admit(pool, b, compute=False) == NO_HIT
    assert pool.prefix_cache_query_tokens == 0


def test_usage_fraction():
    pool = BlockPool(10, 4)
    assert pool.usage == 0.0
    pool.allocate_slots(FakeRequest("a", range(12)), 12)
    assert pool.usage == pytest.approx(0.3)


def test_device_pool_matches_prefix_and_resets():
    pool = BlockPool(8, 4)
    a = FakeRequest("a", range(13))
    admit(pool, a)
    probe = FakeRequest("p", list(range(8)) + [77, 78, 79, 80])
    pool.update_block_hashes(probe)
    assert pool.match_prefix(probe.block_hashes) == 2
    assert pool.match_prefix(a.block_hashes) == 3
    assert pool.reset_prefix_cache() == 3
    assert pool.match_prefix(a.block_hashes) == 0

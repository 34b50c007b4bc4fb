"""Unit tests of the host KV tier: its index, the pool's eviction / lookup
hooks, and the scheduler driving it against a simulated KV cache (pure, fast).

The scheduler tests use support/fake_executor.py's TieredFakeExecutor, which writes a
fingerprint of (LoRA id, every token so far) into each computed slot and
re-reads a request's whole context every step; here it also performs the
batch's host copies first (saves, then loads) on a simulated host memory. A
load of the wrong slot, a save of an overwritten block or a slot reused
while a load still needs it fails an assertion or changes the output.
"""

from __future__ import annotations

import pytest

from support.fake_executor import TieredFakeExecutor, reference
from support.pool_requests import FakeRequest, admit, check_invariants
from support.scheduler_harness import Harness, run_conversations
from trillium.actors.kv_tiers.block_pool import BlockPool, hash_block_tokens
from trillium.actors.kv_tiers.host import HostTier
from trillium.actors.kv_tiers.manager import KvTierManager
from trillium.actors.scheduler.core import Scheduler


def h(i: int):
    return hash_block_tokens(None, [i], 0)


# -- the index ----------------------------------------------------------------


def test_eviction_takes_a_slot_and_queues_one_save():
    tier = HostTier(4, block_bytes=100)
    tier.evicted(7, h(1))
    tier.evicted(3, h(2))
    tier.evicted(9, h(1))  # already held: copy semantics, no second save
    assert tier.num_used_blocks == 2 and tier.usage == 0.5 and h(1) in tier
    t = tier.take_transfers()
    assert t.save_block_ids.tolist() == [7, 3] and t.save_host_slots.tolist() == [0, 1]
    assert len(t.load_block_ids) == 0 and t.save_block_ids.dtype.name == "int32"
    assert tier.take_transfers().empty  # the queue was handed over
    assert tier.num_saved_blocks == 2 and tier.bytes_to_host == 200


def test_lookup_walks_the_leading_chain_and_load_needs_a_reserve():
    tier = HostTier(4)
    for block, i in ((0, 1), (1, 2), (2, 4)):
        tier.evicted(block, h(i))
    tier.take_transfers()
    assert tier.lookup([h(1), h(2), h(3), h(4)]) == (0, 1)  # stops at the first miss
    assert tier.match_prefix([h(2)]) == 1 and tier.lookup([h(3)]) == ()
    with pytest.raises(RuntimeError):
        tier.load(0, 5)
    tier.reserve((0, 1))
    tier.load(0, 5)
    tier.load(1, 6)
    t = tier.take_transfers()
    assert t.load_host_slots.tolist() == [0, 1] and t.load_block_ids.tolist() == [5, 6]
    assert tier.num_hit_blocks == 2 and tier.num_loaded_blocks == 2
    assert tier.lookup([h(1)]) == (0,)  # loading keeps the host copy
    pool = BlockPool(4, 4, lower_tier=tier)
    assert pool.match_prefix([h(1), h(2)]) == 0 and tier.match_prefix([h(1), h(2)]) == 2


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_a_full_tier_evicts_the_policy_victim(policy):
    tier = HostTier(3, policy)
    for block, i in enumerate((1, 2, 3)):
        tier.evicted(block, h(i))
    tier.take_transfers()
    tier.reserve(tier.lookup([h(1)]))  # a hit: h(1) is the most recently used now
    tier.take_transfers()
    tier.evicted(10, h(4))
    assert h(2) not in tier and h(1) in tier and h(4) in tier
    assert tier.num_evicted_blocks == 1 and tier.num_used_blocks == 3
    t = tier.take_transfers()
    assert t.save_block_ids.tolist() == [10] and t.save_host_slots.tolist() == [1]  # h(2)'s slot reused


def test_slots_loading_this_step_are_never_victims():
    tier = HostTier(2)
    tier.evicted(0, h(1))
    tier.evicted(1, h(2))
    tier.take_transfers()
    tier.reserve(tier.lookup([h(1), h(2)]))  # both slots load this step
    tier.evicted(5, h(3))  # no room: the block is not kept
    assert h(3) not in tier and h(1) in tier and h(2) in tier and tier.num_evicted_blocks == 0
    tier.load(0, 8)
    tier.load(1, 9)
    t = tier.take_transfers()
    assert len(t.save_block_ids) == 0 and sorted(t.load_host_slots.tolist()) == [0, 1]
    tier.evicted(5, h(3))  # next step the reservation is gone
    assert h(3) in tier and tier.num_evicted_blocks == 1


def test_a_slot_reused_in_the_same_step_keeps_only_the_last_save():
    tier = HostTier(1)
    tier.evicted(4, h(1))
    tier.evicted(5, h(2))  # victim h(1): its pending save is superseded
    t = tier.take_transfers()
    assert t.save_block_ids.tolist() == [5] and t.save_host_slots.tolist() == [0]
    assert tier.num_saved_blocks == 1


def test_reset_forgets_blocks_and_queued_copies():
    tier = HostTier(4, "arc")
    tier.evicted(0, h(1))
    assert tier.reset() == 1
    assert tier.num_used_blocks == 0 and tier.take_transfers().empty and tier.lookup([h(1)]) == ()
    tier.evicted(0, h(1))
    assert tier.take_transfers().save_host_slots.tolist() == [0]


# -- the pool's hooks ------------------------------------------------------


def test_pool_spills_evicted_blocks_and_loads_them_back():
    tier = HostTier(8)
    pool = BlockPool(4, 4, lower_tier=tier)
    a = FakeRequest("a", range(13))  # 3 full blocks + 1 token
    admit(pool, a)
    a_blocks = pool.block_ids("a")
    pool.free(a)
    tier.take_transfers()
    b = FakeRequest("b", range(100, 116))  # needs all 4 blocks: evicts a's 3 cached ones
    admit(pool, b)
    t = tier.take_transfers()
    assert sorted(t.save_block_ids.tolist()) == sorted(a_blocks[:3])
    assert pool.num_evicted_blocks == 3 and tier.num_used_blocks == 3
    pool.free(b)  # b's blocks: cached, b's 4 full blocks stay on the device
    tier.take_transfers()

    again = FakeRequest("a2", range(13))
    pool.update_block_hashes(again)
    hit = pool.get_computed_blocks(again)
    assert hit.block_ids == () and len(hit.lower_slots) == 3 and hit.num_computed_tokens == 12
    blocks = pool.allocate_slots(again, 1, hit)
    assert len(blocks) == 4
    t = tier.take_transfers()
    assert t.load_block_ids.tolist() == blocks[:3] and sorted(t.load_host_slots.tolist()) == [0, 1, 2]
    # The four pops evicted b's cached blocks: saved (before the loads overwrite them).
    assert sorted(t.save_block_ids.tolist()) == sorted(blocks) and t.save_host_slots.tolist() == [3, 4, 5, 6]
    assert [pool.is_cached(b) for b in blocks] == [True, True, True, False]
    assert tier.num_hit_blocks == 3 and pool.num_hit_blocks == 0
    again.num_computed_tokens = 13
    check_invariants(pool, [again])
    # Registered at once: a second request finds them on the device.
    c = FakeRequest("c", range(12))
    pool.update_block_hashes(c)
    assert pool.get_computed_blocks(c).block_ids == tuple(blocks[:2])


def test_pool_stops_the_lower_walk_at_a_block_the_device_holds():
    tier = HostTier(8)
    pool = BlockPool(8, 4, lower_tier=tier)
    req = FakeRequest("r", range(17))
    pool.update_block_hashes(req)
    tier.evicted(0, req.block_hashes[0])
    tier.evicted(1, req.block_hashes[2])
    tier.take_transfers()
    other = FakeRequest("o", range(17))
    admit(pool, other)  # the device holds all four blocks now
    pool.reset_prefix_cache()
    assert pool.get_computed_blocks(req).lower_slots == (0,)


def test_requests_that_skip_the_cache_never_look_in_the_host_tier():
    tier = HostTier(8)
    pool = BlockPool(8, 4, lower_tier=tier)
    req = FakeRequest("r", range(9), reads_prefix_cache=False)
    pool.update_block_hashes(req)
    tier.evicted(0, req.block_hashes[0])
    assert pool.get_computed_blocks(req).num_computed_tokens == 0


def test_a_host_tier_needs_prefix_caching():
    with pytest.raises(ValueError, match="prefix caching"):
        BlockPool(8, 4, enable_prefix_caching=False, lower_tier=HostTier(2))


# -- the scheduler with a host tier, against a simulated KV cache ------------


class TieredHarness(Harness):
    def __init__(self, num_slots: int, policy: str = "lru", **config) -> None:
        super().__init__(**config)
        self.tier = HostTier(num_slots, policy, block_bytes=64)
        self.sched = Scheduler(self.sched.config, kv_tiers=KvTierManager(self.tier, self.sched.config.block_size))
        self.sched.lora_ids.update({1, 2, 3})
        self.ex = TieredFakeExecutor(self.sched.config.num_blocks, self.sched.config.block_size, num_slots)


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_multi_turn_chats_hit_the_host_tier_and_match_the_reference(policy):
    # 12 device blocks of 4 tokens; 6 conversations grow to ~40 tokens: the
    # prefixes outgrow the device and fit device + host.
    harness = TieredHarness(64, policy, num_blocks=12, max_num_seqs=3, max_num_batched_tokens=16)
    run_conversations(harness, 6, 5)
    stats = harness.sched.stats()
    device, host = stats.kv_tiers
    assert (device.tier, host.tier) == ("device", "host")
    assert host.hit_blocks_total > 0 and device.evicted_blocks_total > 0
    assert stats.kv_bytes_to_device_total == 64 * harness.tier.num_loaded_blocks > 0
    assert stats.kv_bytes_to_host_total == 64 * harness.tier.num_saved_blocks > 0
    # A baseline without the tier: fewer prefix-cache hits, same tokens (checked inside).
    baseline = Harness(num_blocks=12, max_num_seqs=3, max_num_batched_tokens=16)
    run_conversations(baseline, 6, 5)
    assert stats.prefix_cache_hits_total > baseline.sched.stats().prefix_cache_hits_total


@pytest.mark.parametrize("num_slots", [3, 8])
def test_one_step_may_save_load_and_reuse_the_same_blocks_and_slots(num_slots):
    # 4 device blocks of 4 tokens; a 13-token prompt fills them (3 cached + 1 partial).
    # Re-running "a" loads its 3 blocks into the blocks that held "b": those are
    # saved and loaded over in one step (saves must go first). With 3 host slots
    # the tier is full of the very slots "a" loads from: "b" must not take them.
    harness = TieredHarness(num_slots, num_blocks=4, max_num_seqs=1, max_num_batched_tokens=16)
    prompts = {"a": list(range(1, 14)), "b": list(range(20, 33))}
    for i, name in enumerate(["a", "b", "a", "b", "a"]):
        msg = harness.add(f"{name}{i}", prompts[name], max_tokens=1)
        harness.run()
        assert harness.tokens(msg.request_id) == reference(prompts[name], msg.sampling, (), 0, 64)[0]
    assert harness.tier.num_hit_blocks == (6 if num_slots == 3 else 9)  # "b" is dropped with 3 slots


def test_a_tiny_host_tier_under_pressure_stays_correct():
    # Far more blocks than slots, preemption in the mix: victims and reserved slots churn.
    harness = TieredHarness(5, "arc", num_blocks=10, max_num_seqs=4, max_num_batched_tokens=12)
    run_conversations(harness, 5, 4, seed=3)
    assert harness.tier.num_evicted_blocks > 0 and harness.tier.num_used_blocks <= 5
    assert harness.sched.stats().num_preempted_total > 0


def test_reset_prefix_cache_clears_the_host_tier_and_no_tier_means_no_tier_stats():
    harness = TieredHarness(32, num_blocks=8, max_num_seqs=2, max_num_batched_tokens=16)
    run_conversations(harness, 3, 2)
    assert harness.tier.num_used_blocks > 0
    harness.sched.reset_prefix_cache()
    assert harness.tier.num_used_blocks == 0
    assert Harness().sched.stats().kv_tiers == ()

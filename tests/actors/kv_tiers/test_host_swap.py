"""Unit tests of the host tier's swap-preemption slots (pure, fast).

A swapped-out request's slots are pinned: outside the prefix index and the
eviction policy, never hits, never victims, until `swap_in` loads them back
(they come free only once that step's transfers are taken) or `drop_swap`
/ `reset` unpins them.
"""

from __future__ import annotations

import pytest

from trillium.actors.kv_tiers.block_pool import hash_block_tokens
from trillium.actors.kv_tiers.host import HostTier


def h(i: int):
    return hash_block_tokens(None, [i], 0)


def test_swap_out_pins_slots_and_queues_saves_outside_the_index():
    tier = HostTier(4, block_bytes=10)
    assert tier.swap_out("r", [7, 3, 9])
    assert tier.num_swapped_blocks("r") == 3 and tier.swapped_request_ids() == ("r",)
    assert tier.num_pinned_blocks == 3 and tier.num_used_blocks == 3 and tier.num_free_blocks == 1
    assert tier.usage == 0.75
    t = tier.take_transfers()
    assert t.save_block_ids.tolist() == [7, 3, 9] and t.save_host_slots.tolist() == [0, 1, 2]
    assert tier.num_saved_blocks == 3 and tier.bytes_to_host == 30
    # Pinned slots are not cache entries: a cached block takes the one free slot,
    # and the next one evicts that cached block, never a pinned slot.
    tier.evicted(5, h(1))
    tier.evicted(6, h(2))
    assert h(1) not in tier and h(2) in tier and tier.num_evicted_blocks == 1
    assert tier.take_transfers().save_host_slots.tolist() == [3]
    with pytest.raises(RuntimeError, match="already swapped out"):
        tier.swap_out("r", [1])


def test_swap_out_evicts_cached_blocks_but_refuses_what_it_cannot_hold():
    tier = HostTier(4)
    for block, i in enumerate((1, 2, 3)):
        tier.evicted(block, h(i))
    tier.take_transfers()
    tier.reserve(tier.lookup([h(1)]))  # slot 0 loads this step: not evictable
    tier.load(0, 8)
    assert tier.can_swap_out(3) and not tier.can_swap_out(4)
    assert not tier.swap_out("big", [10, 11, 12, 13])  # changes nothing
    assert tier.num_used_blocks == 3 and tier.num_evicted_blocks == 0 and tier.num_pinned_blocks == 0
    assert not tier.swap_out("empty", [])
    assert tier.swap_out("r", [10, 11, 12])  # the free slot, then h(2)'s and h(3)'s (LRU)
    assert h(1) in tier and h(2) not in tier and h(3) not in tier and tier.num_evicted_blocks == 2
    t = tier.take_transfers()
    assert sorted(t.save_host_slots.tolist()) == [1, 2, 3] and t.load_host_slots.tolist() == [0]
    assert tier.match_prefix([h(1)]) == 1 and tier.num_hit_blocks == 1  # the swap was no hit


def test_swap_in_loads_in_order_and_frees_the_slots_only_after_the_step():
    tier = HostTier(3)
    assert tier.swap_out("r", [4, 5])
    tier.take_transfers()
    tier.swap_in("r", [8, 9])
    assert tier.num_swapped_blocks("r") == 0 and tier.num_pinned_blocks == 0
    # Same step: the slots being loaded must not take a save. Only slot 2 is free.
    tier.evicted(1, h(1))
    tier.evicted(2, h(2))  # evicts h(1) from slot 2, not a releasing slot
    t = tier.take_transfers()
    assert t.load_host_slots.tolist() == [0, 1] and t.load_block_ids.tolist() == [8, 9]
    assert t.save_host_slots.tolist() == [2] and t.save_block_ids.tolist() == [2]
    assert tier.num_hit_blocks == 0 and tier.num_loaded_blocks == 2
    tier.evicted(3, h(3))  # next step the swapped-in slots are free again
    tier.evicted(4, h(4))
    assert sorted(tier.take_transfers().save_host_slots.tolist()) == [0, 1]
    with pytest.raises(KeyError):
        tier.swap_in("r", [1, 2])
    assert tier.swap_out("s", [1])
    with pytest.raises(ValueError, match="1 blocks swapped out, 2 to load"):
        tier.swap_in("s", [1, 2])


def test_saves_still_queued_ride_with_the_loads_saves_first():
    # A swap-out whose plan ended empty: its saves wait for the next batch,
    # where the same request's loads run after them.
    tier = HostTier(2)
    assert tier.swap_out("r", [6, 7])
    tier.swap_in("r", [1, 6])
    t = tier.take_transfers()
    assert t.save_block_ids.tolist() == [6, 7] and t.save_host_slots.tolist() == [0, 1]
    assert t.load_host_slots.tolist() == [0, 1] and t.load_block_ids.tolist() == [1, 6]


def test_drop_swap_unpins_and_forgets_queued_saves():
    tier = HostTier(3)
    assert tier.swap_out("r", [4, 5])
    assert tier.drop_swap("r") == 2 and tier.drop_swap("r") == 0 and tier.drop_swap("unknown") == 0
    assert tier.num_used_blocks == 0 and tier.take_transfers().empty
    assert tier.swap_out("s", [1, 2, 3])  # every slot is free again


def test_reset_drops_swapped_slots_too():
    tier = HostTier(3)
    tier.evicted(0, h(1))
    assert tier.swap_out("r", [4])
    tier.take_transfers()
    assert tier.swap_out("s", [5])
    tier.swap_in("r", [9])
    assert tier.reset() == 1  # cached blocks dropped; swaps unpinned as well
    assert tier.num_used_blocks == 0 and tier.swapped_request_ids() == () and tier.take_transfers().empty
    assert tier.swap_out("t", [1, 2, 3])

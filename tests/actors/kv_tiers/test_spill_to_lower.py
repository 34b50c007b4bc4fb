"""A sleep that keeps the prefix cache (--sleep-keep-prefix-cache), pure and fast.

BlockPool.spill_cached_to_lower hands every cached device block to the host
tier, then forgets them on the device; the scheduler's EngineControl (driven
by the lifecycle suite's harness) carries the queued copies in the Sleep it
forwards, at level 1 with the flag only."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from trillium.actors.kv_tiers.block_pool import BlockPool
from trillium.actors.kv_tiers.host import HostTier
from trillium.actors.kv_tiers.manager import KvTierManager
from trillium.actors.protocol.lifecycle import Sleep, WakeUp
from trillium.actors.scheduler.control import EngineControl
from trillium.actors.scheduler.core import Scheduler, SchedulerConfig
from trillium.actors.scheduler.loop import SchedulerLoop
from trillium.config import EngineConfig

# WHY: tests/ subdirectories are not packages; reuse the pool suite's helpers
# and the lifecycle suite's harness.
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scheduler"))
from test_block_pool import FakeRequest, admit, check_invariants  # noqa: E402
from test_lifecycle import Harness  # noqa: E402


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


# -- the scheduler's side: the Sleep it forwards ------------------------------


class KeepHarness(Harness):
    def __init__(self, keep: bool) -> None:
        super().__init__()
        self.tier = HostTier(32)
        self.core = Scheduler(SchedulerConfig(num_blocks=64, block_size=4, max_model_len=128),
                              kv_tiers=KvTierManager(self.tier, 4))
        engine = EngineConfig.build(model="/models/m", num_blocks=64, block_size=4, max_model_len=128,
                                    num_host_blocks=32, sleep_keep_prefix_cache=keep)
        self.control = EngineControl(self.core, engine)
        self.loop = SchedulerLoop(self.core, self.control)


@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("level", [1, 2])
def test_sleep_spills_the_prefix_cache_only_at_level_1_with_the_flag(keep, level):
    h = KeepHarness(keep)
    h.add("a", prompt=tuple(range(1, 14)))  # 3 full blocks
    h.run_steps()
    assert h.core.pool.num_cached_blocks == 3
    h.send(Sleep("s", level=level))
    sent = h.executor[-1]
    kept = keep and level == 1
    assert sent.keep_prefix_cache is kept and len(sent.kv.save_block_ids) == (3 if kept else 0)
    assert sorted(sent.kv.save_host_slots.tolist()) == ([0, 1, 2] if kept else [])
    assert h.core.pool.num_cached_blocks == 0 and h.tier.num_used_blocks == (3 if kept else 0)
    h.answer(asleep=["kv_cache", "weights"])
    h.send(WakeUp("w"))
    h.answer(asleep=[])
    h.add("b", prompt=tuple(range(1, 14)))
    assert len(h.batch.kv.load_block_ids) == (3 if kept else 0)
    assert h.tier.num_hit_blocks == (3 if kept else 0)


def test_a_failed_sleep_resets_the_kept_host_tier():
    h = KeepHarness(True)
    h.add("a", prompt=tuple(range(1, 14)))
    h.run_steps()
    h.send(Sleep("s", level=1))
    assert h.tier.num_used_blocks == 3
    h.answer(status=500)
    assert h.replies["s"].status == 500 and h.tier.num_used_blocks == 0
    assert np.array_equal(h.tier.take_transfers().save_block_ids, np.zeros(0, np.int32))

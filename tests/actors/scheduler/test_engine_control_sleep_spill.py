"""A sleep that keeps the prefix cache (--sleep-keep-prefix-cache): the scheduler's side, pure and fast.

The scheduler's EngineControl (driven by the lifecycle suite's harness)
carries the host tier's queued copies in the Sleep it forwards, at level 1
with the flag only. The pool's side (BlockPool.spill_cached_to_lower) is
tests/actors/kv_tiers/test_spill_to_lower.py.

NOTE: `Harness` (the lifecycle suite's driver of the real SchedulerLoop) is
imported from test_engine_control.py in this folder, the one test module imported
by another; it belongs in tests/support once a suite outside this folder
needs it.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_engine_control import Harness

from trillium.actors.kv_tiers.host import HostTier
from trillium.actors.kv_tiers.manager import KvTierManager
from trillium.actors.protocol.admin import Sleep, WakeUp
from trillium.actors.scheduler.control import EngineControl
from trillium.actors.scheduler.core import Scheduler, SchedulerConfig
from trillium.actors.scheduler.loop import SchedulerLoop
from trillium.config import EngineConfig


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

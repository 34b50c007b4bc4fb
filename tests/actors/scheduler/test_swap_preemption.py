"""Swap preemption in the scheduler core, against a simulated KV cache (pure, fast).

support/fake_executor.py's fake executor writes a fingerprint of every token so
far into each computed slot and re-reads a request's whole context every
step; its TieredFakeExecutor also performs a batch's copies (saves,
then loads) on a simulated host memory. A swapped request resumed with a
wrong block, a slot reused too early or a save of an overwritten block
fails an assertion or changes its output (compared with a reference).
"""

from __future__ import annotations

import itertools
import random

import attrs
import pytest

from support.fake_executor import EOS, VOCAB, TieredFakeExecutor, reference
from support.scheduler_harness import Harness
from trillium.actors.kv_tiers.host import HostTier
from trillium.actors.kv_tiers.manager import KvTierManager
from trillium.actors.scheduler.core import Scheduler, SchedulerConfig
from trillium.actors.scheduler.request import RequestStatus


class SwapHarness(Harness):
    def __init__(self, num_slots: int = 64, preemption_mode: str = "swap", **config) -> None:
        super().__init__(**config)
        self.tier = HostTier(num_slots, block_bytes=8)
        config = attrs.evolve(self.sched.config, preemption_mode=preemption_mode)
        self.sched = Scheduler(config, kv_tiers=KvTierManager(self.tier, config.block_size))
        self.sched.lora_ids.update({1, 2, 3})
        self.ex = TieredFakeExecutor(config.num_blocks, config.block_size, num_slots)

    def resumed(self, rid):
        """(batch, NewRequestData) of every re-admission of `rid`."""
        return [(b, n) for b in self.batches for n in b.new_requests if n.request_id == rid][1:]


def check(h: Harness, msg, max_model_len: int = 64) -> None:
    expected, reason, _ = reference(msg.prompt_token_ids.tolist(), msg.sampling, (), msg.lora_id, max_model_len)
    assert h.tokens(msg.request_id) == expected and h.final(msg.request_id)[0] == reason


def start_two(h: Harness):
    """Three 4-token blocks: a (4-token prompt) and b (6) fill them in step 1;
    in step 2 a needs a block, and b (admitted last) is preempted, mid-block."""
    a = h.add("a", range(4), max_tokens=4)
    b = h.add("b", range(100, 106), max_tokens=6)
    h.step()
    second = h.step()
    assert second.preempted_request_ids == ("b",) and h.scheduled(second) == {"a": 1}
    assert h.sched.get_request("b").status is RequestStatus.PREEMPTED
    return a, b, second


def test_a_swapped_request_resumes_where_it_stopped():
    h = SwapHarness(num_blocks=3, max_num_batched_tokens=16, max_model_len=20)
    a, b, second = start_two(h)
    assert h.sched.get_request("b").num_computed_tokens == 6  # kept: its KV is on the host
    assert h.tier.num_swapped_blocks("b") == 2  # one full block, one partial
    # The saves ride in the step that preempted b: a writes into b's freed partial block.
    assert second.kv.save_host_slots.tolist() == [0, 1]
    assert second.kv.save_block_ids.tolist()[1] in h.sched.pool.block_ids("a")
    h.run()
    ((batch, new),) = h.resumed("b")
    assert new.num_computed_tokens == 6 and new.token_ids.tolist() == list(range(100, 106)) + h.tokens("b")[:1]
    assert len(new.block_ids) == 2  # its 6 computed tokens and the one it computes now
    assert batch.kv.load_block_ids.tolist() == new.block_ids.tolist()
    assert batch.kv.load_host_slots.tolist() == [0, 1]
    assert h.scheduled(batch)["b"] == 1  # a decode, not a recompute
    for msg in (a, b):
        check(h, msg, 20)
    stats = h.sched.stats()
    assert stats.num_preempted_total == 1 and stats.num_swapped_out_total == 1 and stats.num_swapped_in_total == 1
    assert h.tier.num_hit_blocks == 0 and h.tier.num_pinned_blocks == 0  # a swap is no prefix hit


def test_a_request_preempted_mid_prefill_resumes_its_prefill():
    h = SwapHarness(num_blocks=6, max_num_batched_tokens=6, max_model_len=24)
    a = h.add("a", range(1, 5), max_tokens=12)
    b = h.add("b", range(30, 48), max_tokens=2)  # 18 tokens: prefilled 2 + 6 + ...
    h.run()
    check(h, a, 24)
    check(h, b, 24)
    swapped = [n for _, n in h.resumed("b")] + [n for _, n in h.resumed("a")]
    assert swapped and all(n.num_computed_tokens > 0 for n in swapped)
    assert h.sched.stats().num_swapped_in_total == len(swapped)


def test_a_full_host_tier_falls_back_to_recompute():
    h = SwapHarness(num_slots=1, num_blocks=3, max_num_batched_tokens=16, max_model_len=20)
    a, b, _ = start_two(h)
    assert h.sched.get_request("b").num_computed_tokens == 0 and h.tier.num_pinned_blocks == 0
    h.run()
    check(h, a, 20)
    check(h, b, 20)
    stats = h.sched.stats()
    assert stats.num_preempted_total == 1 and stats.num_swapped_out_total == 0


@pytest.mark.parametrize("end", ["abort", "finish"])
def test_ending_a_swapped_request_unpins_its_slots(end):
    h = SwapHarness(num_blocks=3, max_num_batched_tokens=16, max_model_len=20)
    a, _, _ = start_two(h)
    assert h.tier.num_pinned_blocks == 2
    getattr(h.sched, end)(["b"])
    assert h.tier.num_pinned_blocks == 0 and h.tier.swapped_request_ids() == ()
    h.run()
    check(h, a, 20)
    assert "b" not in h.ex.states  # the executor was told to drop it


def test_a_prefix_cache_reset_makes_swapped_requests_recompute():
    h = SwapHarness(num_blocks=3, max_num_batched_tokens=16, max_model_len=20)
    a, b, _ = start_two(h)
    h.sched.reset_prefix_cache()
    assert h.sched.get_request("b").num_computed_tokens == 0 and h.tier.num_pinned_blocks == 0
    h.run()
    check(h, a, 20)
    check(h, b, 20)
    ((batch, new),) = h.resumed("b")
    assert new.num_computed_tokens == 0 and len(batch.kv.load_block_ids) == 0
    assert h.sched.stats().num_swapped_in_total == 0


def test_sleep_preemption_recomputes_and_drops_earlier_swaps():
    h = SwapHarness(num_blocks=3, max_num_batched_tokens=16, max_model_len=20)
    msgs = start_two(h)[:2]  # b swapped out
    assert h.sched.preempt_running() == 1  # a: by recompute, the cache is about to go
    assert [h.sched.get_request(r).num_computed_tokens for r in "ab"] == [0, 0]
    assert h.tier.num_pinned_blocks == 0
    stats = h.sched.stats()
    assert stats.num_preempted_total == 2 and stats.num_swapped_out_total == 1
    h.run()
    for msg in msgs:
        check(h, msg, 20)


def test_swap_needs_a_host_tier_and_a_known_mode():
    with pytest.raises(ValueError, match="needs one"):
        Scheduler(SchedulerConfig(num_blocks=8, preemption_mode="swap"))
    with pytest.raises(ValueError, match="preemption_mode"):
        SchedulerConfig(num_blocks=8, preemption_mode="migrate")
    sched = Scheduler(SchedulerConfig(num_blocks=8))
    assert sched.stats().num_swapped_out_total == 0 and sched.stats().num_swapped_in_total == 0


@pytest.mark.parametrize("seed, num_slots, overrides", [
    (0, 64, dict(policy="fcfs")),
    (1, 64, dict(policy="priority")),
    (2, 6, dict(policy="fcfs")),  # a small host tier: swaps, fallbacks and cached blocks evicted
    (3, 64, dict(policy="priority", long_prefill_token_threshold=6, max_num_seqs=3)),
    (4, 3, dict(policy="fcfs", block_size=8, num_blocks=6, max_num_seqs=8)),
])
def test_simulation_with_swaps_matches_the_reference(seed, num_slots, overrides):
    rng = random.Random(seed)
    config = dict(num_blocks=12, block_size=4, max_model_len=48, max_num_seqs=5, max_num_batched_tokens=16)
    config.update(overrides)
    h = SwapHarness(num_slots, **config)
    expected, ended, live, counter = {}, {}, [], itertools.count()
    prefixes = [[rng.randrange(1, VOCAB) for _ in range(rng.randrange(4, 13))] for _ in range(3)]
    for step in range(3000):
        if step < 150 and rng.random() < 0.5:
            prompt = rng.choice(prefixes) + [rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 9))]
            rid, lora_id = f"r{next(counter)}", rng.choice((0, 0, 1))
            msg = h.add(rid, prompt, eos=(EOS,), priority=rng.randrange(3), lora_id=lora_id,
                        max_tokens=rng.randrange(1, 17), ignore_eos=rng.random() < 0.5)
            expected[rid] = reference(prompt, msg.sampling, (EOS,), lora_id, 48)
            live.append(rid)
        if live and rng.random() < 0.04:
            victim = rng.choice(live)
            if h.sched.get_request(victim) is not None:
                ended[victim] = rng.choice(("abort", "stop"))
                (h.sched.abort if ended[victim] == "abort" else h.sched.finish)([victim])
        if rng.random() < 0.005:
            h.sched.reset_prefix_cache()
        h.step()
        for req in h.sched.waiting_requests():
            assert h.sched.pool.block_ids(req.request_id) == ()
            assert (req.num_computed_tokens > 0) == (h.tier.num_swapped_blocks(req.request_id) > 0)
        if step >= 150 and not h.sched.has_work():
            break
    h._collect(h.sched.take_pending_deltas())
    assert not h.sched.has_work() and h.tier.num_pinned_blocks == 0
    stats = h.sched.stats()
    assert stats.num_swapped_out_total > 0 and stats.num_swapped_in_total > 0
    for rid, (tokens, reason, _) in expected.items():
        if rid in ended:
            assert h.tokens(rid) == tokens[: len(h.tokens(rid))]
        else:
            assert h.tokens(rid) == tokens, rid
            assert h.final(rid)[0] == reason

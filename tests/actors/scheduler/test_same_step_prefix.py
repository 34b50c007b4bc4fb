"""Same-step prefix sharing: a block full of tokens scheduled this step is a prefix-cache hit for a
request admitted later in the same step (step_plan.py, BlockPool.cache_scheduled_blocks).

Mirrors vLLM v1, which registers a block's hash when its slots are allocated, before the step runs:
vllm/v1/core/single_type_kv_cache_manager.py `cache_blocks` called from
vllm/v1/core/kv_cache_manager.py `allocate_slots` (num_tokens_to_cache = computed + new tokens),
into vllm/v1/core/block_pool.py `cache_full_blocks`. Driven by the fake executor
(support/fake_executor.py), which writes every row of a step before any row reads, and checks each
read against the tokens the request holds: a hit on a block nobody computed fails.
"""

from __future__ import annotations

from support.fake_executor import reference
from support.scheduler_harness import AsyncHarness, Harness
from trillium.actors.kv_tiers.block_pool import BlockPool
from trillium.actors.scheduler.step_plan import StepPlan

PREFIX = list(range(1, 13))  # three 4-token blocks


def _expected(msg, lora_id=0, max_model_len=64):
    return reference(msg.prompt_token_ids.tolist(), msg.sampling, (), lora_id, max_model_len)[0]


def test_requests_admitted_together_compute_a_shared_prefix_once():
    h = Harness(max_num_batched_tokens=64)
    msgs = [h.add(f"r{i}", PREFIX + [20 + i, 30 + i], max_tokens=3) for i in range(3)]
    other = h.add("lora", PREFIX + [40], max_tokens=3, lora_id=1)  # adapters never share blocks
    first = h.step()
    assert [(n.request_id, n.num_computed_tokens) for n in first.new_requests] == [
        ("r0", 0), ("r1", 12), ("r2", 12), ("lora", 0)]
    assert h.scheduled(first) == {"r0": 14, "r1": 2, "r2": 2, "lora": 13}
    h.run()
    for msg in msgs:
        assert h.tokens(msg.request_id) == _expected(msg)
    assert h.tokens("lora") == _expected(other, lora_id=1)
    assert [h.deltas[m.request_id][0].num_cached_tokens for m in msgs] == [0, 12, 12]
    stats = h.sched.stats()
    assert stats.prefix_cache_hits_total == 24


def test_a_chunk_shares_only_its_full_blocks():
    # r0's first chunk is 10 tokens: blocks 0-1 are full of scheduled tokens, block 2 is not.
    h = Harness(max_num_batched_tokens=12, long_prefill_token_threshold=10)
    msgs = [h.add(f"r{i}", PREFIX + [20 + i], max_tokens=2) for i in range(2)]
    first = h.step()
    assert [(n.request_id, n.num_computed_tokens) for n in first.new_requests] == [("r0", 0), ("r1", 8)]
    assert h.scheduled(first) == {"r0": 10, "r1": 2}
    h.run()
    for msg in msgs:
        assert h.tokens(msg.request_id) == _expected(msg)


def test_prompt_logprobs_never_read_blocks_shared_in_the_step():
    h = Harness(max_num_batched_tokens=64)
    h.add("a", PREFIX + [20], max_tokens=1)
    h.add("p", PREFIX + [21], max_tokens=1, prompt_logprobs=0)
    first = h.step()
    assert [(n.request_id, n.num_computed_tokens) for n in first.new_requests] == [("a", 0), ("p", 0)]


def test_async_scheduling_shares_in_the_step_and_with_the_step_in_flight():
    h = AsyncHarness(max_num_batched_tokens=64)
    msgs = [h.add(f"r{i}", PREFIX + [20 + i], max_tokens=4, ignore_eos=True) for i in range(2)]
    h.run()
    first = h.batches[0]
    assert [(n.request_id, n.num_computed_tokens) for n in first.new_requests] == [("r0", 0), ("r1", 12)]
    for msg in msgs:
        assert h.tokens(msg.request_id) == _expected(msg)


def test_a_request_preempted_while_planned_unregisters_the_blocks_it_did_not_compute():
    # The priority policy unschedules "a" (a prefill chunk that filled block 5 in this plan) so
    # "b" can grow: block 5's KV is never written, so it must not stay in the prefix cache.
    h = Harness(num_blocks=8, max_num_batched_tokens=16, max_model_len=40, policy="priority",
                long_prefill_token_threshold=5)
    a = h.add("a", range(1, 27), max_tokens=2, priority=5)
    h.step()
    b = h.add("b", range(30, 32), max_tokens=12, priority=0, ignore_eos=True)
    while not h.step().preempted_request_ids:
        pass
    request = h.sched.get_request("a")
    assert request.num_computed_tokens == 0
    assert h.sched.pool.match_prefix(request.block_hashes) == 5  # blocks 0-4: computed in earlier steps
    h.run()
    assert h.tokens("a") == _expected(a, max_model_len=40) and h.tokens("b") == _expected(b, max_model_len=40)


def test_plan_drop_forgets_only_what_its_add_registered():
    pool = BlockPool(8, 4)
    h = Harness()  # a Request built the scheduler's way
    h.add("x", PREFIX + [7], max_tokens=1)
    request = h.sched.get_request("x")
    plan = StepPlan(token_budget=64, pool=pool)
    blocks = pool.allocate_slots(request, 13)
    plan.add(request, 13, blocks, is_new=False)
    assert pool.match_prefix(request.block_hashes) == 3
    plan.drop(request)
    assert pool.match_prefix(request.block_hashes) == 0 and pool.num_cached_blocks == 0

"""Unit tests of the scheduler core, driven by a fake executor (pure, fast).

The fake executor (support/fake_executor.py) follows the ExecuteBatch contract and keeps a simulated KV
cache: every computed position writes a fingerprint of (LoRA id, all tokens
up to it) into its slot, every step re-reads a request's whole context from
its block table, and the sampled token is a function of the fingerprint it
read. A wrong block table, a bad prefix-cache hit or a block overwritten
while shared fails an assertion or changes the output, which is compared
with a reference generation that never sees the scheduler.
"""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from support.fake_executor import EOS, VOCAB, reference
from support.scheduler_harness import AsyncHarness, Harness, add_req
from trillium.actors.protocol.execute import BatchResult, PromptLogprobs, TokenLogprobs
from trillium.actors.scheduler.core import Scheduler, SchedulerConfig
from trillium.actors.scheduler.request import TRANSITIONS, RequestStatus

# -- budget, chunked prefill, decode ----------------------------------------


def test_token_budget_is_respected_and_new_requests_come_first():
    h = Harness(max_num_batched_tokens=16)
    for i, rid in enumerate("abc"):
        h.add(rid, range(100 * i, 100 * i + 10), max_tokens=3)
    assert h.scheduled(h.step()) == {"a": 10, "b": 6}
    second = h.step()
    assert [n.request_id for n in second.new_requests] == ["c"]
    assert h.scheduled(second) == {"c": 10, "a": 1, "b": 4}
    h.run()
    assert all(int(b.num_scheduled_tokens.sum()) <= 16 for b in h.batches)
    assert all(len(h.tokens(rid)) == 3 for rid in "abc")


def test_chunked_prefill_progresses_then_decodes():
    h = Harness(max_num_batched_tokens=16)
    msg = h.add("a", range(40), max_tokens=3)
    chunks = [h.scheduled(h.step())["a"] for _ in range(3)]
    assert chunks == [16, 16, 8]
    assert [b.cached.num_computed_tokens.tolist() for b in h.batches[1:]] == [[16], [32]]
    assert len(h.tokens("a")) == 1  # sampled only when the prompt's end was reached
    assert h.scheduled(h.step()) == {"a": 1}
    h.run()
    expected, reason, _ = reference(msg.prompt_token_ids.tolist(), msg.sampling, (), 0, 64)
    assert h.tokens("a") == expected and h.final("a") == (reason, None)


def test_long_prefill_threshold_caps_chunks():
    h = Harness(max_num_batched_tokens=32, long_prefill_token_threshold=8)
    h.add("a", range(20), max_tokens=2)
    assert [h.scheduled(h.step())["a"] for _ in range(4)] == [8, 8, 4, 1]


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget():
    h = Harness(max_num_batched_tokens=64, enable_chunked_prefill=False)
    h.add("a", range(40), max_tokens=2)
    h.add("b", range(100, 130), max_tokens=2)
    assert h.scheduled(h.step()) == {"a": 40}
    assert h.scheduled(h.step()) == {"b": 30, "a": 1}


def test_max_num_seqs_caps_running_requests():
    h = Harness(max_num_seqs=2)
    for rid in "abcde":
        h.add(rid, range(5), max_tokens=3)
    h.step()
    assert h.sched.num_running == 2 and h.sched.num_waiting == 3
    h.run()
    assert all(len(b.num_scheduled_tokens) <= 2 for b in h.batches)
    assert all(len(h.tokens(rid)) == 3 for rid in "abcde")


# -- preemption ------------------------------------------------------------


def test_preempted_request_resumes_with_all_its_tokens_and_finishes():
    h = Harness(num_blocks=5, max_num_batched_tokens=16, max_model_len=20)
    a = h.add("a", range(8), max_tokens=4)
    b = h.add("b", range(100, 108), max_tokens=4)
    assert h.scheduled(h.step()) == {"a": 8, "b": 8}
    second = h.step()  # a takes the last free block; b cannot grow and preempts itself
    assert h.scheduled(second) == {"a": 1}
    assert second.preempted_request_ids == ("b",)
    assert h.sched.get_request("b").status is RequestStatus.PREEMPTED
    assert h.sched.stats().num_preempted_total == 1
    h.run()
    resumed = [n for batch in h.batches[2:] for n in batch.new_requests if n.request_id == "b"]
    assert len(resumed) == 1
    assert resumed[0].token_ids.tolist() == list(range(100, 108)) + h.tokens("b")[:1]
    assert resumed[0].num_prompt_tokens == 8
    assert resumed[0].num_computed_tokens == 8  # its own prompt blocks, still cached
    for msg in (a, b):
        expected, reason, _ = reference(msg.prompt_token_ids.tolist(), msg.sampling, (), 0, 20)
        assert h.tokens(msg.request_id) == expected and h.final(msg.request_id)[0] == reason


def test_priority_preempts_the_worst_running_request_even_if_already_scheduled():
    h = Harness(num_blocks=5, max_num_batched_tokens=16, max_model_len=20, policy="priority")
    h.add("a", range(8), max_tokens=6, priority=5)
    h.step()
    h.add("b", range(100, 108), max_tokens=4, priority=0)
    assert h.scheduled(h.step()) == {"b": 8, "a": 1}
    third = h.step()  # a (scheduled first) is unscheduled so b can grow
    assert h.scheduled(third) == {"b": 1}
    assert third.preempted_request_ids == ("a",)
    h.run()
    assert len(h.tokens("a")) == 6 and len(h.tokens("b")) == 4


# -- policies --------------------------------------------------------------


def _admission_order(h: Harness) -> list[str]:
    return [n.request_id for b in h.batches for n in b.new_requests]


@pytest.mark.parametrize(
    "policy, expected", [("fcfs", ["a", "b", "c", "d"]), ("priority", ["b", "d", "c", "a"])]
)
def test_waiting_order_follows_the_policy(policy, expected):
    h = Harness(max_num_seqs=1, policy=policy)
    for rid, priority in [("a", 2), ("b", 0), ("c", 1), ("d", 0)]:
        h.add(rid, range(4), max_tokens=2, priority=priority)
    h.run()
    assert _admission_order(h) == expected


# -- abort, finish, reject -------------------------------------------------


def test_abort_frees_blocks_immediately_and_tells_the_executor():
    h = Harness(num_blocks=16)
    h.add("a", range(10), max_tokens=8)
    h.add("w", range(10), max_tokens=8)
    h.sched.abort(["w"])  # still waiting: never reached the executor
    (w_delta,) = h.sched.take_pending_deltas().deltas
    assert (w_delta.request_id, w_delta.finish_reason) == ("w", "abort")
    assert w_delta.spec is not None  # its first and only delta
    h.step()
    assert h.sched.pool.num_free_blocks == 16 - 3
    h.sched.abort(["a", "unknown"])
    assert h.sched.pool.num_free_blocks == 16
    assert not h.sched.has_work()
    (a_delta,) = h.sched.take_pending_deltas().deltas
    assert (a_delta.request_id, a_delta.finish_reason, a_delta.spec) == ("a", "abort", None)
    h.add("c", range(4), max_tokens=1)
    assert h.step().finished_request_ids == ("a",)


def test_abort_while_a_step_is_in_flight_drops_its_result():
    h = Harness()
    h.add("a", range(6), max_tokens=4)
    h.add("b", range(6), max_tokens=4, lora_id=1)
    batch = h.sched.schedule()
    h.sched.abort(["a"])
    deltas = h.sched.update_from_output(h.ex.execute(batch))
    assert [d.request_id for d in deltas.deltas] == ["b"]


def test_no_step_runs_more_adapters_than_lora_slots():
    h = Harness(max_loras=1)
    h.add("a1", range(6), max_tokens=3, lora_id=1)
    h.add("b2", range(8), max_tokens=3, lora_id=2)
    h.add("c1", range(5), max_tokens=3, lora_id=1)
    h.add("d0", range(7), max_tokens=3)
    lora_of = {"a1": 1, "b2": 2, "c1": 1, "d0": 0}
    first = h.step()
    # b2 waits for a slot; c1 (same adapter) and the base request go ahead of it.
    assert [n.request_id for n in first.new_requests] == ["a1", "c1", "d0"]
    while h.sched.has_work():
        batch = h.step()
        ids = [n.request_id for n in batch.new_requests] + list(batch.cached.request_ids)
        assert len({lora_of[r] for r in ids} - {0}) <= 1
    assert all(h.deltas[r][-1].finish_reason == "length" for r in lora_of)


def test_a_request_for_an_adapter_not_loaded_is_refused():
    h = Harness()
    with pytest.raises(ValueError, match="not loaded"):
        h.add("x", range(4), max_tokens=2, lora_id=9)


def test_finish_from_a_stop_string_ends_with_stop():
    h = Harness()
    h.add("a", range(6), max_tokens=10)
    h.step()
    h.step()
    h.sched.finish(["a"])
    (delta,) = h.sched.take_pending_deltas().deltas
    assert (delta.finish_reason, delta.new_token_ids) == ("stop", ())
    assert h.sched.pool.num_free_blocks == h.sched.pool.num_blocks


def test_requests_that_can_never_fit_are_rejected():
    sched = Scheduler(SchedulerConfig(num_blocks=2, block_size=4, max_model_len=16))
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add_request(add_req("a", range(10), max_tokens=7))
    with pytest.raises(ValueError, match="KV blocks"):
        sched.add_request(add_req("b", range(8), max_tokens=2))  # 9 KV tokens: 3 blocks
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add_request(add_req("c", range(16), max_tokens=None))
    with pytest.raises(ValueError, match="empty"):
        sched.add_request(add_req("d", [], max_tokens=1))
    sched.add_request(add_req("e", range(8), max_tokens=1))  # 8 KV tokens: exactly 2 blocks
    with pytest.raises(ValueError, match="duplicate"):
        sched.add_request(add_req("e", range(4), max_tokens=1))
    sched.reject("b", "too long")
    (delta,) = sched.take_pending_deltas().deltas
    assert (delta.request_id, delta.finish_reason, delta.stop_reason) == ("b", "abort", "too long")


# -- prefix cache and groups -----------------------------------------------


def test_group_siblings_wait_for_the_first_prefill_then_hit_the_cache():
    h = Harness(max_num_batched_tokens=64)
    for i in range(3):
        h.add(f"s{i}", range(10), max_tokens=3, group_id="g")
    h.add("other", range(50, 60), max_tokens=3)
    assert [n.request_id for n in h.step().new_requests] == ["s0", "other"]
    second = h.step()
    assert [(n.request_id, n.num_computed_tokens) for n in second.new_requests] == [("s1", 8), ("s2", 8)]
    h.run()
    assert h.deltas["s1"][0].num_cached_tokens == 8
    assert h.tokens("s0") == h.tokens("s1") == h.tokens("s2")
    stats = h.sched.stats()
    assert stats.prefix_cache_hits_total == 16 and stats.prefix_cache_queries_total == 40


def test_a_fully_cached_prompt_still_computes_its_last_block():
    h = Harness()
    h.add("a", range(12), max_tokens=1)
    h.run()
    h.add("b", range(12), max_tokens=1)
    batch = h.step()
    assert batch.new_requests[0].num_computed_tokens == 8
    assert h.scheduled(batch) == {"b": 4}
    assert h.tokens("a") == h.tokens("b")


def test_prompt_logprobs_skip_the_cache_and_accumulate_over_chunks():
    def entry(t):
        return TokenLogprobs(t, -1.0, 1, (), ())

    h = Harness(max_num_batched_tokens=8)
    h.add("warm", range(12), max_tokens=1)
    h.run()
    h.add("p", range(12), max_tokens=2, prompt_logprobs=0, logprobs=1)
    first = h.sched.schedule()
    assert first.new_requests[0].num_computed_tokens == 0
    result = h.ex.execute(first)
    chunk = PromptLogprobs("p", 1, tuple(entry(t) for t in range(1, 8)))
    h.sched.update_from_output(BatchResult(result.step_id, result.request_ids, result.sampled_token_ids,
                                           prompt_logprobs=(chunk,)))
    second = h.sched.schedule()
    result = h.ex.execute(second)
    chunk = PromptLogprobs("p", 8, tuple(entry(t) for t in range(8, 12)))
    sampled = TokenLogprobs(int(result.sampled_token_ids[0]), -0.5, 1, (), ())
    (delta,) = h.sched.update_from_output(BatchResult(
        result.step_id, result.request_ids, result.sampled_token_ids,
        logprobs={"p": sampled}, prompt_logprobs=(chunk,))).deltas
    assert delta.prompt_logprobs.start == 1
    assert [e.token_id for e in delta.prompt_logprobs.entries] == list(range(1, 12))
    assert delta.logprobs == (sampled,) and delta.spec is not None


# -- stop conditions -------------------------------------------------------


def scripted(outputs):
    return lambda state, h: outputs[state.num_output]


@pytest.mark.parametrize(
    "script, kw, expected, final",
    [
        ([5, 6, EOS, 7], dict(eos=(EOS,)), [5, 6, EOS], ("stop", None)),
        ([5, 6, EOS, 7], dict(eos=(EOS,), ignore_eos=True), [5, 6, EOS, 7], ("length", None)),
        ([5, 6, 7, 8], dict(eos=(EOS,), stop_token_ids=(6,)), [5, 6], ("stop", 6)),
        ([EOS, 6, EOS, 9], dict(eos=(EOS,), stop_token_ids=(6,), min_tokens=3), [EOS, 6, EOS], ("stop", None)),
        ([5, 6, 7, 8], dict(max_tokens=3), [5, 6, 7], ("length", None)),
        ([5, 6, 7, 8, 9, 10], dict(max_tokens=None), [5, 6, 7, 8], ("length", None)),  # max_model_len 12
    ],
)
@pytest.mark.parametrize("make", [Harness, AsyncHarness], ids=["sync", "async"])
def test_stop_conditions(script, kw, expected, final, make):
    h = make(token_fn=scripted(script), max_model_len=12)
    kw.setdefault("max_tokens", 4)
    h.add("a", range(8), **kw)
    h.run()
    assert h.tokens("a") == expected and h.final("a") == final
    assert h.sched.pool.num_free_blocks == h.sched.pool.num_blocks


def test_first_delta_carries_the_spec_later_ones_do_not():
    h = Harness()
    h.add("a", range(6), max_tokens=3, stop=("xyz",), skip_special_tokens=False)
    h.run()
    specs = [d.spec for d in h.deltas["a"]]
    assert specs[0].prompt_token_ids.tolist() == list(range(6)) and specs[0].stop == ("xyz",)
    assert specs[0].skip_special_tokens is False and specs[1:] == [None, None]
    assert all(d.num_prompt_tokens == 6 for d in h.deltas["a"])


def test_status_transition_table():
    finished = {s for s in RequestStatus if s.is_finished}
    assert {s.finish_reason for s in finished} == {"stop", "length", "abort"}
    assert all(not TRANSITIONS[s] for s in finished)
    assert RequestStatus.RUNNING not in TRANSITIONS[RequestStatus.RUNNING]
    assert RequestStatus.FINISHED_LENGTH not in TRANSITIONS[RequestStatus.WAITING]
    h = Harness()
    h.add("a", range(4))
    with pytest.raises(RuntimeError, match="illegal transition"):
        h.sched.get_request("a").set_status(RequestStatus.PREEMPTED)


def test_one_step_in_flight_at_a_time():
    h = Harness()
    h.add("a", range(4))
    batch = h.sched.schedule()
    with pytest.raises(RuntimeError, match="in flight"):
        h.sched.schedule()
    with pytest.raises(ValueError, match="in flight"):
        h.sched.update_from_output(BatchResult(batch.step_id + 1, (), np.zeros(0, np.int32)))


# -- simulation ------------------------------------------------------------


def check_invariants(sched: Scheduler, batch, config: SchedulerConfig) -> None:
    pool = sched.pool
    holders = [0] * pool.num_blocks
    for req in sched.running_requests():
        table = pool.block_ids(req.request_id)
        assert len(set(table)) == len(table), "a block twice in one table"
        assert len(table) * pool.block_size >= req.num_computed_tokens
        for b in table:
            holders[b] += 1
    for req in sched.waiting_requests():
        assert pool.block_ids(req.request_id) == () and req.num_computed_tokens == 0
    for b, num in enumerate(holders):
        assert pool.ref_count(b) == num
        assert num <= 1 or pool.is_cached(b), "an uncached block shared"
    assert pool.num_free_blocks == holders.count(0)
    assert pool.num_free_blocks + sum(1 for n in holders if n) == pool.num_blocks
    assert sched.num_running <= config.max_num_seqs
    if batch is not None:
        assert int(batch.num_scheduled_tokens.sum()) <= config.max_num_batched_tokens


@pytest.mark.parametrize(
    "seed, overrides",
    [
        (0, dict(policy="fcfs")),
        (1, dict(policy="priority")),
        (2, dict(policy="fcfs", enable_prefix_caching=False)),
        (3, dict(policy="priority", long_prefill_token_threshold=6, max_num_seqs=3)),
        (4, dict(policy="fcfs", enable_chunked_prefill=False, max_num_batched_tokens=48)),
        (5, dict(policy="priority", block_size=1, num_blocks=40)),
        (6, dict(policy="fcfs", block_size=8, num_blocks=6, max_num_seqs=8)),
    ],
)
@pytest.mark.parametrize("make", [Harness, AsyncHarness], ids=["sync", "async"])
def test_simulation_random_requests_tiny_pool(seed, overrides, make):
    """Async (scheduler/in_flight.py): the same exactness with a step planned ahead of each result."""
    rng = random.Random(seed)
    config = dict(num_blocks=12, block_size=4, max_model_len=48, max_num_seqs=5, max_num_batched_tokens=16)
    config.update(overrides)
    h = make(**config)
    cfg = h.sched.config
    prefixes = [[rng.randrange(1, VOCAB) for _ in range(rng.randrange(4, 13))] for _ in range(3)]
    expected: dict[str, tuple] = {}
    ended: dict[str, str] = {}  # aborted or stopped from outside (stop string)
    live: list[str] = []
    rid_counter = itertools.count()

    def new_request():
        prompt = rng.choice(prefixes) + [rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 9))]
        kw = dict(
            max_tokens=rng.randrange(1, 17), min_tokens=0, ignore_eos=rng.random() < 0.3,
            stop_token_ids=(rng.randrange(1, VOCAB),) if rng.random() < 0.3 else (),
        )
        kw["min_tokens"] = rng.randrange(0, kw["max_tokens"] + 1) if rng.random() < 0.3 else 0
        lora_id = rng.choice((0, 0, 1))
        n = rng.choice((1, 1, 1, 2, 3))
        group = f"g{next(rid_counter)}" if n > 1 else None
        for _ in range(n):
            rid = f"r{next(rid_counter)}"
            msg = h.add(rid, prompt, eos=(EOS,), priority=rng.randrange(3), group_id=group,
                        lora_id=lora_id, **kw)
            expected[rid] = reference(prompt, msg.sampling, (EOS,), lora_id, cfg.max_model_len)
            live.append(rid)

    for step in range(3000):
        if step < 150 and rng.random() < 0.5:
            new_request()
        if live and rng.random() < 0.04:
            victim = rng.choice(live)
            if h.sched.get_request(victim) is not None:
                if rng.random() < 0.5:
                    ended[victim] = "abort"
                    h.sched.abort([victim])
                else:
                    ended[victim] = "stop"
                    h.sched.finish([victim])
        batch = h.step()
        check_invariants(h.sched, batch, cfg)
        if step >= 150 and not h.sched.has_work() and not getattr(h, "in_flight", ()):
            break
    h._collect(h.sched.take_pending_deltas())
    if make is AsyncHarness:
        assert h.num_ahead > 50  # steps really were planned ahead
    assert not h.sched.has_work()
    assert h.sched.pool.num_free_blocks == cfg.num_blocks
    assert h.sched.stats().num_preempted_total > 0  # the pool is small enough to preempt
    for rid, (tokens, reason, stop_reason) in expected.items():
        deltas = h.deltas[rid]
        assert sum(d.spec is not None for d in deltas) == 1 and deltas[0].spec is not None
        assert [d.finish_reason is not None for d in deltas] == [False] * (len(deltas) - 1) + [True]
        if rid in ended:
            assert deltas[-1].finish_reason == ended[rid]
            assert h.tokens(rid) == tokens[: len(h.tokens(rid))]
        else:
            assert h.tokens(rid) == tokens, rid
            assert h.final(rid) == (reason, stop_reason)
    # The executor was told to drop every request it had seen.
    assert h.ex.states.keys() <= {rid for rid in expected if h.sched.get_request(rid) is None}

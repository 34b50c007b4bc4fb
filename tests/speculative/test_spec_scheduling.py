"""Speculative decoding in the scheduler core and /metrics: draft budget in the step,
rollback of rejected drafts' KV (num_computed_tokens and blocks), stop rules inside an
accepted run, exact counters, and the vLLM-named series (vllm/v1/spec_decode/metrics.py)."""

from __future__ import annotations

import numpy as np
from prometheus_client import CollectorRegistry

from support.scheduler_harness import add_req
from trillium.actors.protocol.execute import BatchResult
from trillium.actors.protocol.outputs import SchedulerStats
from trillium.actors.scheduler.core import Scheduler, SchedulerConfig
from trillium.observability.metrics import EngineMetrics, render
from trillium.speculative.scheduling import DraftBudget


def _sched(k: int = 3, disable_by_batch_size: int = 0) -> Scheduler:
    config = SchedulerConfig(num_blocks=16, block_size=4, max_model_len=64, max_num_batched_tokens=32)
    return Scheduler(config, drafts=DraftBudget(k, disable_by_batch_size))


def _result(batch, tokens, *, more=None, accepted=None, proposed=None) -> BatchResult:
    return BatchResult(step_id=batch.step_id, request_ids=tuple(tokens), sampled_token_ids=np.asarray(
        list(tokens.values()), np.int32), more_token_ids=more or {}, num_accepted_drafts=accepted or {},
        proposed_drafts=proposed or {})


def test_drafts_are_scheduled_verified_and_rolled_back():
    sched = _sched()
    sched.add_request(add_req("a", range(10, 16), max_tokens=20))  # 6 prompt tokens
    first = sched.schedule()
    sched.update_from_output(_result(first, {"a": 30}, proposed={"a": 3}))
    request = sched.get_request("a")
    assert request.num_tokens == 7 and request.num_computed_tokens == 6

    second = sched.schedule()
    assert second.num_scheduled_tokens.tolist() == [4] and second.num_draft_tokens.tolist() == [3]
    assert len(sched.pool.block_ids("a")) == 3  # 6 + 1 + 3 = 10 positions: 3 blocks of 4
    # One draft accepted, then the correction: 2 tokens, KV valid for all but the last.
    deltas = sched.update_from_output(_result(second, {"a": 31}, more={"a": (32,)}, accepted={"a": 1}))
    assert deltas.deltas[0].new_token_ids == (31, 32)
    assert request.num_tokens == 9 and request.num_computed_tokens == 8
    assert len(sched.pool.block_ids("a")) == 2  # the block of rejected drafts only is freed
    assert request.num_proposed_drafts == 0  # none proposed this time: a plain decode next

    third = sched.schedule()
    assert third.num_scheduled_tokens.tolist() == [1] and len(third.num_draft_tokens) == 0
    assert third.cached.num_computed_tokens.tolist() == [8]
    stats = sched.stats()
    assert (stats.spec_decode_num_drafts_total, stats.spec_decode_num_draft_tokens_total,
            stats.spec_decode_num_accepted_tokens_total) == (1, 3, 1)
    assert stats.spec_decode_num_accepted_tokens_per_pos_total == (1, 0, 0)
    assert stats.spec_decode_mean_acceptance_length == 2.0
    assert stats.num_generation_tokens == 3


def test_stop_inside_an_accepted_run_truncates_it():
    sched = _sched()
    sched.add_request(add_req("a", range(10, 16), eos=(99,), max_tokens=20))
    first = sched.schedule()
    sched.update_from_output(_result(first, {"a": 30}, proposed={"a": 3}))
    second = sched.schedule()
    deltas = sched.update_from_output(_result(second, {"a": 31}, more={"a": (99, 33, 34)}, accepted={"a": 3}))
    assert deltas.deltas[0].new_token_ids == (31, 99) and deltas.deltas[0].finish_reason == "stop"
    assert sched.get_request("a") is None and sched.pool.num_free_blocks == 16


def test_drafts_never_pass_max_tokens():
    sched = _sched(k=4)
    sched.add_request(add_req("a", range(10, 16), max_tokens=3))
    first = sched.schedule()
    sched.update_from_output(_result(first, {"a": 30}, proposed={"a": 4}))
    second = sched.schedule()
    assert second.num_draft_tokens.tolist() == [1]  # 2 tokens left: 1 draft + 1 more
    deltas = sched.update_from_output(_result(second, {"a": 31}, more={"a": (32,)}, accepted={"a": 1}))
    assert deltas.deltas[0].new_token_ids == (31, 32) and deltas.deltas[0].finish_reason == "length"


def test_preemption_drops_the_drafts():
    sched = _sched()
    sched.add_request(add_req("a", range(10, 16), max_tokens=20))
    first = sched.schedule()
    sched.update_from_output(_result(first, {"a": 30}, proposed={"a": 3}))
    assert sched.preempt_running() == 1
    again = sched.schedule()  # resumed as new: recompute, no drafts
    assert [n.request_id for n in again.new_requests] == ["a"] and len(again.num_draft_tokens) == 0


def test_disable_by_batch_size_verifies_no_drafts_while_more_requests_run():
    sched = _sched(disable_by_batch_size=2)
    sched.add_request(add_req("a", range(10, 16), max_tokens=2))
    sched.add_request(add_req("b", range(20, 26), max_tokens=20))
    sched.add_request(add_req("c", range(30, 36), max_tokens=20))
    first = sched.schedule()  # planned with none running, admits 3: the executor should not propose
    assert first.num_scheduled_tokens.tolist() == [6, 6, 6] and not first.propose_drafts
    # Even drafts the executor holds are not verified while 3 run (more than 2).
    sched.update_from_output(_result(first, {"a": 30, "b": 40, "c": 50}, proposed={"a": 3, "b": 3, "c": 3}))
    second = sched.schedule()
    assert second.num_scheduled_tokens.tolist() == [1, 1, 1] and len(second.num_draft_tokens) == 0
    assert not second.propose_drafts and sched.stats().spec_decode_num_steps_disabled_by_batch_size_total == 1
    deltas = sched.update_from_output(_result(second, {"a": 31, "b": 41, "c": 51}, proposed={"b": 3, "c": 3}))
    assert deltas.deltas[0].finish_reason == "length"  # a is done: 2 left, within the threshold
    third = sched.schedule()
    assert third.num_draft_tokens.tolist() == [3, 3] and third.propose_drafts
    stats = sched.stats()
    assert stats.spec_decode_num_steps_disabled_by_batch_size_total == 1
    assert sched.get_request("b").num_proposed_drafts == 3  # counted when verified, not before
    sched.update_from_output(_result(third, {"b": 42, "c": 52}, accepted={"b": 0, "c": 0}))
    assert sched.stats().spec_decode_num_draft_tokens_total == 6


def test_metrics_series_use_vllm_names():
    stats = SchedulerStats(step_id=1, num_running=0, num_waiting=0, num_preempted_total=0, kv_usage=0.0,
                           num_free_blocks=1, prefix_cache_queries_total=0, prefix_cache_hits_total=0,
                           num_scheduled_tokens=0, spec_decode_num_drafts_total=5,
                           spec_decode_num_draft_tokens_total=15, spec_decode_num_accepted_tokens_total=7,
                           spec_decode_num_accepted_tokens_per_pos_total=(4, 2, 1),
                           spec_decode_num_steps_disabled_by_batch_size_total=9)
    registry = CollectorRegistry()
    EngineMetrics(registry, "m", lambda: stats)
    text = render(registry).decode()
    for line in ('trillium:spec_decode_num_drafts_total{model_name="m"} 5.0',
                 'trillium:spec_decode_num_draft_tokens_total{model_name="m"} 15.0',
                 'trillium:spec_decode_num_accepted_tokens_total{model_name="m"} 7.0',
                 'trillium:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 4.0',
                 'trillium:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="2"} 1.0',
                 'trillium:spec_decode_num_steps_disabled_by_batch_size_total{model_name="m"} 9.0'):
        assert line in text, line

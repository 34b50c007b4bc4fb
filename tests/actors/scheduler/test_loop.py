"""The scheduler loop's ordering rules, one test each (scheduler/loop.py).

Driven as the actor drives it: `handle(message)` per message and
`before_wait()` before each wait; each test checks the exact order of the
sends that come out, so it fails if the order changes.
"""

from __future__ import annotations

import pytest

from trillium.actors.protocol.supervision import Shutdown
from trillium.actors.protocol.execute import ExecuteBatch, ExecutorFailed
from trillium.actors.protocol.admin import ControlReply, GetEngineInfo, Pause, Sleep
from trillium.actors.protocol.outputs import SchedulerStats, TokenDeltas
from trillium.actors.protocol.requests import AbortRequest, FinishRequest
from trillium.actors.scheduler.loop import EngineStopped, Peer

from support.scheduler_loop import add_request, build_loop, fake_result

E, D, A = Peer.EXECUTOR, Peer.DETOKENIZER, Peer.API


def shape(sends) -> list[tuple[Peer, type]]:
    return [(send.to, type(send.message)) for send in sends]


def started(*rids):
    """A loop with `rids` added and their first step out on the executor."""
    loop = build_loop()
    for rid in rids:
        assert loop.handle(add_request(rid), 0.0) == []
    sends = loop.before_wait(0.0)
    assert shape(sends) == [(E, ExecuteBatch)]
    return loop, sends[0].message


def test_the_next_batch_goes_out_before_the_last_steps_deltas_and_stats():
    loop, batch = started("a")
    assert loop.handle(fake_result(loop.core, batch), 0.0) == [], "held back until the next step is out"
    sends = loop.before_wait(0.0)
    assert shape(sends) == [(E, ExecuteBatch), (D, TokenDeltas), (A, SchedulerStats)]
    assert sends[0].message.step_id == batch.step_id + 1
    assert sends[1].message.step_id == batch.step_id
    assert sends[1].message.deltas[0].new_token_ids == (9,)


@pytest.mark.parametrize("ending, reason", [(AbortRequest, "abort"), (FinishRequest, "stop")])
def test_held_step_tokens_reach_the_detokenizer_before_the_delta_that_ends_the_request(ending, reason):
    loop, batch = started("a")
    loop.handle(fake_result(loop.core, batch), 0.0)
    assert loop.handle(ending(request_ids=("a",)), 0.0) == []
    sends = loop.before_wait(0.0)
    assert shape(sends) == [(D, TokenDeltas), (A, SchedulerStats), (D, TokenDeltas), (A, SchedulerStats)]
    step, ended = sends[0].message.deltas[0], sends[2].message.deltas[0]
    assert step.new_token_ids == (9,) and step.finish_reason is None
    assert ended.request_id == "a" and ended.new_token_ids == () and ended.finish_reason == reason


def test_before_a_control_reply_held_outputs_then_pending_deltas_then_fresh_stats():
    loop, batch = started("a", "b")
    loop.handle(fake_result(loop.core, batch), 0.0)
    loop.handle(AbortRequest(request_ids=("b",)), 0.0)
    sends = loop.handle(GetEngineInfo("i"), 0.0)
    assert shape(sends) == [
        (D, TokenDeltas), (A, SchedulerStats), (D, TokenDeltas), (A, SchedulerStats), (A, ControlReply),
    ]
    assert sends[0].message.step_id == batch.step_id and len(sends[0].message.deltas) == 2
    assert sends[2].message.deltas[0].request_id == "b" and sends[2].message.deltas[0].finish_reason == "abort"
    assert sends[3].message.num_running == 1, "stats taken after the abort"
    assert sends[4].message.command_id == "i"
    assert loop.before_wait(0.0)[0].to is E, "nothing left to send before the next step"


def test_a_reply_from_the_executor_idle_hook_also_comes_after_fresh_stats():
    loop, batch = started("a")
    assert loop.handle(Pause("p", mode="keep"), 0.0) == [], "answers once the step in flight is done"
    loop.handle(fake_result(loop.core, batch), 0.0)
    sends = loop.before_wait(0.0)
    # The held step's outputs, fresh stats and the reply; then, paused, the idle stats.
    assert shape(sends) == [(D, TokenDeltas), (A, SchedulerStats), (A, SchedulerStats), (A, ControlReply),
                            (A, SchedulerStats)]
    assert sends[2].message.engine_state == "paused"
    assert sends[3].message.command_id == "p"


def test_going_idle_sends_stats():
    loop = build_loop()
    sends = loop.before_wait(0.0)
    assert shape(sends) == [(A, SchedulerStats)]
    loop, batch = started("a")
    assert loop.before_wait(0.0) == [], "a step is in flight: not idle, nothing to send"
    loop.handle(AbortRequest(request_ids=("a",)), 0.0)
    loop.handle(fake_result(loop.core, batch), 0.0)
    sends = loop.before_wait(0.0)
    # The step's (empty) outputs: stats only; the abort delta; then idle: stats.
    assert shape(sends) == [(A, SchedulerStats), (D, TokenDeltas), (A, SchedulerStats)]
    assert sends[1].message.deltas[0].finish_reason == "abort"
    assert sends[2].message.num_running == 0, "the idle stats show the request gone"


def test_a_control_job_goes_to_the_executor_instead_of_a_step():
    loop = build_loop()
    loop.handle(add_request("a"), 0.0)
    loop.handle(Sleep("s", level=1, mode="keep"), 0.0)
    sends = loop.before_wait(0.0)
    assert shape(sends) == [(E, Sleep)] and not loop.step_in_flight
    assert loop.before_wait(0.0) == [], "the job is out: nothing else goes to the executor"


def test_step_in_flight_is_the_cores():
    loop, batch = started("a")
    assert loop.step_in_flight and loop.core.step_in_flight
    loop.handle(fake_result(loop.core, batch), 0.0)
    assert not loop.step_in_flight and not loop.core.step_in_flight


def test_the_mailbox_depth_is_reported_in_stats():
    loop = build_loop()
    loop.mailbox_drained(3)
    assert loop.before_wait(0.0)[0].message.mailbox_depth == 3


def test_executor_failed_raises():
    loop, batch = started("a")
    with pytest.raises(EngineStopped, match="step 0: boom"):
        loop.handle(ExecutorFailed(step_id=batch.step_id, error="boom"), 0.0)


def test_shutdown_stops_the_loop_and_sends_nothing():
    loop = build_loop()
    assert not loop.stopped
    assert loop.handle(Shutdown(), 0.0) == []
    assert loop.stopped


def _sampled(batch: ExecuteBatch, token: int):
    """Every request of `batch` sampled `token` (short prompts: one chunk each)."""
    import numpy as np

    from trillium.actors.protocol.execute import BatchResult

    ids = [n.request_id for n in batch.new_requests] + list(batch.cached.request_ids)
    return BatchResult(batch.step_id, tuple(ids), np.full(len(ids), token, np.int32))


def test_async_scheduling_plans_a_step_ahead_and_never_past_max_tokens():
    """--async-scheduling (scheduler/in_flight.py; vLLM's AsyncScheduler): step 1 goes out with
    step 0, decoding the token step 0 will sample; each result brings the next step out first."""
    loop = build_loop(async_scheduling=True)
    loop.handle(add_request("a"), 0.0)  # max_tokens=3
    sends = loop.before_wait(0.0)
    assert shape(sends) == [(E, ExecuteBatch), (E, ExecuteBatch)]
    first, second = (s.message for s in sends)
    assert second.cached.request_ids == ("a",) and second.num_scheduled_tokens.tolist() == [1]
    loop.handle(_sampled(first, 9), 0.0)
    sends = loop.before_wait(0.0)
    assert shape(sends) == [(E, ExecuteBatch), (D, TokenDeltas), (A, SchedulerStats)]
    third = sends[0].message
    loop.handle(_sampled(second, 10), 0.0)
    # Two outputs and one placeholder reach max_tokens: nothing more is planned for it.
    assert shape(loop.before_wait(0.0)) == [(D, TokenDeltas), (A, SchedulerStats)]
    loop.handle(_sampled(third, 11), 0.0)
    sends = loop.before_wait(0.0)
    deltas = [s.message for s in sends if isinstance(s.message, TokenDeltas)]
    assert (E, ExecuteBatch) not in shape(sends)
    assert deltas[-1].deltas[0].new_token_ids == (11,) and deltas[-1].deltas[0].finish_reason == "length"


def test_unset_async_scheduling_plans_ahead_only_while_few_requests_run():
    """The unset flag's limit (config.py ASYNC_AUTO_MAX_RUNNING, here 1): with one request running
    the next step goes out with the one in flight; with two, each step waits for the last result;
    when one finishes, planning ahead resumes."""
    from trillium.sampling_params import SamplingParams

    loop = build_loop(async_scheduling=True, async_max_running=1)
    loop.handle(add_request("a", params=SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)), 0.0)
    first, second = (s.message for s in loop.before_wait(0.0))  # one running: planned ahead
    loop.handle(add_request("b", params=SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)), 0.0)
    loop.handle(_sampled(first, 9), 0.0)
    sends = loop.before_wait(0.0)
    third = [s.message for s in sends if isinstance(s.message, ExecuteBatch)]
    assert len(third) == 1 and "b" in [n.request_id for n in third[0].new_requests]  # admitted: two run
    loop.handle(_sampled(second, 10), 0.0)
    assert (E, ExecuteBatch) not in shape(loop.before_wait(0.0)), "two running: no second step out"
    steps = 0
    while loop.step_in_flight and steps < 10:  # b finishes after its 2 tokens
        batch = third[0]
        loop.handle(_sampled(batch, 11), 0.0)
        third = [s.message for s in loop.before_wait(0.0) if isinstance(s.message, ExecuteBatch)]
        steps += 1
        if len(third) == 2:  # b is done, a alone again: planned ahead once more
            break
        assert len(third) <= 1
    assert len(third) == 2 and all(b.cached.request_ids == ("a",) for b in third)


def test_async_scheduling_stops_planning_ahead_while_a_command_waits_for_the_executor():
    from trillium.sampling_params import SamplingParams

    loop = build_loop(async_scheduling=True)
    loop.handle(add_request("a", params=SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)), 0.0)
    first, second = (s.message for s in loop.before_wait(0.0))
    loop.handle(Sleep("s", level=1, mode="keep"), 0.0)
    loop.handle(_sampled(first, 9), 0.0)
    assert (E, ExecuteBatch) not in shape(loop.before_wait(0.0)), "the steps out drain first"
    loop.handle(_sampled(second, 10), 0.0)
    sends = loop.before_wait(0.0)
    assert shape(sends)[0] == (E, Sleep) and not loop.step_in_flight


def _ahead(batch: ExecuteBatch, *tokens: int, logprobs=None):
    """The executor's AheadTokens for request "a" of a multi-step `batch`: `tokens` sampled."""
    import numpy as np

    from trillium.actors.protocol.execute import AheadTokens

    return AheadTokens(batch.step_id, ("a",), np.asarray([tokens], np.int32), logprobs or {})


def _multi_step_result(batch: ExecuteBatch, first: int, *more: int):
    import numpy as np

    from trillium.actors.protocol.execute import BatchResult

    return BatchResult(batch.step_id, ("a",), np.asarray([first], np.int32), more_token_ids={"a": more})


def _token_deltas(sends) -> list[tuple[int, ...]]:
    return [d.new_token_ids for s in sends if isinstance(s.message, TokenDeltas) for d in s.message.deltas]


def test_ahead_tokens_go_out_behind_held_outputs_without_stats_and_the_result_sends_the_rest():
    """Rule 6 (scheduler/multi_step.py): a multi-step step's AheadTokens reach the detokenizer as
    they come, with no stats; its result then sends only the tokens past them; AheadTokens of a
    step that already returned are dropped (its result carried those tokens)."""
    from trillium.sampling_params import SamplingParams

    loop = build_loop(num_scheduler_steps=4)
    loop.handle(add_request("a", params=SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)), 0.0)
    prefill = loop.before_wait(0.0)[0].message
    loop.handle(fake_result(loop.core, prefill, token=9), 0.0)
    sends = loop.before_wait(0.0)
    multi = sends[0].message
    assert multi.num_draft_tokens.tolist() == [3], "a decode step of 4 forwards"
    assert _token_deltas(sends) == [(9,)]
    assert loop.handle(_ahead(multi, 10), 0.0) == []
    assert shape(sends := loop.before_wait(0.0)) == [(D, TokenDeltas)] and _token_deltas(sends) == [(10,)]
    loop.handle(_ahead(multi, 11), 0.0)
    loop.handle(_multi_step_result(multi, 10, 11, 12, 13), 0.0)  # overtook the last AheadTokens
    loop.handle(_ahead(multi, 12), 0.0)  # late: dropped
    sends = loop.before_wait(0.0)
    assert shape(sends) == [(E, ExecuteBatch), (D, TokenDeltas), (D, TokenDeltas), (A, SchedulerStats)]
    assert _token_deltas(sends) == [(11,), (12, 13)]
    assert list(loop.core.get_request("a").output_token_ids) == [9, 10, 11, 12, 13]


def test_a_stream_interval_holds_tokens_after_the_first_until_enough_wait_or_the_request_ends():
    """--stream-interval 3 (vLLM's v1/engine/output_processor.py RequestState.make_request_output
    rule): the first token at once, then deltas of 3; the end flushes what is held, an abort too."""
    from trillium.sampling_params import SamplingParams

    loop = build_loop(stream_interval=3)
    loop.handle(add_request("a", params=SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)), 0.0)
    loop.handle(add_request("b", params=SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)), 0.0)
    batch = loop.before_wait(0.0)[0].message
    seen = {"a": [], "b": []}
    for token in range(10, 18):
        loop.handle(_sampled(batch, token), 0.0)
        sends = loop.before_wait(0.0)
        for d in (d for s in sends if isinstance(s.message, TokenDeltas) for d in s.message.deltas):
            seen[d.request_id].append((d.new_token_ids, d.finish_reason))
        batch = next(s.message for s in sends if isinstance(s.message, ExecuteBatch))
    assert seen["a"] == [((10,), None), ((11, 12, 13), None), ((14, 15, 16), "length")]
    assert seen["b"] == [((10,), None), ((11, 12, 13), None), ((14, 15, 16), None)], "17 is held"
    loop.handle(AbortRequest(request_ids=("b",)), 0.0)
    ended = [(d.new_token_ids, d.finish_reason) for s in loop.before_wait(0.0)
             if isinstance(s.message, TokenDeltas) for d in s.message.deltas]
    assert ended == [((17,), "abort")]


def _run_tokens(loop, tokens) -> dict[str, list]:
    """Feed every running request each of `tokens` in turn; each request's deltas (ids, finish)."""
    batch = loop.before_wait(0.0)[0].message
    seen: dict[str, list] = {}
    for token in tokens:
        loop.handle(_sampled(batch, token), 0.0)
        sends = loop.before_wait(0.0)
        for d in (d for s in sends if isinstance(s.message, TokenDeltas) for d in s.message.deltas):
            seen.setdefault(d.request_id, []).append((d.new_token_ids, d.finish_reason))
        batch = next((s.message for s in sends if isinstance(s.message, ExecuteBatch)), None)
        if batch is None:
            break
    return seen


def test_a_final_only_request_sends_its_first_token_then_chunks_of_50_then_its_end():
    """SamplingParams.final_only (vLLM's output_kind=FINAL_ONLY, v1/engine/output_processor.py
    make_request_output; SGLang's scheduler_output_processor_mixin.py sends a request that does not
    stream every DEFAULT_FORCE_STREAM_INTERVAL = 50 tokens and when it finishes): the first token at
    once (the detokenizer registers the request, a traced request's first token time is kept), then
    chunks of 50 (a bound on a message's size) whatever the server's --stream-interval, and the end;
    an abort sends what is held. A final-only request with a stop string (matched in the
    detokenizer, which must see the tokens) keeps the stream interval."""
    from trillium.sampling_params import SamplingParams

    loop = build_loop(stream_interval=2)
    final = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True, final_only=True)
    loop.handle(add_request("a", params=final), 0.0)
    loop.handle(add_request("b", params=SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True,
                                                       final_only=True)), 0.0)
    loop.handle(add_request("s", params=SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True,
                                                       final_only=True, stop=("x",))), 0.0)
    seen = _run_tokens(loop, range(10, 70))
    assert seen["a"] == [((10,), None), ((11, 12, 13, 14, 15, 16), "length")]
    assert seen["b"] == [((10,), None), (tuple(range(11, 61)), None)], "61-69 held"
    assert seen["s"] == [((10,), None)] + [((t, t + 1), None) for t in range(11, 69, 2)]
    loop.handle(AbortRequest(request_ids=("b",)), 0.0)
    ended = [(d.new_token_ids, d.finish_reason) for s in loop.before_wait(0.0)
             if isinstance(s.message, TokenDeltas) for d in s.message.deltas]
    assert ended == [(tuple(range(61, 70)), "abort")]


@pytest.mark.parametrize("server, asked, chunk", [(1, 3, 3), (3, None, 3), (3, 2, 3), (2, 4, 4)])
def test_a_requests_stream_interval_is_at_least_the_servers(server, asked, chunk):
    """SamplingParams.stream_interval (SGLang's sampling_params.stream_interval; vLLM's
    SamplingParams.stream_interval, clamped as v1/engine/output_processor.py's
    RequestState.from_new_request clamps it: max(request, engine))."""
    from trillium.sampling_params import SamplingParams

    loop = build_loop(stream_interval=server)
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True, stream_interval=asked)
    loop.handle(add_request("a", params=params), 0.0)
    seen = _run_tokens(loop, range(10, 10 + 1 + 2 * chunk))
    assert [ids for ids, _ in seen["a"]] == [(10,), tuple(range(11, 11 + chunk)),
                                             tuple(range(11 + chunk, 11 + 2 * chunk))]


@pytest.mark.parametrize("stop", ["pause", "sleep"])
def test_held_tokens_go_out_when_the_engine_stops_stepping(stop):
    """Rule 4 with --stream-interval: tokens a request made and holds are sent when the engine
    pauses (the loop goes idle) or sleeps (its running requests are preempted), not kept until
    it steps again."""
    from trillium.sampling_params import SamplingParams

    loop = build_loop(stream_interval=8)
    loop.handle(add_request("a", params=SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)), 0.0)
    batch = loop.before_wait(0.0)[0].message
    for token in (10, 11, 12):  # 10 goes out as the first token; 11 and 12 wait for 6 more
        loop.handle(_sampled(batch, token), 0.0)
        if token == 12:
            loop.handle(Pause("p", mode="keep") if stop == "pause" else Sleep("s", level=1, mode="keep"), 0.0)
        sends = loop.before_wait(0.0)
        batch = next((s.message for s in sends if isinstance(s.message, ExecuteBatch)), None)
    deltas = [d.new_token_ids for s in sends if isinstance(s.message, TokenDeltas) for d in s.message.deltas]
    assert deltas[-1] == (11, 12) and not loop.step_in_flight

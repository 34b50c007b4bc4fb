"""The scheduler core's grammar gate (scheduler/grammar_gate.py), driven by calls.

A constrained request waits in the queue, skipped, until a BatchResult says
its grammar is compiled; the others run meanwhile. Its key rides in one
ExecuteBatch; with nothing else to run the core still sends an empty step
(the executor waits there for the compile); a failed compile aborts the
request naming the problem; an evicted grammar is compiled again.
(vLLM does the same in its scheduler: a request waits in
WAITING_FOR_FSM until its grammar future is done, vllm/v1/core/sched/scheduler.py.)
"""

from __future__ import annotations

import attrs

from support.scheduler_harness import Harness
from trillium.structured_outputs import StructuredOutputsParams

CHOICE = StructuredOutputsParams(choice=("a", "b"))


def _step(h: Harness, **grammar_fields):
    """One step; the fake executor's result carries `grammar_fields`."""
    h._collect(h.sched.take_pending_deltas())
    batch = h.sched.schedule()
    if batch is None:
        return None
    h.batches.append(batch)
    result = attrs.evolve(h.ex.execute(batch), **grammar_fields)
    h._collect(h.sched.update_from_output(result))
    return batch


def test_a_constrained_request_waits_for_its_grammar_without_blocking_others():
    h = Harness()
    h.add("g", [1, 2, 3], structured_outputs=CHOICE)
    h.add("free", [4, 5, 6])
    first = _step(h)
    assert first.compile_grammars == (CHOICE.key,)
    assert [r.request_id for r in first.new_requests] == ["free"]  # g skipped, free runs
    second = _step(h, grammars_ready=(CHOICE.key,))
    assert second.compile_grammars == ()  # asked once
    assert not any(r.request_id == "g" for r in second.new_requests)
    third = _step(h)
    assert [r.request_id for r in third.new_requests] == ["g"]
    h.run()
    assert len(h.tokens("g")) == 4 and len(h.tokens("free")) == 4


def test_with_nothing_else_to_run_empty_steps_poll_for_the_compile():
    h = Harness()
    h.add("g", [1, 2, 3], structured_outputs=CHOICE)
    polls = [_step(h), _step(h)]
    assert all(not b.new_requests and not b.cached.request_ids for b in polls)
    assert polls[0].compile_grammars == (CHOICE.key,) and polls[1].compile_grammars == ()
    _step(h, grammars_ready=(CHOICE.key,))
    batch = _step(h)
    assert [r.request_id for r in batch.new_requests] == ["g"]
    assert batch.new_requests[0].sampling.structured_outputs == CHOICE


def test_same_grammar_is_compiled_once_and_ready_grammars_admit_at_once():
    h = Harness()
    for i in range(3):
        h.add(f"g{i}", [1, 2, 3 + i], structured_outputs=attrs.evolve(CHOICE, activate_after=(9, 9 + i)))
    assert _step(h).compile_grammars == (CHOICE.key,)  # activate_after is not part of the key
    _step(h, grammars_ready=(CHOICE.key,))
    assert len(_step(h).new_requests) == 3
    h.add("late", [7, 8], structured_outputs=CHOICE)
    h.run()
    assert all(b.compile_grammars == () for b in h.batches[1:])
    assert len(h.tokens("late")) == 4


def test_a_failed_compile_aborts_the_waiting_requests_naming_it():
    h = Harness()
    h.add("g", [1, 2, 3], structured_outputs=CHOICE)
    _step(h)
    _step(h, grammars_failed={CHOICE.key: "no tokenizer"})
    h._collect(h.sched.take_pending_deltas())
    assert h.final("g") == ("abort", "structured_outputs: no tokenizer")
    assert not h.sched.has_work()
    assert h.sched.schedule() is None  # nothing left to poll for


def test_an_evicted_grammar_is_compiled_again_before_its_next_request():
    h = Harness()
    h.add("g", [1, 2, 3], structured_outputs=CHOICE)
    _step(h)
    _step(h, grammars_ready=(CHOICE.key,))
    h.run()
    h.add("again", [1, 2, 4], structured_outputs=CHOICE)
    _step(h, grammars_evicted=(CHOICE.key,))  # "again" runs: the eviction came with this result
    h.add("third", [5, 6, 7], structured_outputs=CHOICE)
    batch = _step(h)
    assert batch.compile_grammars == (CHOICE.key,)
    assert not any(r.request_id == "third" for r in batch.new_requests)
    _step(h, grammars_ready=(CHOICE.key,))
    h.run()
    assert len(h.tokens("third")) == 4

"""The steps the scheduler has sent and not heard back from, and the token
placeholders they leave on requests (asynchronous scheduling).

Owned by `Scheduler` (core.py); pure. Synchronous (the default): one step in
flight, each planned after the last one returned. With --async-scheduling
(vLLM's `AsyncScheduler`, vllm/v1/core/sched/async_scheduler.py, and its
engine's batch queue, vllm/v1/engine/core.py `step_with_batch_queue`): up to
two. The loop plans step N+1 while step N runs, so the executor finds its
next batch in its mailbox and never waits for the scheduler; the scheduler
takes step N's result one step behind.

    scheduler:  plan N | plan N+1 |  take N, plan N+2  |  take N+1, plan N+3
    executor:          |  run N   |      run N+1       |      run N+2

The idea (vLLM's `num_output_placeholders`): a step that samples a request
leaves it one placeholder, an output token whose id is not known yet. The
next plan counts it as a known token (`Request.num_planned_tokens`), so the
request's decode at N+1 feeds "the token it sampled at N". The batch needs no
new field for that: the executor keeps its own copy of every request's
tokens and appends what it samples before it runs the next batch (messages
run in order), so the input row at N+1 is the token it sampled at N, and
"sampled iff computed + scheduled == known tokens" still holds.

Exactness (what a request sees is what synchronous scheduling gives it):

- A request that finishes with step N's result (EOS, stop token, max_tokens,
  a stop string, an abort) was also planned into N+1. Its token from N+1 is
  dropped (the core no longer has it), its blocks were freed with it (only a
  later step reuses them, and the executor runs N+1 first), and the executor
  drops its state with the next batch's finished ids.
- max_tokens and max_model_len are known ahead: a request whose outputs plus
  placeholders reach them is not planned again (`Request.may_plan_more`), so no
  KV slot is used past `Request.max_kv_tokens`.
- A request preempted while it is in a step in flight keeps that step's token
  (its KV and sampling state were intact when the executor sampled it; the
  executor has appended it to its own copy, grammar matcher and penalties
  included). The token is taken as usual and may end the request.
- Prefix-cache registration only covers tokens whose step came back
  (`Request.num_returned_tokens`) and were fed (all but the last known: a
  multi-step run ended at a stop id computed less than it was planned), so a
  cached block always holds its KV.
- Control work (sleep, weight updates, LoRA loads, profiles) still runs
  between two steps: the loop plans ahead only when the lane is empty
  (control.py `may_step_ahead`), so the steps in flight drain first.

Multi-step decode (multi_step.py) too: a step of 1 + k forwards leaves a request
1 + k placeholders (`StepInFlight.placeholders`, taken back by its result), so the
step planned behind it feeds the run's last token with its own extra forwards,
capped by max_tokens counting the placeholders. A run keeps all its tokens unless
it ended at a stop token id, which finishes the request with that result; the
step planned behind it then finds the request gone (its token dropped, as above)
and the executor leaves it out (executor/core.py RequestState.ended: its copy of
the tokens is shorter than that step assumed). The executor's results and its
AheadTokens travel on two tasks, so the next step's AheadTokens may come before
the result of the step before: the scheduler holds them until that result is in
(Scheduler.ahead_tokens), so a client gets every token once, in order.

Not supported yet (config.py `_resolve_async_scheduling` turns it off, with a
warning when it was asked for): speculative decoding, the host / disk KV tiers,
pooling models.

Unset (the default), steps are planned ahead only while at most
`config.ASYNC_AUTO_MAX_RUNNING` requests run (`Scheduler.may_schedule_ahead`);
with more, each step waits for the last result, as synchronous scheduling does.

NOTE (measured, README "Where a step's time goes"): on a 2-core CPU the
executor's idle gap between steps goes (13 ms -> 0.15 ms median). Compiled
decode is not re-specialised by it: the steps planned ahead use the same
buckets and padded buffers, Dynamo compiles no frame during async rounds
(bench/async_scheduling.py counts them; tests/actors/executor/
test_compiled_decode.py asserts it), and the torch thread's CPU time per
step is the same in both modes. What moves is wall time per step on a
loaded machine, by several times between rounds of one mode, so the
earlier 0.52x (3 rounds) is not reproducible; with 16 compiled, 16 streams
came out 0.84x, 0.98x and 1.08x of sync in three runs (where it loses, the
engine thread now runs beside the OpenMP threads), hence the default's limit.
"""

from __future__ import annotations

from collections import deque

import attrs


@attrs.define
class StepInFlight:
    step_id: int
    num_scheduled_tokens: int  # the whole step's (stats)
    num_tokens: dict[str, int]  # request id -> its tokens computed by the step
    # request id -> the output placeholders the step left it (the tokens it samples: 1, or 1 + the
    # extra forwards of a multi-step decode step); its result takes them back
    placeholders: dict[str, int] = attrs.Factory(dict)


class StepsInFlight:
    """FIFO of the steps sent to the executor; results come back in order."""

    def __init__(self, max_steps: int) -> None:
        if max_steps not in (1, 2):
            raise ValueError(f"steps in flight must be 1 or 2, got {max_steps}")
        self.max_steps = max_steps
        self._steps: deque[StepInFlight] = deque()

    def __len__(self) -> int:
        return len(self._steps)

    @property
    def is_full(self) -> bool:
        return len(self._steps) >= self.max_steps

    @property
    def oldest_step_id(self) -> int | None:
        return self._steps[0].step_id if self._steps else None

    def holds(self, step_id: int) -> bool:
        """The step went out and its result has not come back."""
        return any(step.step_id == step_id for step in self._steps)

    def sent(self, step: StepInFlight) -> None:
        if self.is_full:
            raise RuntimeError(f"{len(self._steps)} steps in flight already: call update_from_output first")
        self._steps.append(step)

    def returned(self, step_id: int) -> StepInFlight:
        """The step whose result came back; ValueError unless it is the oldest."""
        if not self._steps or self._steps[0].step_id != step_id:
            raise ValueError(f"result of step {step_id}, but step {self.oldest_step_id} is the oldest in flight")
        return self._steps.popleft()

"""A scheduler core driven step by step against the fake executor, and multi-turn chats over it.

`Harness` holds a `Scheduler`, a `FakeExecutor` and every token delta seen
per request; `step()` schedules one batch, executes it on the fake and feeds
the result back. `add_req` builds an `AddRequest` with a rising arrival time.
`run_conversations` plays multi-turn chats through a harness and checks every
answer against the reference.
"""

from __future__ import annotations

import itertools
import random

import numpy as np

from support.fake_executor import FakeExecutor, reference
from trillium.actors.protocol.requests import AddRequest
from trillium.actors.scheduler.core import Scheduler, SchedulerConfig
from trillium.sampling_params import SamplingParams

_clock = itertools.count()


def add_req(rid, prompt, *, eos=(), priority=0, group_id=None, lora_id=0, **sampling) -> AddRequest:
    sampling.setdefault("max_tokens", 4)
    return AddRequest(
        request_id=rid, prompt_token_ids=np.asarray(list(prompt), dtype=np.int32),
        sampling=SamplingParams(**sampling), eos_token_ids=tuple(eos), arrival_time=float(next(_clock)),
        priority=priority, group_id=group_id, lora_id=lora_id,
    )


class Harness:
    """A scheduler, a fake executor, and every delta seen per request."""

    def __init__(self, token_fn=None, **config) -> None:
        config.setdefault("num_blocks", 64)
        config.setdefault("block_size", 4)
        config.setdefault("max_model_len", 64)
        config.setdefault("max_loras", 2)
        self.sched = Scheduler(SchedulerConfig(**config))
        self.sched.lora_ids.update({1, 2, 3})  # as if the executor had loaded them
        self.ex = FakeExecutor(config["num_blocks"], config["block_size"], token_fn, config.get("sliding_window", 0))
        self.batches = []
        self.deltas: dict[str, list] = {}

    def add(self, *args, **kw) -> AddRequest:
        msg = add_req(*args, **kw)
        self.sched.add_request(msg)
        return msg

    def _collect(self, token_deltas) -> None:
        if token_deltas is not None:
            for d in token_deltas.deltas:
                self.deltas.setdefault(d.request_id, []).append(d)

    def step(self):
        self._collect(self.sched.take_pending_deltas())
        batch = self.sched.schedule()
        if batch is None:
            return None
        self.batches.append(batch)
        self._collect(self.sched.update_from_output(self.ex.execute(batch)))
        return batch

    def run(self, max_steps: int = 1000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_work():
                self._collect(self.sched.take_pending_deltas())
                return
            self.step()
        raise AssertionError("scheduler did not drain")

    def tokens(self, rid) -> list[int]:
        return [t for d in self.deltas.get(rid, []) for t in d.new_token_ids]

    def final(self, rid):
        last = self.deltas[rid][-1]
        return last.finish_reason, last.stop_reason

    def scheduled(self, batch) -> dict[str, int]:
        ids = [n.request_id for n in batch.new_requests] + list(batch.cached.request_ids)
        return dict(zip(ids, batch.num_scheduled_tokens.tolist()))


def run_conversations(harness: Harness, num_conversations: int, num_turns: int, seed: int = 0) -> dict:
    """Multi-turn chats, one turn of every conversation at a time: each turn's
    prompt is the previous prompt, its answer and a few new tokens."""
    rng = random.Random(seed)
    prompts = {c: [rng.randrange(1, 50) for _ in range(rng.randint(3, 9))] for c in range(num_conversations)}
    outputs = {}
    for turn in range(num_turns):
        msgs = {c: harness.add(f"c{c}t{turn}", prompts[c], max_tokens=3, ignore_eos=True,
                               lora_id=c % 2) for c in prompts}
        harness.run()
        for c, msg in msgs.items():
            rid = msg.request_id
            expected, _, _ = reference(msg.prompt_token_ids.tolist(), msg.sampling, (), c % 2, 64)
            assert harness.tokens(rid) == expected, rid
            outputs[rid] = harness.tokens(rid)
            prompts[c] = prompts[c] + outputs[rid] + [rng.randrange(1, 50) for _ in range(rng.randint(2, 6))]
    return outputs


class AsyncHarness(Harness):
    """Harness with --async-scheduling: up to two steps in flight, each step's result
    taken only after the next one was planned (what SchedulerLoop does). The fake
    executes a batch as it is sent, which is one order the real executor may run in
    (it runs batches in order, independently of the scheduler)."""

    def __init__(self, token_fn=None, **config) -> None:
        super().__init__(token_fn, async_scheduling=True, **config)
        self.in_flight: list = []  # results not taken yet, oldest first
        self.num_ahead = 0  # batches planned while another was in flight

    def _send(self):
        sent = None
        while not self.in_flight or self.sched.may_schedule_ahead:
            batch = self.sched.schedule()
            if batch is None:
                break
            self.num_ahead += bool(self.in_flight)
            self.batches.append(batch)
            self.in_flight.append(self.ex.execute(batch))
            sent = batch
        return sent

    def step(self):
        """Send what may go out, then take the oldest result; the last batch sent (or None)."""
        self._collect(self.sched.take_pending_deltas())
        sent = self._send()
        if self.in_flight:
            self._collect(self.sched.update_from_output(self.in_flight.pop(0)))
        return sent

    def run(self, max_steps: int = 1000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_work() and not self.in_flight:
                self._collect(self.sched.take_pending_deltas())
                return
            self.step()
        raise AssertionError("scheduler did not drain")

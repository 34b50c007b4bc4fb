"""--async-scheduling in the executor: each step goes to the torch thread as it arrives.

Used by the executor actor (actor.py) only with --async-scheduling, when the
scheduler may have two steps out (scheduler/in_flight.py). Without it the
actor hands a step to the torch thread, awaits it, sends its result, then
reads the next message: the torch thread waits for that round trip through
the trio loop between two steps (the "torch-thread hop" of `trillium bench
timeline`). Here step N+1 is queued on the torch thread the moment it is
received, behind step N, so the thread runs them back to back; a task of
its own awaits the results in order and sends each one (BatchResult, or
ExecutorFailed and the error re-raised, which stops the engine as before).

INVARIANT: steps run in the order they arrived (the torch thread is one
FIFO worker), and a control command or Shutdown runs only once every queued
step has answered (`drained`): the scheduler sends none while steps are
out, this keeps it so regardless.

NOTE: a timeline profile's "ExecuteBatch" span is then the wait for the
result, which starts while the step already runs; the stage spans inside
the step (StageClock) are unchanged.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Awaitable, Callable

import trio

from trillium.actors.protocol.execute import ExecuteBatch, ExecutorFailed
from trillium.actors.torch_thread import TorchThread

log = logging.getLogger(__name__)

MAX_STEPS_QUEUED = 2  # the scheduler's bound (scheduler/in_flight.py StepsInFlight)


class StepPipeline:
    def __init__(self, torch_thread: TorchThread, step: Callable, send: Callable[[object], Awaitable[None]],
                 timeline) -> None:
        self._torch_thread = torch_thread
        self._step = step
        self._send = send
        self._timeline = timeline
        self._queued, self._results = trio.open_memory_channel(MAX_STEPS_QUEUED)
        self._num_out = 0
        self._drained = trio.Event()
        self._drained.set()

    def submit(self, batch: ExecuteBatch) -> None:
        """Queue the step on the torch thread now; its result is sent by `run`."""
        future = self._torch_thread.submit(self._step, batch)
        self._queued.send_nowait((batch.step_id, future))  # WouldBlock: more steps out than the scheduler sends
        self._num_out += 1
        self._drained = trio.Event()

    async def drained(self) -> None:
        """Every queued step has answered."""
        await self._drained.wait()

    async def run(self) -> None:
        """The results, in order (a task in the actor's nursery)."""
        async for step_id, future in self._results:
            try:
                with self._timeline.span("ExecuteBatch"):
                    result = await self._torch_thread.wait(future)
            except Exception as exc:
                log.exception("executor step %d failed", step_id)
                await self._send(ExecutorFailed(
                    step_id=step_id, error="".join(traceback.format_exception_only(exc)).strip()))
                raise
            with self._timeline.span("send BatchResult"):
                await self._send(result)
            self._num_out -= 1
            if not self._num_out:
                self._drained.set()

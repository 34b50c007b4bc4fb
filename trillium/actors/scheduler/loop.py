"""Scheduler loop: what the scheduler actor sends to whom, and in which order.

Pure and synchronous (no trio, no zmq), like the core and `EngineControl`
it wraps. The actor (`actor.py`) feeds it events and sends the effects it
returns, in order:

    before_wait(now)          the actor is about to wait for a message
    handle(message, now)      one message from the mailbox
    mailbox_drained(depth)    `depth` more messages were waiting (reported in stats)
    deadline_passed(now)      `deadline` passed while waiting (a profile's end, an update drain's timeout)

Effects are `Send(peer, message)`, `peer` one of executor, detokenizer, api.

Messages in: AddRequest, AbortRequest, FinishRequest (api, detokenizer),
BatchResult / AheadTokens / ExecutorFailed (executor), lifecycle commands (api), their
ControlReply (executor, detokenizer), Shutdown. Out: ExecuteBatch and
forwarded commands (executor), TokenDeltas and forwarded profile commands
(detokenizer), SchedulerStats and ControlReply (api).

The idea: the executor is the bottleneck, so before each wait the loop
first gives it its next work if it is free (a control job, else a step
when the engine state allows stepping), and only then sends the token
deltas and stats of the step that came back. One message is out on the
executor at a time (INVARIANT; whether a step is out is the core's
`step_in_flight`, nowhere else): it runs them in order, so blocks freed by
an abort during a step are only reused by a later step, and control work
always falls between two steps. With --async-scheduling two steps may be
out, the second planned while the first runs (`_schedule_ahead`,
scheduler/in_flight.py), never beside a control job.

Ordering rules (tests/actors/scheduler/test_loop.py has one test each):

1. The next ExecuteBatch goes out before the deltas and stats of the step
   that just came back.
2. A request's held step tokens reach the detokenizer before the abort /
   stop delta that ends it.
3. Before a ControlReply: the held step outputs, the pending deltas, fresh
   stats, then the reply (so the api sees the new state when it lands).
4. Going idle (no step, no job to send) sends the held tokens of
   --stream-interval, then stats.
5. ExecutorFailed raises EngineStopped; Shutdown sets `stopped`.
6. A multi-step step's AheadTokens reach the detokenizer behind the held
   step outputs, without stats; the step's result sends only the tokens
   past them.

State: the TokenDeltas of returned steps not sent yet, the n > 1 groups
whose spec went out (group_specs.py), and `stopped`.
"""

from __future__ import annotations

import enum
import logging
from typing import Any

import attrs

from trillium.actors.protocol.supervision import Shutdown
from trillium.actors.protocol.execute import AheadTokens, BatchResult, ExecutorFailed
from trillium.actors.protocol.admin import ControlReply
from trillium.actors.protocol.outputs import TokenDeltas
from trillium.actors.protocol.requests import AbortRequest, AddRequest, FinishRequest
from trillium.actors.scheduler.control import EngineControl, ToDetokenizer, ToExecutor
from trillium.actors.scheduler.group_specs import GroupSpecs

log = logging.getLogger(__name__)


class EngineStopped(Exception):
    """The executor failed: the engine cannot go on."""


class Peer(enum.Enum):
    EXECUTOR = "executor"
    DETOKENIZER = "detokenizer"
    API = "api"


@attrs.frozen
class Send:
    to: Peer
    message: Any


class SchedulerLoop:
    def __init__(self, core, control: EngineControl) -> None:
        self.core = core
        self.control = control
        self.profiler = control.profiler
        self.stopped = False  # a Shutdown was handled: the actor returns
        self._step_outputs: list[TokenDeltas] = []  # of returned steps (and AheadTokens), not sent yet
        self._stats_due = False  # a step returned since the api last got the stats
        self._group_specs = GroupSpecs()  # n > 1: each request's DetokenizeSpec goes out once

    # -- views ------------------------------------------------------------

    @property
    def step_in_flight(self) -> bool:
        return self.core.step_in_flight

    @property
    def deadline(self) -> float:
        """When to wake without a message (trio's clock): a profile's end or an
        update drain's timeout; inf when neither."""
        return self.control.deadline

    # -- events -------------------------------------------------------------

    def before_wait(self, now: float) -> list[Send]:
        """Give the executor its next work, then send the returned steps' outputs."""
        out: list[Send] = []
        self._advance(now, out)
        self._step_outputs_to(out)
        return out

    def handle(self, message: Any, now: float) -> list[Send]:
        """Apply one message. Raises EngineStopped on ExecutorFailed."""
        out: list[Send] = []
        with self.profiler.span(type(message).__name__):
            self._dispatch(message, now, out)
        return out

    def mailbox_drained(self, depth: int) -> None:
        self.control.mailbox_depth = depth

    def deadline_passed(self, now: float) -> None:
        self.control.deadline_passed(now)

    # -- decisions ------------------------------------------------------------

    def _advance(self, now: float, out: list[Send]) -> None:
        """Hand the executor its next work if it is free: a control job, else a step
        (and with --async-scheduling the step after it, planned while it runs)."""
        self._flush_deltas(out)
        if self.control.executor_busy:
            return
        if self.core.step_in_flight:
            self._schedule_ahead(out)
            return
        self._apply(self.control.executor_idle(now), out)
        if self.control.executor_busy:
            self._flush_deltas(out)  # what the job's preemptions released (sleep)
            return
        if self.control.may_step:
            with self.profiler.span("schedule"):
                batch = self.core.schedule()
            if batch is not None:
                out.append(Send(Peer.EXECUTOR, batch))
                self._schedule_ahead(out)
                return
        # Going idle: tokens held for --stream-interval go out (a paused or sleeping engine
        # would keep them), then the state after aborts / finishes, so the api's gauges do
        # not keep showing requests that are gone.
        self.core.release_held()
        self._flush_deltas(out)
        out.append(Send(Peer.API, self.control.stats()))

    def _schedule_ahead(self, out: list[Send]) -> None:
        """--async-scheduling: one more step behind the one in flight (scheduler/in_flight.py),
        unless a command waits for the executor to go idle."""
        if self.core.may_schedule_ahead and self.control.may_step_ahead:
            with self.profiler.span("schedule"):
                batch = self.core.schedule()
            if batch is not None:
                out.append(Send(Peer.EXECUTOR, batch))

    def _step_outputs_to(self, out: list[Send]) -> None:
        """The returned steps' deltas (detokenizer) and then the stats (api)."""
        outputs, self._step_outputs = self._step_outputs, []
        for deltas in outputs:
            if deltas.deltas:
                out.append(Send(Peer.DETOKENIZER, self._group_specs.once(deltas)))
        if self._stats_due:
            self._stats_due = False
            out.append(Send(Peer.API, self.control.stats()))

    def _flush_deltas(self, out: list[Send]) -> None:
        pending = self.core.take_pending_deltas()
        if pending is not None:
            # WHY the held step outputs first: a request's last token must reach the
            # detokenizer before the abort / stop delta that ends it.
            self._step_outputs_to(out)
            out.append(Send(Peer.DETOKENIZER, self._group_specs.once(pending)))

    def _dispatch(self, message: Any, now: float, out: list[Send]) -> None:
        if isinstance(message, BatchResult):
            deltas = self.core.update_from_output(message)
            # WHY held back: the loop schedules the next step first (the executor
            # idles until it arrives); the deltas and stats go out right after.
            self._step_outputs.append(deltas)
            self._stats_due = True
        elif isinstance(message, AheadTokens):
            # Multi-step decode: tokens of the step still running; in order behind any held
            # step outputs. WHY no stats with them: the engine's state has not moved.
            deltas = self.core.ahead_tokens(message)
            if deltas is not None:
                self._step_outputs.append(deltas)
        elif isinstance(message, AddRequest):
            try:
                self.core.add_request(message)
            except ValueError as exc:  # the api validates first; this is the last guard
                log.warning("rejected request %s: %s", message.request_id, exc)
                for request_id in message.choice_ids():
                    self.core.reject(request_id, str(exc))
        elif isinstance(message, AbortRequest):
            self.core.abort(message.request_ids)
        elif isinstance(message, FinishRequest):
            self.core.finish(message.request_ids)
        elif isinstance(message, EngineControl.COMMANDS):
            self._apply(self.control.command(message, now), out)
        elif isinstance(message, ControlReply):
            self._apply(self.control.answer(message, now), out)
        elif isinstance(message, Shutdown):
            self.stopped = True
        elif isinstance(message, ExecutorFailed):
            raise EngineStopped(f"executor failed at step {message.step_id}: {message.error}")
        else:
            log.error("scheduler: unexpected message %r", type(message).__name__)

    def _apply(self, effects, out: list[Send]) -> None:
        """EngineControl's effects, as sends."""
        for effect in effects:
            if isinstance(effect, ControlReply):
                # Aborts first, so their final deltas are on their way; then
                # stats, so the api sees the new state when the reply lands.
                self._step_outputs_to(out)
                self._flush_deltas(out)
                out.append(Send(Peer.API, self.control.stats()))
                out.append(Send(Peer.API, effect))
            elif isinstance(effect, ToExecutor):
                out.append(Send(Peer.EXECUTOR, effect.message))
            elif isinstance(effect, ToDetokenizer):
                out.append(Send(Peer.DETOKENIZER, effect.message))

"""Scheduler actor: the trio shell around `scheduler.core.Scheduler` and
`scheduler.control.EngineControl`.

Consumes AddRequest, AbortRequest, FinishRequest (api, detokenizer),
BatchResult / ExecutorFailed (executor), lifecycle commands (api,
protocol/lifecycle.py), ControlReply (executor, detokenizer), Shutdown.
Produces ExecuteBatch and forwarded lifecycle commands (executor),
TokenDeltas and forwarded profile commands (detokenizer), SchedulerStats
and ControlReply (api). With an OTLP endpoint configured it also exports
the stage spans of detailed-traced requests (observability/actor_spans.py).

Loop: give the executor its next work if it is free (a control job first,
else a step, when the engine state allows stepping), then send the token
deltas and stats of the step that came back (after the next step is on
its way: the executor idles until it arrives), then take every pending
message; a BatchResult becomes token deltas. One message is out on
the executor at a time: it runs them in order, so blocks freed by an abort
during a step are only reused by a later step, and control work always
falls between two steps.
"""

from __future__ import annotations

import logging
import math

import trio

from trillium.actors.engine import ActorConfig, engine_codec
from trillium.actors.mailbox import Mailbox
from trillium.actors.protocol.control import Shutdown
from trillium.actors.protocol.execute import BatchResult, ExecutorFailed
from trillium.actors.protocol.lifecycle import ControlReply
from trillium.actors.protocol.requests import AbortRequest, AddRequest, FinishRequest
from trillium.actors.scheduler.control import EngineControl, ToDetokenizer, ToExecutor
from trillium.actors.scheduler.core import build_scheduler
from trillium.actors.transport import Outbox
from trillium.observability.actor_spans import SchedulerSpans, actor_tracer, close_provider

log = logging.getLogger(__name__)


class EngineStopped(Exception):
    pass


async def run(config: bytes | None, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    cfg = ActorConfig.from_bytes(config)
    codec = engine_codec()
    core = build_scheduler(cfg.engine)
    provider, tracer = actor_tracer(cfg.engine, "scheduler")
    if tracer is not None:
        core.on_finished = SchedulerSpans(tracer).on_finished
    mailbox = Mailbox.bind(cfg.addresses.scheduler, codec)
    to_executor = Outbox.connect(cfg.addresses.executor, codec)
    to_detokenizer = Outbox.connect(cfg.addresses.detokenizer, codec)
    to_api = Outbox.connect(cfg.addresses.api, codec)
    shell = _Shell(core, EngineControl(core, cfg.engine), mailbox, to_executor, to_detokenizer, to_api)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(mailbox.pump)
            task_status.started()
            await shell.loop()
            nursery.cancel_scope.cancel()
    finally:
        shell.profiler.close()
        for box in (to_executor, to_detokenizer, to_api):
            box.close()
        close_provider(provider)


class _Shell:
    def __init__(self, core, control: EngineControl, mailbox: Mailbox, to_executor: Outbox,
                 to_detokenizer: Outbox, to_api: Outbox) -> None:
        self.core = core
        self.control = control
        self.profiler = control.profiler
        self.mailbox = mailbox
        self.to_executor = to_executor
        self.to_detokenizer = to_detokenizer
        self.to_api = to_api
        self.step_in_flight = False
        self._step_outputs: list = []  # TokenDeltas of returned steps, not sent yet

    async def loop(self) -> None:
        while True:
            await self._advance()
            await self._send_step_outputs()
            message = await self._receive()
            if message is None:  # a profile's or an update drain's time is up
                self.control.deadline_passed(trio.current_time())
                continue
            if not await self._dispatch(message):
                return
            pending = self.mailbox.drain()
            self.control.mailbox_depth = len(pending)
            for message in pending:
                if not await self._dispatch(message):
                    return

    async def _receive(self):
        deadline = self.control.deadline
        if deadline == math.inf:
            return await self.mailbox.receive()
        with trio.move_on_at(deadline):
            return await self.mailbox.receive()
        return None

    async def _advance(self) -> None:
        """Hand the executor its next work if it is free: a control job, else a step."""
        await self._flush_deltas()
        if self.step_in_flight or self.control.executor_busy:
            return
        await self._apply(self.control.executor_idle(trio.current_time()))
        if self.control.executor_busy:
            return
        if self.control.may_step:
            with self.profiler.span("schedule"):
                batch = self.core.schedule()
            if batch is not None:
                await self.to_executor.send(batch)
                self.step_in_flight = True
                return
        # Going idle: report the state after aborts / finishes, so the api's
        # gauges do not keep showing requests that are gone.
        await self.to_api.send(self.control.stats())

    async def _send_step_outputs(self) -> None:
        """The returned steps' deltas (detokenizer) and then the stats (api)."""
        if not self._step_outputs:
            return
        outputs, self._step_outputs = self._step_outputs, []
        for deltas in outputs:
            if deltas.deltas:
                await self.to_detokenizer.send(deltas)
        await self.to_api.send(self.control.stats())

    async def _flush_deltas(self) -> None:
        pending = self.core.take_pending_deltas()
        if pending is not None:
            # WHY the held step outputs first: a request's last token must reach the
            # detokenizer before the abort / stop delta that ends it.
            await self._send_step_outputs()
            await self.to_detokenizer.send(pending)

    async def _dispatch(self, message) -> bool:
        """Apply one message; False on Shutdown."""
        with self.profiler.span(type(message).__name__):
            if isinstance(message, BatchResult):
                self.step_in_flight = False
                deltas = self.core.update_from_output(message)
                # WHY held back: the loop schedules the next step first (the executor
                # idles until it arrives); the deltas and stats go out right after.
                self._step_outputs.append(deltas)
            elif isinstance(message, AddRequest):
                try:
                    self.core.add_request(message)
                except ValueError as exc:  # the api validates first; this is the last guard
                    log.warning("rejected request %s: %s", message.request_id, exc)
                    self.core.reject(message.request_id, str(exc))
            elif isinstance(message, AbortRequest):
                self.core.abort(message.request_ids)
            elif isinstance(message, FinishRequest):
                self.core.finish(message.request_ids)
            elif isinstance(message, EngineControl.COMMANDS):
                await self._apply(self.control.command(message, trio.current_time()))
            elif isinstance(message, ControlReply):
                await self._apply(self.control.answer(message, trio.current_time()))
            elif isinstance(message, Shutdown):
                return False
            elif isinstance(message, ExecutorFailed):
                raise EngineStopped(f"executor failed at step {message.step_id}: {message.error}")
            else:
                log.error("scheduler: unexpected message %r", type(message).__name__)
        return True

    async def _apply(self, effects) -> None:
        for effect in effects:
            if isinstance(effect, ControlReply):
                # Aborts first, so their final deltas are on their way; then
                # stats, so the api sees the new state when the reply lands.
                await self._send_step_outputs()
                await self._flush_deltas()
                await self.to_api.send(self.control.stats())
                await self.to_api.send(effect)
            elif isinstance(effect, ToExecutor):
                await self.to_executor.send(effect.message)
            elif isinstance(effect, ToDetokenizer):
                await self.to_detokenizer.send(effect.message)

"""Executor actor: the trio shell around `executor.core.ExecutorCore`.

Consumes ExecuteBatch (scheduler), lifecycle commands forwarded by the
scheduler (sleep / wake, weight updates, update groups, profiling; see
`executor/control.py`), Shutdown. Produces BatchResult (with multi-step
decode, AheadTokens before it), or ExecutorFailed when a step raises (the
scheduler then stops the engine), and one ControlReply per lifecycle
command (a failed command does not stop the engine). Weights load, every
step and every command run on one dedicated torch thread
(`torch_thread.py`), so the trio loop (and in-process neighbours) never
block on torch; the one exception is the rendezvous of
InitWeightsUpdateGroup, which runs on a thread of its own while steps go
on (`executor/control.py`). Under tensor parallelism this is rank 0: it
alone binds the executor inbox and answers; every step and command reaches
the other ranks first (`executor/tp_fanout.py`); with ranks on other hosts
(`--nnodes`), an idle rank 0 also checks every HEARTBEAT_S that they all
answer, and stops the engine when one does not.
"""

from __future__ import annotations

import contextlib
import logging
import math
import traceback
from collections.abc import Awaitable, Callable

import trio

from trillium.actors.assembly import ActorConfig
from trillium.actors.links import Links
from trillium.actors.executor.core import ExecutorCore
from trillium.actors.executor.control import ExecutorControl
from trillium.actors.executor.step_pipeline import StepPipeline
from trillium.actors.executor.tp_fanout import OneRank, RankFanout
from trillium.actors.mailbox import Mailbox
from trillium.actors.protocol.supervision import Shutdown
from trillium.actors.protocol.execute import AheadTokens, ExecuteBatch, ExecutorFailed
from trillium.actors.torch_thread import TorchThread

log = logging.getLogger(__name__)


async def run(config: bytes | None, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    cfg = ActorConfig.from_bytes(config)
    links = Links(cfg, "executor")
    torch_thread = TorchThread("trillium-executor")
    core = await torch_thread.run(ExecutorCore, cfg.engine, 0, cfg.link_key())
    mailbox = links.mailbox()
    to_scheduler = links.outbox("scheduler")
    control = ExecutorControl(core, torch_thread)
    # Tensor parallel: this is rank 0; each step and command reaches the others first (tp_fanout.py).
    ranks = RankFanout(core, links.codec) if core.tp.size > 1 else OneRank(core)
    send_lock = trio.Lock()

    async def send(message) -> None:
        # WHY a lock: a join's reply is sent from its own task; two tasks waiting
        # on one socket's FD (HWM reached) would be a trio BusyResourceError.
        async with send_lock:
            await to_scheduler.send(message)

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(mailbox.pump)
            control.start(nursery, send)
            # --async-scheduling: steps queue on the torch thread as they come (step_pipeline.py).
            pipeline = StepPipeline(torch_thread, ranks.step, send, control.timeline) \
                if cfg.engine.async_scheduling else None
            if pipeline is not None:
                nursery.start_soon(pipeline.run)
            if core.multi_step and cfg.engine.multi_step_stream_outputs:  # scheduler/multi_step.py
                ahead = AheadTokensSender(send)
                core.on_ahead_tokens = ahead.put
                nursery.start_soon(ahead.run)
            task_status.started()
            await _serve(ranks, control, torch_thread, mailbox, send, pipeline)
            nursery.cancel_scope.cancel()
    finally:
        await control.aclose()
        with trio.CancelScope(shield=True):
            await torch_thread.run(ranks.stop)
            await trio.to_thread.run_sync(core.close)  # the disk tier's queued writes
        to_scheduler.close()
        torch_thread.close()


class AheadTokensSender:
    """Multi-step decode's AheadTokens, from the torch thread to the scheduler in the order they
    were made, without the forward waiting for the send.

    NOTE: a step's result may overtake its last AheadTokens (two tasks share the socket); the
    scheduler drops AheadTokens of a step that has returned, whose result carried them anyway;
    and with async scheduling the next step's first AheadTokens may overtake this step's result
    (the scheduler holds them until it is in). The queue holds at most two steps' forwards."""

    def __init__(self, send: Callable[[object], Awaitable[None]]) -> None:
        self._trio_token = trio.lowlevel.current_trio_token()
        self._to_send, self._queued = trio.open_memory_channel(math.inf)
        self._send = send

    def put(self, message: AheadTokens) -> None:
        """From any thread. Dropped once the actor is ending: the step's result carries them."""
        try:
            self._trio_token.run_sync_soon(self._queue, message)
        except trio.RunFinishedError:
            pass

    def _queue(self, message: AheadTokens) -> None:
        # WHY no raise: an exception in a run_sync_soon callback would crash the trio run.
        with contextlib.suppress(trio.ClosedResourceError, trio.BrokenResourceError):
            self._to_send.send_nowait(message)

    async def run(self) -> None:
        async for message in self._queued:
            await self._send(message)


async def _serve(ranks: OneRank, control: ExecutorControl, torch_thread: TorchThread, mailbox: Mailbox,
                 send: Callable[[object], Awaitable[None]], pipeline: StepPipeline | None = None) -> None:
    beat_at = trio.current_time() + ranks.heartbeat_s
    while True:
        message = await mailbox.receive(deadline=min(control.profile_deadline, beat_at))
        if message is None and trio.current_time() >= beat_at:  # idle: are the other hosts' ranks alive?
            try:
                await torch_thread.run(ranks.heartbeat)
            except Exception:  # WHY re-raise: this actor ending stops the engine (supervisor.py)
                log.exception("executor: a tensor-parallel rank on another host is gone; stopping the engine")
                raise
            beat_at = trio.current_time() + ranks.heartbeat_s
            continue
        beat_at = trio.current_time() + ranks.heartbeat_s
        if message is None:  # the profile's time is up
            await control.expire_profile()
            continue
        if pipeline is not None and isinstance(message, ExecuteBatch):
            pipeline.submit(message)
            continue
        if pipeline is not None:
            await pipeline.drained()  # INVARIANT: commands and Shutdown only between steps
        if isinstance(message, Shutdown):
            return
        if isinstance(message, ExecutorControl.COMMANDS):
            reply = await ranks.command(message, control.handle, torch_thread)
            if reply is not None:  # None: a join, answered from its own task when it ends
                await send(reply)
            continue
        if not isinstance(message, ExecuteBatch):
            log.error("executor: unexpected message %r", type(message).__name__)
            continue
        try:
            with control.timeline.span("ExecuteBatch"):  # a timeline profile's step span (else free)
                result = await torch_thread.run(ranks.step, message)
        except Exception as exc:
            log.exception("executor step %d failed", message.step_id)
            await send(
                ExecutorFailed(step_id=message.step_id, error="".join(traceback.format_exception_only(exc)).strip())
            )
            raise
        with control.timeline.span("send BatchResult"):
            await send(result)

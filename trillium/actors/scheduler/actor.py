"""Scheduler actor: the trio shell around `scheduler.loop.SchedulerLoop`.

Receive a message, hand it to the loop, send the effects it returns in
order; the loop (pure, over `scheduler.core.Scheduler` and
`scheduler.control.EngineControl`) decides what goes to whom and when, and
its module docstring lists the messages and the ordering rules. The shell
only adds the clock (trio's), the mailbox drain, and the profile deadline
(`Mailbox.receive(deadline=...)`). With an OTLP endpoint configured it also
exports the stage spans of detailed-traced requests
(observability/actor_spans.py).
"""

from __future__ import annotations

import trio

from trillium.actors.assembly import ActorConfig
from trillium.actors.links import Links
from trillium.actors.mailbox import Mailbox
from trillium.actors.protocol.execute import ExecuteBatch
from trillium.actors.protocol.outputs import TokenDeltas
from trillium.actors.scheduler.control import EngineControl
from trillium.actors.scheduler.core import build_scheduler
from trillium.actors.scheduler.loop import EngineStopped, Peer, SchedulerLoop, Send
from trillium.actors.transport import Outbox
from trillium.observability.actor_spans import SchedulerSpans, actor_tracer, close_provider

__all__ = ["EngineStopped", "run"]


async def run(config: bytes | None, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    cfg = ActorConfig.from_bytes(config)
    links = Links(cfg, "scheduler")
    core = build_scheduler(cfg.engine)
    provider, tracer = actor_tracer(cfg.engine, "scheduler")
    if tracer is not None:
        core.on_finished = SchedulerSpans(tracer).on_finished
    loop = SchedulerLoop(core, EngineControl(core, cfg.engine))
    mailbox = links.mailbox()
    outboxes = {peer: links.outbox(peer.value) for peer in Peer}
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(mailbox.pump)
            task_status.started()
            await _serve(loop, mailbox, outboxes)
            nursery.cancel_scope.cancel()
    finally:
        loop.profiler.close()
        for box in outboxes.values():
            box.close()
        close_provider(provider)


_SEND_SPANS = {ExecuteBatch: "send ExecuteBatch", TokenDeltas: "send TokenDeltas"}


async def _serve(loop: SchedulerLoop, mailbox: Mailbox, outboxes: dict[Peer, Outbox]) -> None:
    profiler = loop.profiler

    async def send(effects: list[Send]) -> None:
        for effect in effects:
            # A profile's span per send (encode, sign, zmq): free while none runs.
            with profiler.span(_SEND_SPANS.get(type(effect.message), "send")):
                await outboxes[effect.to].send(effect.message)

    while True:
        await send(loop.before_wait(trio.current_time()))
        message = await mailbox.receive(deadline=loop.deadline)
        if message is None:  # a profile's or an update drain's time is up
            loop.deadline_passed(trio.current_time())
            continue
        await send(loop.handle(message, trio.current_time()))
        if loop.stopped:
            return
        pending = mailbox.drain()
        loop.mailbox_drained(len(pending))
        for message in pending:
            await send(loop.handle(message, trio.current_time()))
            if loop.stopped:
                return

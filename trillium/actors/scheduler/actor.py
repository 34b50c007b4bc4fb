"""Scheduler actor: the trio shell around `scheduler.core.Scheduler`.

Consumes AddRequest, AbortRequest, FinishRequest (api, detokenizer),
BatchResult / ExecutorFailed (executor), Shutdown. Produces ExecuteBatch
(executor), TokenDeltas (detokenizer), SchedulerStats (api).

Loop: take every pending message, schedule one step, send it, and wait for
its result while still taking new requests and aborts; then turn the result
into token deltas. One step is in flight at a time: the executor runs steps
in order, so blocks freed by an abort during a step are only reused by a
later step.
"""

from __future__ import annotations

import logging

import trio

from trillium.actors.engine import ActorConfig, engine_codec
from trillium.actors.mailbox import Mailbox
from trillium.actors.protocol.control import Shutdown
from trillium.actors.protocol.execute import BatchResult, ExecutorFailed
from trillium.actors.protocol.requests import AbortRequest, AddRequest, FinishRequest
from trillium.actors.scheduler.core import build_scheduler
from trillium.actors.transport import Outbox

log = logging.getLogger(__name__)


class EngineStopped(Exception):
    pass


async def run(config: bytes | None, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    cfg = ActorConfig.from_bytes(config)
    codec = engine_codec()
    core = build_scheduler(cfg.engine)
    mailbox = Mailbox.bind(cfg.addresses.scheduler, codec)
    to_executor = Outbox.connect(cfg.addresses.executor, codec)
    to_detokenizer = Outbox.connect(cfg.addresses.detokenizer, codec)
    to_api = Outbox.connect(cfg.addresses.api, codec)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(mailbox.pump)
            task_status.started()
            await _loop(core, mailbox, to_executor, to_detokenizer, to_api)
            nursery.cancel_scope.cancel()
    finally:
        for box in (to_executor, to_detokenizer, to_api):
            box.close()


def _handle(core, message) -> bool:
    """Apply a request-lifecycle message to the core; False on Shutdown."""
    if isinstance(message, AddRequest):
        try:
            core.add_request(message)
        except ValueError as exc:  # the api validates first; this is the last guard
            log.warning("rejected request %s: %s", message.request_id, exc)
            core.reject(message.request_id, str(exc))
    elif isinstance(message, AbortRequest):
        core.abort(message.request_ids)
    elif isinstance(message, FinishRequest):
        core.finish(message.request_ids)
    elif isinstance(message, Shutdown):
        return False
    elif isinstance(message, ExecutorFailed):
        raise EngineStopped(f"executor failed at step {message.step_id}: {message.error}")
    else:
        log.error("scheduler: unexpected message %r", type(message).__name__)
    return True


async def _loop(core, mailbox: Mailbox, to_executor: Outbox, to_detokenizer: Outbox, to_api: Outbox) -> None:
    while True:
        for message in mailbox.drain():
            if not _handle(core, message):
                return
        pending = core.take_pending_deltas()
        if pending is not None:
            await to_detokenizer.send(pending)
        batch = core.schedule()
        if batch is None:
            # Going idle: report the state after aborts / finishes, so the api's
            # gauges do not keep showing requests that are gone.
            await to_api.send(core.stats())
            if not _handle(core, await mailbox.receive()):
                return
            continue
        await to_executor.send(batch)
        while True:
            message = await mailbox.receive()
            if isinstance(message, BatchResult):
                break
            if not _handle(core, message):
                return
        deltas = core.update_from_output(message)
        if deltas.deltas:
            await to_detokenizer.send(deltas)
        await to_api.send(core.stats())

"""Executor actor: the trio shell around `executor.core.ExecutorCore`.

Consumes ExecuteBatch (scheduler), lifecycle commands forwarded by the
scheduler (sleep / wake, weight updates, update groups, profiling; see
`executor/control.py`), Shutdown. Produces BatchResult, or ExecutorFailed
when a step raises (the scheduler then stops the engine), and one
ControlReply per lifecycle command (a failed command does not stop the
engine). Weights load, every step and every command run on one dedicated
torch thread (`torch_thread.py`), so the trio loop (and in-process
neighbours) never block on torch; the one exception is the rendezvous of
InitWeightsUpdateGroup, which runs on a thread of its own while steps go
on (`executor/control.py`).
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Awaitable, Callable

import trio

from trillium.actors.assembly import ActorConfig, engine_codec
from trillium.actors.executor.core import ExecutorCore
from trillium.actors.executor.control import ExecutorControl
from trillium.actors.liveness import PongSender
from trillium.actors.mailbox import Mailbox
from trillium.actors.protocol.supervision import Shutdown
from trillium.actors.protocol.execute import ExecuteBatch, ExecutorFailed
from trillium.actors.torch_thread import TorchThread
from trillium.actors.transport import Outbox

log = logging.getLogger(__name__)


async def run(config: bytes | None, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    cfg = ActorConfig.from_bytes(config)
    codec = engine_codec()
    torch_thread = TorchThread("trillium-executor")
    core = await torch_thread.run(ExecutorCore, cfg.engine)
    mailbox = Mailbox.bind(cfg.addresses.executor, codec, pongs=PongSender("executor", cfg.addresses.api, codec))
    to_scheduler = Outbox.connect(cfg.addresses.scheduler, codec)
    control = ExecutorControl(core, torch_thread)
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
            task_status.started()
            await _serve(core, control, torch_thread, mailbox, send)
            nursery.cancel_scope.cancel()
    finally:
        await control.aclose()
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(core.close)  # the disk tier's queued writes
        to_scheduler.close()
        torch_thread.close()


async def _serve(core: ExecutorCore, control: ExecutorControl, torch_thread: TorchThread, mailbox: Mailbox,
                 send: Callable[[object], Awaitable[None]]) -> None:
    while True:
        message = await mailbox.receive(deadline=control.profile_deadline)
        if message is None:  # the profile's time is up
            await control.expire_profile()
            continue
        if isinstance(message, Shutdown):
            return
        if isinstance(message, ExecutorControl.COMMANDS):
            reply = await control.handle(message)
            if reply is not None:  # None: a join, answered from its own task when it ends
                await send(reply)
            continue
        if not isinstance(message, ExecuteBatch):
            log.error("executor: unexpected message %r", type(message).__name__)
            continue
        try:
            result = await torch_thread.run(core.execute, message)
        except Exception as exc:
            log.exception("executor step %d failed", message.step_id)
            await send(
                ExecutorFailed(step_id=message.step_id, error="".join(traceback.format_exception_only(exc)).strip())
            )
            raise
        await send(result)

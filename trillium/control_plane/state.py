"""What every admin route shares: the engine bundle, the command runner, metrics.

Built once by `create_admin_app` and handed to each route module's
`blueprint()`. Owns the lock that runs memory- and weight-changing
commands one at a time, the running profile's end time, and the metrics.

A weight update (`update_weights`), whatever its source:

    close admission ("updating": the data plane answers 503 + Retry-After)
      -> abort requests in flight, if asked (SGLang's abort_all_requests)
      -> send the command with drain_timeout_s, await the engine's reply: while
         serving, the scheduler first lets the requests it holds finish (up to
         drain_timeout_s, then it aborts the ones still running), then updates
      -> record the new weight version, reopen admission

WHY drain: a response reports one weight version, the one current when it
was admitted. Letting the requests admitted before the update finish first
(SGLang's behaviour) makes that report exact. The drain is the scheduler's
(scheduler/control.py): it knows when the last request ends, so nothing
here polls. A paused engine is not drained: the operator chose what happens
to its requests (mode "keep" resumes them on the new weights, as in vLLM's
RLHF flow).
"""

from __future__ import annotations

import logging
import time
import uuid

import attrs
import trio

from trillium.actors.protocol.admin import (
    AbortRequests,
    ControlReply,
    GetEngineInfo,
)
from trillium.actors.protocol.vocabulary import EngineState
from trillium.control_plane.context import ControlPlaneEngine
from trillium.control_plane.errors import from_reply
from trillium.control_plane.metrics import AdminMetrics

log = logging.getLogger(__name__)


def new_command_id() -> str:
    return f"admin-{uuid.uuid4().hex[:16]}"


class AdminState:
    def __init__(self, engine: ControlPlaneEngine) -> None:
        self.engine = engine
        self.status = engine.status
        self.exclusive = trio.Lock()  # sleep, wake, weight loads and group setup: one at a time
        self.profiling_until_s = 0.0  # monotonic end of the running profile (it stops itself then)
        self.metrics = AdminMetrics(engine.engine_config.served_model_name, self.status, lambda: self.profiling,
                                    engine.client, engine.metrics_registry)

    @property
    def profiling(self) -> bool:
        """A profile started here is running (best effort: the engine keeps the truth)."""
        return time.monotonic() < self.profiling_until_s

    async def command(self, command, timeout_s: float | None = None) -> ControlReply:
        """Send one lifecycle command and return the engine's reply, errors included."""
        timeout_s = self.engine.command_timeout_s if timeout_s is None else timeout_s
        # WHY debug for GetEngineInfo: /server_info may be polled; state changes are what an operator reads.
        level = logging.DEBUG if isinstance(command, GetEngineInfo) else logging.INFO
        log.log(level, "admin command %s (%s)", type(command).__name__, command.command_id)
        reply = await self.engine.client.control(command, timeout_s)
        if not reply.ok:
            log.warning("admin command %s failed: %d %s", type(command).__name__, reply.status, reply.message)
        return reply

    async def run(
        self,
        command,
        *,
        settle_state: str | None = None,
        weight_version: str | None = None,
        timeout_s: float | None = None,
    ) -> ControlReply:
        """Send, raise the engine's error as an AdminError, record the resulting state; the reply.

        The reply's own `state` / `weight_version` (the engine sends both
        with every reply) win over what the route expects."""
        reply = await self.command(command, timeout_s)
        reported_state = reply.data.get("state", reply.data.get("engine_state"))
        reported_state = reported_state if isinstance(reported_state, str) else None
        if not reply.ok:
            if reported_state:
                self.status.settle(state=reported_state)
            raise from_reply(reply)
        reported_version = reply.data.get("weight_version")
        version = str(reported_version) if reported_version is not None else weight_version
        if reported_state or settle_state or version:
            self.status.settle(state=reported_state or settle_state, weight_version=version)
        return reply

    async def update_weights(self, command, *, source: str, abort_all_requests: bool = False) -> ControlReply:
        """Run one weight-update command with admission closed (see the module docstring)."""
        start_s = time.monotonic()
        outcome = "error"
        try:
            async with self.exclusive:
                with self.status.closing(EngineState.UPDATING_WEIGHTS):
                    if abort_all_requests:
                        await self.run(AbortRequests(new_command_id()))
                    drain_s = self.engine.drain_timeout_s
                    command = attrs.evolve(command, drain_timeout_s=drain_s)
                    # WHY the drain on top: the command's own timeout starts after it.
                    reply = await self.run(command, weight_version=command.weight_version,
                                           timeout_s=self.engine.command_timeout_s + drain_s)
            outcome = "success"
            return reply
        finally:
            self.metrics.on_weight_update(source, outcome, time.monotonic() - start_s)

    def healthy(self) -> tuple[bool, object]:
        try:
            return self.engine.health()
        except Exception as exc:  # WHY: a failing probe means unhealthy, not a 500
            log.warning("health probe failed: %s", exc)
            return False, f"health probe failed: {exc}"

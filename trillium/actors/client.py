"""The api side of the engine: submit requests, stream their outputs.

Owns the api inbox (RequestOutputs from the detokenizer, SchedulerStats
from the scheduler) and the registry of live requests. Used by
`trillium.LLM` and by the HTTP data plane alike.

`submit()` returns a `RequestStream`; a router task appends each
RequestOutputDelta to its stream. Streams buffer (bounded by the request's
max_tokens), so a slow consumer never stalls the router for everyone else.

When the engine cannot go on (an actor died, or stalled: actors/liveness.py),
`fail_all(reason)` ends every open stream with `EngineFailed`, which the
reader gets from its `async for` after the deltas already received: the
HTTP planes turn it into an error event or a 5xx body instead of a cut
connection. The router also records each actor's last `Pong` and the time of
the last step progress (stats or outputs) for the stall watchdog.
"""

from __future__ import annotations

import logging
import time

import attrs
import numpy as np
import trio

from trillium.actors.assembly import ActorConfig
from trillium.actors.links import Links
from trillium.actors.protocol.supervision import Pong, Shutdown
from trillium.actors.protocol.admin import ControlReply
from trillium.actors.protocol.outputs import RequestOutputDelta, RequestOutputs, SchedulerStats
from trillium.actors.protocol.rejections import FramesRejected
from trillium.actors.protocol.requests import AbortRequest, AddRequest
from trillium.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class EngineFailed(Exception):
    """The engine stopped serving this request (an actor died or stalled); the message says why."""


class RequestStream:
    """Deltas of one request, in order; iterate with `async for`."""

    def __init__(self, request_id: str, span=None) -> None:
        self.request_id = request_id
        self._deltas: list[RequestOutputDelta] = []
        self._event = trio.Event()
        self.finished = False
        self.span = span  # observability/tracing.py RequestSpan of a traced request, else None
        self.lora_id = 0
        self._error: EngineFailed | None = None

    def _fail(self, error: EngineFailed) -> None:
        if self.finished:
            return
        self._error = error
        self.finished = True
        self._event.set()

    def _push(self, delta: RequestOutputDelta) -> None:
        self._deltas.append(delta)
        self.finished = self.finished or delta.finished
        self._event.set()
        if self.span is not None:
            self.span.observe(delta)  # the finished delta ends the span

    def __aiter__(self):
        return self._iterate()

    async def _iterate(self):
        while True:
            await self._event.wait()
            deltas, self._deltas = self._deltas, []
            self._event = trio.Event()
            for delta in deltas:
                yield delta
                if delta.finished:
                    return
            if self._error is not None:
                raise self._error


class _ReplyWaiter:
    def __init__(self) -> None:
        self.event = trio.Event()
        self.reply: ControlReply | None = None


class EngineClient:
    def __init__(self, config: ActorConfig) -> None:
        self.config = config
        links = Links(config, "api")
        self._mailbox = links.mailbox()
        self._to_scheduler = links.outbox("scheduler")
        self._to_executor = links.outbox("executor")
        self._to_detokenizer = links.outbox("detokenizer")
        self._actor_rejections: dict[str, FramesRejected] = {}
        self._streams: dict[str, RequestStream] = {}
        self._replies: dict[str, _ReplyWaiter] = {}
        self.last_stats: SchedulerStats | None = None
        # Called with every SchedulerStats (metrics fold its events in); must not block.
        self.stats_listeners: list = []
        # Called with the final RequestOutputDelta of every request (metrics count finishes).
        self.finish_listeners: list = []
        # Liveness (trio clock): each actor's last Pong, and the last stats / outputs.
        self.last_pong_s: dict[str, float] = {}
        self.last_progress_s = 0.0

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Route outputs until cancelled."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._mailbox.pump)
            task_status.started()
            while True:
                message = await self._mailbox.receive()
                if isinstance(message, RequestOutputs | SchedulerStats):
                    self.last_progress_s = trio.current_time()
                if isinstance(message, RequestOutputs):
                    for delta in message.deltas:
                        stream = self._streams.get(delta.request_id)
                        if stream is not None:
                            stream._push(delta)
                            if delta.finished:
                                del self._streams[delta.request_id]
                                self._notify(self.finish_listeners, delta)
                elif isinstance(message, SchedulerStats):
                    self.last_stats = message
                    self._notify(self.stats_listeners, message)
                elif isinstance(message, ControlReply):
                    waiter = self._replies.get(message.command_id)
                    if waiter is not None:
                        waiter.reply = message
                        waiter.event.set()
                elif isinstance(message, FramesRejected):
                    self._actor_rejections[message.actor] = message
                elif isinstance(message, Pong):
                    self.last_pong_s[message.actor] = trio.current_time()

    def fail_all(self, reason: str, *, commands: bool = False) -> list[str]:
        """End every open stream with EngineFailed(reason) (and, with `commands`, answer every
        pending control command 503); the engine ids the streams had."""
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream._fail(EngineFailed(reason))
        for command_id, waiter in self._replies.items() if commands else ():
            if waiter.reply is None:
                waiter.reply = ControlReply(command_id, 503, reason)
                waiter.event.set()
        return list(streams)

    @staticmethod
    def _notify(listeners: list, message) -> None:
        for listener in listeners:
            try:
                listener(message)
            except Exception:  # WHY: a metrics bug must not stop the output router
                log.exception("listener failed")

    def rejected_frames(self) -> dict[str, dict[str, int]]:
        """Frames each engine inbox dropped (gate.py), by actor and reason: lifetime totals."""
        reports = {**self._actor_rejections, "api": self._mailbox.gate.report()}
        return {actor: dict(report.totals) for actor, report in reports.items()}

    @property
    def mailbox_depth(self) -> int:
        """Messages (outputs, stats, replies) decoded and waiting for the router."""
        return self._mailbox.depth

    def requests_using_lora(self, lora_id: int) -> list[str]:
        """Unfinished requests submitted with adapter `lora_id`."""
        return [rid for rid, stream in self._streams.items() if stream.lora_id == lora_id]

    def active_request_ids(self) -> list[str]:
        """Engine ids of the requests submitted and not yet finished."""
        return list(self._streams)

    @property
    def num_active_requests(self) -> int:
        """Requests submitted and not yet finished (the queue-limit and drain gauge)."""
        return len(self._streams)

    async def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int] | np.ndarray,
        params: SamplingParams,
        eos_token_ids: tuple[int, ...],
        *,
        priority: int = 0,
        group_id: str | None = None,
        trace=None,
        lora_id: int = 0,
        cache_salt: str | None = None,
        choice_ids: tuple[str, ...] | None = None,
    ) -> RequestStream | list[RequestStream]:
        """One engine request (params.n == 1), or with `choice_ids` all the choices of
        one request in a single AddRequest (params.n == len(choice_ids)). `trace`: the
        HTTP request's `RequestTracer` when it is sampled for tracing
        (observability/tracing.py), else None. `cache_salt`: see AddRequest."""
        streams = self._open_streams(choice_ids or (request_id,), lora_id)
        span = None
        if trace is not None:
            span = trace.start(request_id, params, len(prompt_token_ids))
            streams[0].span = span
        await self._to_scheduler.send(
            AddRequest(
                request_id=request_id,
                prompt_token_ids=np.asarray(prompt_token_ids, dtype=np.int32),
                sampling=params,
                eos_token_ids=tuple(eos_token_ids),
                arrival_time=time.time(),
                priority=priority,
                group_id=group_id,
                lora_id=lora_id,
                trace_context=None if span is None else span.carrier,
                cache_salt=cache_salt,
            )
        )
        return streams[0] if choice_ids is None else streams

    def _open_streams(self, request_ids, lora_id: int) -> list[RequestStream]:
        taken = [rid for rid in request_ids if rid in self._streams]
        if taken:
            raise ValueError(f"request id {taken[0]!r} is already in use")
        streams = []
        for rid in request_ids:
            stream = self._streams[rid] = RequestStream(rid, None)
            stream.lora_id = lora_id
            streams.append(stream)
        return streams

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int] | np.ndarray,
        params: SamplingParams,
        eos_token_ids: tuple[int, ...],
        *,
        priority: int = 0,
        trace=None,
        lora_id: int = 0,
        cache_salt: str | None = None,
    ) -> list[RequestStream]:
        """Submit a request with `params.n` choices: one stream per choice.

        n > 1 becomes n engine requests `<id>-<i>` in one group (the scheduler
        admits the siblings once the first has prefilled, so they share its
        prompt blocks); with a seed, choice i samples with `seed + i`, as vLLM.
        They cross to the scheduler in one AddRequest (the scheduler expands
        it), so the prompt and stop list are sent once. A traced request
        (`trace`) gets one llm_request span per choice, as vLLM: its choices
        go as one AddRequest each, with their own span carrier.
        """
        if params.n == 1:
            return [await self.submit(request_id, prompt_token_ids, params, eos_token_ids, priority=priority,
                                      trace=trace, lora_id=lora_id, cache_salt=cache_salt)]
        if trace is None:
            choice_ids = tuple(f"{request_id}-{i}" for i in range(params.n))
            return await self.submit(request_id, prompt_token_ids, params, eos_token_ids, priority=priority,
                                     lora_id=lora_id, cache_salt=cache_salt, choice_ids=choice_ids)
        streams = []
        for i in range(params.n):
            child = attrs.evolve(params, n=1, seed=None if params.seed is None else params.seed + i)
            streams.append(
                await self.submit(
                    f"{request_id}-{i}", prompt_token_ids, child, eos_token_ids,
                    priority=priority, group_id=request_id, trace=trace, lora_id=lora_id,
                    cache_salt=cache_salt,
                )
            )
        return streams

    async def control(self, command, timeout_s: float = 300.0) -> ControlReply:
        """Send a lifecycle command (protocol/admin.py) and await its reply.

        The engine answers every command exactly once; a missing answer after
        `timeout_s` becomes a 504-status reply instead of a hang.
        """
        waiter = _ReplyWaiter()
        self._replies[command.command_id] = waiter
        try:
            await self._to_scheduler.send(command)
            with trio.move_on_after(timeout_s):
                await waiter.event.wait()
        finally:
            del self._replies[command.command_id]
        if waiter.reply is None:
            return ControlReply(command.command_id, 504, f"engine did not answer within {timeout_s:.0f} s")
        return waiter.reply

    async def abort(self, request_ids: list[str]) -> None:
        await self._to_scheduler.send(AbortRequest(request_ids=tuple(request_ids)))

    async def shutdown_engine(self) -> None:
        """Ask every actor to return (in-process engines end this way)."""
        for box in (self._to_scheduler, self._to_executor, self._to_detokenizer):
            await box.send(Shutdown(reason="client shutdown"))

    def close(self) -> None:
        for box in (self._to_scheduler, self._to_executor, self._to_detokenizer):
            box.close()

"""One HTTP request's engine requests: admission, submission, merged deltas, abort.

An HTTP request becomes one engine request per prompt, each with `n`
choices (the client splits n > 1 into sibling requests); choice `index` is
`prompt_index * n + i`, as vLLM numbers them.

`Generation.feed(nursery)` is the only way to read outputs: an async
context manager yielding an async iterable of `(Choice, RequestOutputDelta)`
from every choice, merged in arrival order. With several choices a pump
task (in the given nursery) forwards each stream into a bounded channel;
one choice (the common case) is read straight from its stream, which saves
a task switch and a channel hop per streamed token. Leaving the context
for any reason (done, client gone, error) cancels the pump and aborts the
engine requests not yet finished, from a shielded scope, so their KV blocks
are freed even when the handler was cancelled by a disconnect.

`InflightRequests` is admission control, counted in engine requests (what
lands on the scheduler: prompts x n of each HTTP request), not in HTTP
requests: a request is charged its whole size when admitted, and each
engine request leaves the count when it finishes. A stream's `finished`
flag is set by the client's router even when nobody reads it, so a request
whose reader never started still leaves the count when the engine finishes it.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Sequence

import attrs
import trio

from trillium.actors.client import EngineFailed
from trillium.actors.protocol.outputs import RequestOutputDelta
from trillium.data_plane.errors import bad_request, overloaded
from trillium.sampling_params import SamplingParams

log = logging.getLogger(__name__)

# WHY 64: deltas are small; the engine side (RequestStream) buffers anyway,
# so this only bounds what sits between the pump and the HTTP writer.
_FEED_CHANNEL_SIZE = 64
_ABORT_TIMEOUT_S = 5.0
RETRY_AFTER_S = 1


@attrs.define
class Choice:
    """One engine request's progress, as the routes and metrics see it."""

    index: int
    prompt_index: int
    stream: object  # trillium.actors.client.RequestStream
    arrival_s: float
    num_generated_tokens: int = 0
    first_token_s: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.stream.finished

    @property
    def rejection(self) -> str | None:
        """Why the engine refused this request (an abort before any token, with a reason)."""
        if self.finish_reason == "abort" and self.num_generated_tokens == 0 and isinstance(self.stop_reason, str):
            return self.stop_reason
        return None


class Generation:
    """The choices of one HTTP request; `submit` fills them, `feed` reads them.

    `weight_version` is the engine's weight version when the request was
    admitted: the one every part of its response reports."""

    def __init__(self, client, weight_version: str = "0", num_engine_requests: int = 1, *,
                 log_requests: bool = False) -> None:
        self._client = client
        self.weight_version = weight_version
        self.num_engine_requests = num_engine_requests  # what admission charged (prompts x n)
        self._log_requests = log_requests  # --enable-log-requests
        self.choices: list[Choice] = []
        self._submitting = False
        self._pump_error: BaseException | None = None  # EngineFailed of a choice, re-raised to the reader

    @property
    def num_unfinished(self) -> int:
        """Engine requests charged and not finished (those not yet submitted count too)."""
        not_submitted = self.num_engine_requests - len(self.choices) if self._submitting else 0
        return max(0, not_submitted) + sum(not c.stream.finished for c in self.choices)

    @property
    def finished(self) -> bool:
        return not self._submitting and all(choice.stream.finished for choice in self.choices)

    async def submit(
        self,
        request_id: str,
        prompts: Sequence[Sequence[int]],
        params: Sequence[SamplingParams],
        eos_token_ids: tuple[int, ...],
        *,
        priority: int = 0,
        trace=None,
        lora_id: int | Sequence[int] = 0,
        request_ids: Sequence[str] | None = None,
        cache_salt: str | None = None,
        final_only: bool = False,
    ) -> None:
        """One engine request per prompt; choices numbered prompt_index * n + i.
        `trace`: the request's RequestTracer when sampled for tracing, else None.
        `lora_id`: the LoRA adapter of every choice (0: the base model), or one per prompt.
        `request_ids`: the engine id of each prompt's request (default: `request_id`,
        or `request_id-<prompt_index>` for several prompts).
        `cache_salt`: separates the requests' prefix-cache entries (AddRequest).
        `final_only`: the response is sent whole once the requests end (not streamed), so the
        engine may hold their tokens in chunks (SamplingParams.final_only)."""
        arrival_s = time.monotonic()
        lora_ids = [lora_id] * len(prompts) if isinstance(lora_id, int) else list(lora_id)
        self._submitting = True
        try:
            for prompt_index, (ids, prompt_params) in enumerate(zip(prompts, params)):
                if final_only:
                    prompt_params = attrs.evolve(prompt_params, final_only=True)
                if request_ids is not None:
                    engine_id = request_ids[prompt_index]
                else:
                    engine_id = request_id if len(prompts) == 1 else f"{request_id}-{prompt_index}"
                if self._log_requests:
                    log.info("request %s: %d prompt tokens, lora %d, params %s", engine_id, len(ids),
                             lora_ids[prompt_index], prompt_params)
                streams = await self._client.generate(engine_id, ids, prompt_params, eos_token_ids, priority=priority,
                                                      trace=trace, lora_id=lora_ids[prompt_index],
                                                      cache_salt=cache_salt)
                for i, stream in enumerate(streams):
                    self.choices.append(Choice(prompt_index * prompt_params.n + i, prompt_index, stream, arrival_s))
        except BaseException:
            await self.abort_unfinished()
            raise
        finally:
            self._submitting = False

    @contextlib.asynccontextmanager
    async def feed(self, nursery: trio.Nursery) -> AsyncIterator[AsyncIterator[tuple[Choice, RequestOutputDelta]]]:
        if len(self.choices) == 1 and not self._submitting:
            try:
                async with contextlib.aclosing(self._single(self.choices[0])) as events:
                    yield events
            finally:
                await self.abort_unfinished()
            return
        send, receive = trio.open_memory_channel(_FEED_CHANNEL_SIZE)
        scope = trio.CancelScope()
        nursery.start_soon(self._pump, send, scope)
        try:
            async with receive:
                async with contextlib.aclosing(self._merged(receive)) as events:
                    yield events
        finally:
            scope.cancel()
            await self.abort_unfinished()

    async def _merged(self, receive: trio.MemoryReceiveChannel) -> AsyncIterator[tuple[Choice, RequestOutputDelta]]:
        async for item in receive:
            yield item
        if self._pump_error is not None:
            raise self._pump_error

    async def _pump(self, send: trio.MemorySendChannel, scope: trio.CancelScope) -> None:
        with scope:
            async with send:
                try:
                    async with trio.open_nursery() as nursery:
                        for choice in self.choices:
                            nursery.start_soon(self._forward, choice, send)
                except Exception:  # WHY: never take the app's nursery down; the reader sees an early end
                    log.exception("output pump failed")

    async def _single(self, choice: Choice) -> AsyncIterator[tuple[Choice, RequestOutputDelta]]:
        async for delta in choice.stream:
            self._observe(choice, delta)
            yield choice, delta

    async def _forward(self, choice: Choice, send: trio.MemorySendChannel) -> None:
        try:
            async for delta in choice.stream:
                self._observe(choice, delta)
                try:
                    await send.send((choice, delta))
                except trio.BrokenResourceError:
                    return  # the reader left; abort_unfinished takes it from here
        except EngineFailed as exc:  # the engine gave up on this choice: the reader raises it
            self._pump_error = exc

    def _observe(self, choice: Choice, delta: RequestOutputDelta) -> None:
        choice.num_cached_tokens = max(choice.num_cached_tokens, delta.num_cached_tokens)
        if delta.new_token_ids:
            if choice.first_token_s is None:
                choice.first_token_s = time.monotonic()
            choice.num_generated_tokens += len(delta.new_token_ids)
        if delta.finished:
            choice.finish_reason = delta.finish_reason or "stop"
            choice.stop_reason = delta.stop_reason

    async def abort_unfinished(self) -> None:
        """Abort every engine request still running; safe to call from a cancelled scope."""
        unfinished = [c for c in self.choices if not c.finished]
        if not unfinished:
            return
        for choice in unfinished:
            choice.finish_reason = "abort"
        request_ids = [c.stream.request_id for c in unfinished]
        with trio.move_on_after(_ABORT_TIMEOUT_S, shield=True):
            try:
                await self._client.abort(request_ids)
            except Exception as exc:  # WHY: at shutdown the client may be closed; the engine goes too
                log.warning("could not abort %s: %s", request_ids, exc)
                return
        log.debug("aborted %s", request_ids)


class InflightRequests:
    """Admission control: at most `limit` unfinished engine requests."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self._generations: list[Generation] = []

    def count(self) -> int:
        """HTTP requests with unfinished engine requests (the in-flight gauge)."""
        self._generations = [g for g in self._generations if not g.finished]
        return len(self._generations)

    def num_engine_requests(self) -> int:
        self.count()
        return sum(g.num_unfinished for g in self._generations)

    def admit(self, generation: Generation) -> None:
        """Count `generation` from now on, or raise 503 when its engine requests
        would pass the limit. Call right before `generation.submit` with no
        await in between, so the bound is exact.

        NOTE: one request larger than the whole limit could never be admitted:
        it is a 400 (retrying cannot help), not a 503."""
        if self.limit is None:
            self._generations.append(generation)
            return
        cost = generation.num_engine_requests
        if cost > self.limit:
            raise bad_request(f"this request makes {cost} engine requests (prompts x n); this server admits at "
                              f"most {self.limit} at once (--max-queued-requests): split it")
        if self.num_engine_requests() + cost > self.limit:
            raise overloaded(RETRY_AFTER_S)
        self._generations.append(generation)


__all__ = ["Choice", "Generation", "InflightRequests", "RETRY_AFTER_S"]

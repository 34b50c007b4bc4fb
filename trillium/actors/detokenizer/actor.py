"""Detokenizer actor: token deltas in, text deltas out.

Consumes TokenDeltas (scheduler), Shutdown, and StartProfile / StopProfile
forwarded by the scheduler (answered with a ControlReply to the scheduler;
see observability/profiling.py). Produces RequestOutputs (api) and
FinishRequest (scheduler) when a stop string ends a request. Owns one
`IncrementalDetokenizer` per live request, created from the DetokenizeSpec
on the request's first delta and dropped when the request finishes.

A request that a stop string finished may still receive tokens from a step
that was already in flight; those are dropped here. With an OTLP endpoint
configured, detailed-traced requests get a `detokenize` span
(observability/actor_spans.py).
"""

from __future__ import annotations

import logging
import math

import trio

from trillium.actors.detokenizer.core import IncrementalDetokenizer
from trillium.actors.engine import ActorConfig, engine_codec
from trillium.actors.protocol.control import Shutdown
from trillium.actors.protocol.lifecycle import ControlReply, StartProfile, StopProfile
from trillium.actors.protocol.outputs import RequestDelta, RequestOutputDelta, RequestOutputs, TokenDeltas
from trillium.actors.protocol.requests import FinishRequest
from trillium.actors.transport import Inbox, Outbox
from trillium.observability.actor_spans import DetokenizerSpans, actor_tracer, close_provider
from trillium.observability.profiling import LoopProfiler, NotProfiling

log = logging.getLogger(__name__)


class DetokenizerRegistry:
    """Pure core of the actor: request id -> incremental detokenizer."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self._live: dict[str, IncrementalDetokenizer] = {}
        self._stopped: set[str] = set()  # finished by a stop string, engine not yet told

    def process(self, message: TokenDeltas) -> tuple[RequestOutputs, FinishRequest | None]:
        outputs: list[RequestOutputDelta] = []
        stopped: list[str] = []
        for delta in message.deltas:
            out = self._one(delta)
            if out is None:
                continue
            outputs.append(out)
            if out.finished and delta.finish_reason is None:
                stopped.append(delta.request_id)
        finish = FinishRequest(request_ids=tuple(stopped)) if stopped else None
        return RequestOutputs(deltas=tuple(outputs)), finish

    def _one(self, delta: RequestDelta) -> RequestOutputDelta | None:
        rid = delta.request_id
        detok = self._live.get(rid)
        if detok is None:
            if rid in self._stopped:
                if delta.finish_reason is not None:
                    self._stopped.discard(rid)
                return None  # tokens past a stop string
            if delta.spec is None:
                # Rejected or aborted before its first token: no text to decode.
                if delta.finish_reason is None:
                    log.error("detokenizer: delta for unknown request %s", rid)
                    return None
                return RequestOutputDelta(
                    request_id=rid, text="", new_token_ids=(), finished=True,
                    finish_reason=delta.finish_reason, stop_reason=delta.stop_reason,
                    num_prompt_tokens=delta.num_prompt_tokens,
                )
            spec = delta.spec
            detok = IncrementalDetokenizer(
                self._tokenizer, spec.prompt_token_ids,
                skip_special_tokens=spec.skip_special_tokens, stop=spec.stop,
                include_stop_str_in_output=spec.include_stop_str_in_output, min_tokens=spec.min_tokens,
            )
            self._live[rid] = detok
        before = len(detok.token_ids)
        # The scheduler itself finishes with "stop" only on EOS or a stop token id.
        update = detok.update(list(delta.new_token_ids), stop_token_terminated=delta.finish_reason == "stop")
        text = update.text_delta
        finished, finish_reason, stop_reason = False, None, None
        if update.finished:
            finished, finish_reason, stop_reason = True, "stop", update.stop_reason
        elif delta.finish_reason is not None:
            text += detok.flush().text_delta
            finished, finish_reason, stop_reason = True, delta.finish_reason, delta.stop_reason
        token_ids = tuple(detok.token_ids[before:])
        if finished:
            del self._live[rid]
            if delta.finish_reason is None:
                self._stopped.add(rid)
        return RequestOutputDelta(
            request_id=rid, text=text, new_token_ids=token_ids, finished=finished,
            finish_reason=finish_reason, stop_reason=stop_reason,
            logprobs=delta.logprobs[: len(token_ids)] if delta.logprobs else (),
            prompt_logprobs=delta.prompt_logprobs,
            num_prompt_tokens=delta.num_prompt_tokens, num_cached_tokens=delta.num_cached_tokens,
            queue_time_s=delta.queue_time_s,
        )


async def run(config: bytes | None, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    from trillium.models.tokenizer import load_tokenizer

    cfg = ActorConfig.from_bytes(config)
    codec = engine_codec()
    tokenizer = await trio.to_thread.run_sync(load_tokenizer, cfg.engine.model)
    registry = DetokenizerRegistry(tokenizer.backend)
    inbox = Inbox.bind(cfg.addresses.detokenizer, codec)
    to_api = Outbox.connect(cfg.addresses.api, codec)
    to_scheduler = Outbox.connect(cfg.addresses.scheduler, codec)
    profiler = LoopProfiler("detokenizer")
    provider, tracer = actor_tracer(cfg.engine, "detokenizer")
    spans = DetokenizerSpans(tracer) if tracer is not None else None
    task_status.started()
    try:
        while True:
            message = await _receive(inbox, profiler)
            if message is None:  # the profile's time is up
                profiler.expire(trio.current_time())
                continue
            if isinstance(message, Shutdown):
                return
            if isinstance(message, (StartProfile, StopProfile)):
                await to_scheduler.send(_profile_command(profiler, message))
                continue
            if not isinstance(message, TokenDeltas):
                log.error("detokenizer: unexpected message %r", type(message).__name__)
                continue
            with profiler.span("TokenDeltas"):
                outputs, finish = registry.process(message)
            if spans is not None:
                spans.observe(message, outputs)
            if finish is not None:
                await to_scheduler.send(finish)
            if outputs.deltas:
                await to_api.send(outputs)
    finally:
        profiler.close()
        inbox.close()
        to_api.close()
        to_scheduler.close()
        close_provider(provider)


async def _receive(inbox: Inbox, profiler: LoopProfiler):
    if profiler.deadline == math.inf:
        return await inbox.receive()
    with trio.move_on_at(profiler.deadline):
        return await inbox.receive()
    return None


def _profile_command(profiler: LoopProfiler, message: StartProfile | StopProfile) -> ControlReply:
    try:
        if isinstance(message, StartProfile):
            profiler.start(message.profile_dir, trio.current_time(), message.max_duration_s)
            return ControlReply(message.command_id, 200, "profiling", {"files": []})
        return ControlReply(message.command_id, 200, "ok", {"files": profiler.stop()})
    except NotProfiling as exc:
        return ControlReply(message.command_id, 409, str(exc))
    except OSError as exc:
        return ControlReply(message.command_id, 400, f"cannot use profile_dir {message.profile_dir!r}: {exc}")

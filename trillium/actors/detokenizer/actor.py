"""Detokenizer actor: the trio shell around `detokenizer.core.DetokenizerRegistry`.

Consumes TokenDeltas (scheduler), Shutdown, and StartProfile / StopProfile
forwarded by the scheduler (answered with a ControlReply to the scheduler;
see observability/profiling.py). Produces RequestOutputs (api) and
FinishRequest (scheduler) when a stop string ends a request. The registry
owns one `IncrementalDetokenizer` per live request, created from the
DetokenizeSpec on the request's first delta and dropped when the request
finishes; it drops tokens that reach a request a stop string already
finished. With an OTLP endpoint configured, detailed-traced requests get a
`detokenize` span (observability/actor_spans.py). Its tokenizer backend:
under `trillium serve` the one the api published (backend_handoff.py), else
loaded here.
"""

from __future__ import annotations

import logging

import trio

from trillium.actors.detokenizer.backend_handoff import receive_backend
from trillium.actors.detokenizer.core import DetokenizerRegistry
from trillium.actors.assembly import ActorConfig, engine_codec
from trillium.actors.links import Links
from trillium.actors.mailbox import Mailbox
from trillium.actors.protocol.supervision import Shutdown
from trillium.actors.protocol.admin import ControlReply, StartProfile, StopProfile
from trillium.actors.protocol.outputs import TokenDeltas
from trillium.actors.transport import Outbox
from trillium.observability.actor_spans import DetokenizerSpans, actor_tracer, close_provider
from trillium.observability.profiling import LoopProfiler, NotProfiling

log = logging.getLogger(__name__)


async def run(config: bytes | None, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    cfg = ActorConfig.from_bytes(config)
    codec = engine_codec()
    registry = DetokenizerRegistry(await _tokenizer_backend(cfg))
    links = Links(cfg, "detokenizer", codec)
    mailbox = links.mailbox()
    to_api = links.outbox("api")
    to_scheduler = links.outbox("scheduler")
    profiler = LoopProfiler("detokenizer")
    provider, tracer = actor_tracer(cfg.engine, "detokenizer")
    spans = DetokenizerSpans(tracer) if tracer is not None else None
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(mailbox.pump)
            task_status.started()
            await _serve(registry, mailbox, to_api, to_scheduler, profiler, spans)
            nursery.cancel_scope.cancel()
    finally:
        profiler.close()
        to_api.close()
        to_scheduler.close()
        close_provider(provider)


async def _tokenizer_backend(cfg: ActorConfig):
    """The api's published backend under `trillium serve` (backend_handoff.py), else loaded here."""
    if cfg.tokenizer_backend_file is not None:
        return await receive_backend(cfg.tokenizer_backend_file, cfg.engine.tokenizer_path)
    from trillium.models.tokenizer import load_tokenizer

    return (await trio.to_thread.run_sync(load_tokenizer, cfg.engine.tokenizer_path)).backend


async def _serve(registry: DetokenizerRegistry, mailbox: Mailbox, to_api: Outbox, to_scheduler: Outbox,
                 profiler: LoopProfiler, spans: DetokenizerSpans | None) -> None:
    while True:
        message = await mailbox.receive(deadline=profiler.deadline)
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
            with profiler.span("send RequestOutputs"):
                await to_api.send(outputs)


def _profile_command(profiler: LoopProfiler, message: StartProfile | StopProfile) -> ControlReply:
    try:
        if isinstance(message, StartProfile):
            profiler.start(message.profile_dir, trio.current_time(), message.max_duration_s,
                           python_profile=not message.timeline)
            return ControlReply(message.command_id, 200, "profiling", {"files": []})
        return ControlReply(message.command_id, 200, "ok", {"files": profiler.stop()})
    except NotProfiling as exc:
        return ControlReply(message.command_id, 409, str(exc))
    except OSError as exc:
        return ControlReply(message.command_id, 400, f"cannot use profile_dir {message.profile_dir!r}: {exc}")

"""Detailed tracing inside the engine: the scheduler's and detokenizer's stage spans.

Only requests whose carrier (`AddRequest.trace_context`, handed on in the
`DetokenizeSpec`) has the detailed flag (`tracing.DETAILED_KEY`) get
spans here; their parent is the api's `llm_request` span named by the
carrier's `traceparent`. Spans are emitted when the request ends, with
explicit start and end times from the timestamps the actors already keep,
so a traced request costs nothing while it runs:

    scheduler    queue     queued (scheduler received it) -> first scheduled
                 prefill   first scheduled -> first token (all prefill chunks)
                 decode    first token -> last token (steps aggregated:
                           tokens, steps, preemptions)
    detokenizer  detokenize  first token delta -> request finished

Each actor process exports through its own provider (`actor_tracer`),
flushed when the actor stops (`close_provider`). Timestamps are wall
clock (`time.time`), like the scheduler's RequestTimes.
"""

from __future__ import annotations

import logging
import time

from trillium.observability.tracing import (
    INSTRUMENTATION_NAME,
    close_provider,
    context_from_carrier,
    is_detailed,
    make_tracer_provider,
    to_ns,
)

log = logging.getLogger(__name__)

__all__ = ["DetokenizerSpans", "SchedulerSpans", "actor_tracer", "close_provider"]


def actor_tracer(engine_config, process_name: str):
    """(provider, tracer) for an actor when the engine config has an OTLP
    endpoint, else (None, None)."""
    endpoint = engine_config.otlp_traces_endpoint
    if not endpoint:
        return None, None
    provider = make_tracer_provider(endpoint, process_name)
    return provider, provider.get_tracer(INSTRUMENTATION_NAME)


class SchedulerSpans:
    """`on_finished(request)` for the scheduler core: the request's stage spans."""

    def __init__(self, tracer) -> None:
        self._tracer = tracer

    def on_finished(self, request) -> None:
        """Called by `Scheduler._finish` with the request's final status set."""
        carrier = request.trace_context
        if not is_detailed(carrier) or request.times is None:
            return
        try:
            self._emit(request, context_from_carrier(carrier), time.time())
        except Exception:  # WHY: a tracing bug must never take the scheduler down
            log.exception("could not emit the spans of request %s", request.request_id)

    def _emit(self, request, parent, now_s: float) -> None:
        times = request.times
        common = {"gen_ai.request.id": request.request_id}
        scheduled_s = times.scheduled_s
        self._span("queue", parent, times.queued_s, scheduled_s if scheduled_s is not None else now_s,
                   {**common, "trillium.scheduled": scheduled_s is not None})
        if scheduled_s is None:
            return
        first_s, last_s = times.first_token_s, times.last_token_s
        self._span("prefill", parent, scheduled_s, first_s if first_s is not None else now_s, {
            **common,
            "gen_ai.usage.prompt_tokens": request.num_prompt_tokens,
            "trillium.num_cached_tokens": max(0, request.num_cached_tokens),
        })
        if first_s is None:
            return
        num_output = request.num_output_tokens
        self._span("decode", parent, first_s, last_s, {
            **common,
            "gen_ai.usage.completion_tokens": num_output,
            "trillium.num_decode_steps": max(0, num_output - 1),
            "trillium.num_preemptions": request.num_preemptions,
            "trillium.finish_reason": request.status.finish_reason or "",
        })

    def _span(self, name: str, parent, start_s: float, end_s: float, attributes: dict) -> None:
        span = self._tracer.start_span(name, context=parent, start_time=to_ns(start_s), attributes=attributes)
        span.end(end_time=to_ns(max(start_s, end_s)))


class DetokenizerSpans:
    """Per traced request: first delta -> finished, with the tokens detokenized.

    `observe(token_deltas, request_outputs)` after each `TokenDeltas` the
    registry processed. State: the open requests only (detailed ones)."""

    def __init__(self, tracer) -> None:
        self._tracer = tracer
        self._open: dict[str, list] = {}  # request id -> [start_ns, parent context, num_tokens]

    def observe(self, message, outputs) -> None:
        try:
            self._observe(message, outputs)
        except Exception:  # WHY: a tracing bug must never stop the detokenizer
            log.exception("detokenizer tracing failed")

    def _observe(self, message, outputs) -> None:
        now_ns = time.time_ns()
        for delta in message.deltas:
            spec = delta.spec
            if spec is not None and is_detailed(spec.trace_context):
                self._open[delta.request_id] = [now_ns, context_from_carrier(spec.trace_context), 0]
        if not self._open:
            return
        for out in outputs.deltas:
            entry = self._open.get(out.request_id)
            if entry is None:
                continue
            entry[2] += len(out.new_token_ids)
            if out.finished:
                del self._open[out.request_id]
                span = self._tracer.start_span("detokenize", context=entry[1], start_time=entry[0], attributes={
                    "gen_ai.request.id": out.request_id,
                    "gen_ai.usage.completion_tokens": entry[2],
                    "trillium.finish_reason": out.finish_reason or "",
                })
                span.end(end_time=now_ns)

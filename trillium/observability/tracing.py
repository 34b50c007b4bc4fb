"""OTLP tracing: per-process exporter set-up and the api side's request spans.

What is traced (DESIGN.md §6):

    llm_request            api process, one per engine request (as vLLM): SERVER
                           span from HTTP arrival to the request's last delta,
                           child of the client's `traceparent`, gen_ai.* attributes
      ├─ queue             scheduler process   (detailed only; actor_spans.py)
      ├─ prefill           scheduler process
      ├─ decode            scheduler process
      └─ detokenize        detokenizer process

The sampling decision is made here, in the api process, once per HTTP
request (all its choices together): `RequestTracing.sample()` returns None
when tracing is off or the request is not sampled, and nothing else is
built (no span object, no carrier). A sampled request gets a `RequestTracer`;
`start()` opens one `llm_request` span per engine request and returns a
`RequestSpan`, whose W3C carrier (`traceparent`, `tracestate`, plus
`DETAILED_KEY: "1"` when detailed spans are wanted) rides in
`AddRequest.trace_context` to the scheduler, which hands it on in the
`DetokenizeSpec`. The api's `EngineClient` feeds the span every output
delta; the last one ends it (finish reason, token counts, latencies).

Each process exports its own spans: `make_tracer_provider` builds a
TracerProvider + BatchSpanProcessor + OTLP/HTTP (protobuf) exporter, and
`close_provider` flushes it on shutdown within a bounded time. The actors
need no run-time command: they trace exactly the requests that arrive
with a carrier, so `POST /tracing` (enable, sample ratio, detailed) acts on
the api's `RequestTracing` alone.

The exporter's batching follows the SDK's own environment variables
(`OTEL_BSP_SCHEDULE_DELAY`, ...); `OTEL_SERVICE_NAME` overrides the
service name "trillium".
"""

from __future__ import annotations

import logging
import math
import os
import random
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

# NOTE: opentelemetry is imported inside the functions that need it: the SDK
# and the OTLP exporter take ~250 ms to import and most servers never trace.

TRACE_HEADERS = ("traceparent", "tracestate")
DETAILED_KEY = "trillium-detailed"  # in a carrier: the actors emit their stage spans
SERVICE_NAME = "trillium"
INSTRUMENTATION_NAME = "trillium"
_CLOSE_TIMEOUT_S = 3.0

log = logging.getLogger(__name__)


class SpanAttributes:
    """Attribute names, the same as vLLM's (`vllm/tracing.py`), plus ours."""

    GEN_AI_REQUEST_ID = "gen_ai.request.id"
    GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
    GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
    GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
    GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
    GEN_AI_USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    GEN_AI_USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
    GEN_AI_LATENCY_E2E = "gen_ai.latency.e2e"
    GEN_AI_LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
    # OpenTelemetry's gen-ai semantic conventions (a string array).
    GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
    # Trillium's own.
    PROCESS = "trillium.process"  # resource attribute: api, scheduler, detokenizer
    STOP_REASON = "trillium.stop_reason"


def make_tracer_provider(endpoint: str, process_name: str):
    """A TracerProvider exporting to `endpoint` (OTLP/HTTP protobuf, e.g.
    http://127.0.0.1:4318/v1/traces) in batches; the resource names the process."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create({SpanAttributes.PROCESS: process_name, "process.pid": os.getpid()})
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": SERVICE_NAME}))
    # WHY shutdown_on_exit=False: close_provider flushes with a bounded wait; an
    # atexit flush to an unreachable collector could hold the exit for seconds.
    provider = TracerProvider(resource=resource, shutdown_on_exit=False)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    return provider


def close_provider(provider, timeout_s: float = _CLOSE_TIMEOUT_S) -> None:
    """Flush and stop a provider, waiting at most `timeout_s` (the exporter may
    be retrying an unreachable collector; shutdown must not hang on it)."""
    if provider is None:
        return
    worker = threading.Thread(target=provider.shutdown, name="otel-shutdown", daemon=True)
    worker.start()
    worker.join(timeout_s)


def trace_headers(headers: Mapping[str, str] | None) -> dict[str, str]:
    """The W3C trace context headers present in `headers` (any case-insensitive mapping)."""
    if not headers:
        return {}
    found = {}
    for name in TRACE_HEADERS:
        value = headers.get(name)
        if value:
            found[name] = value
    return found


def context_from_carrier(carrier: Mapping[str, str] | None):
    """The OpenTelemetry Context a W3C carrier describes (empty carrier: a new trace)."""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract(dict(carrier or {}))


def is_detailed(carrier: Mapping[str, str] | None) -> bool:
    return bool(carrier) and carrier.get(DETAILED_KEY) == "1"


def to_ns(seconds: float) -> int:
    return int(seconds * 1e9)


class TracingNotConfigured(ValueError):
    """Tracing was switched on, but the server has no --otlp-traces-endpoint."""


class RequestTracing:
    """The api process's tracing switch: endpoint, on/off, sample ratio, detailed.

    Shared by the data plane (which asks `sample()` per request) and the
    admin app (`GET` / `POST /tracing`); mutated only from the api's trio
    thread (or, offline, between `LLM.generate` calls). `provider` is the
    process's TracerProvider (None: tracing cannot be enabled); tracing
    starts on when there is one. `rng` is injectable for tests.
    """

    def __init__(self, endpoint: str | None = None, *, detailed: bool = False, model_name: str = "",
                 sample_ratio: float = 1.0, provider: Any = None,
                 rng: Callable[[], float] = random.random) -> None:
        self.endpoint = endpoint
        self.model_name = model_name
        self.enabled = provider is not None
        self.detailed = detailed
        self.sample_ratio = _check_ratio(sample_ratio)
        self._provider = provider
        self._tracer = None
        self._random = rng

    @classmethod
    def from_config(cls, engine_config, process_name: str = "api") -> "RequestTracing":
        """From an EngineConfig; builds the exporter when an endpoint is set."""
        endpoint = engine_config.otlp_traces_endpoint or None
        provider = make_tracer_provider(endpoint, process_name) if endpoint else None
        return cls(endpoint, detailed=engine_config.collect_detailed_traces,
                   model_name=engine_config.served_model_name, provider=provider)

    def settings(self) -> dict:
        return {"enabled": self.enabled, "sample_ratio": self.sample_ratio, "detailed": self.detailed,
                "otlp_traces_endpoint": self.endpoint}

    def update(self, *, enabled: bool | None = None, sample_ratio: float | None = None,
               detailed: bool | None = None) -> dict:
        """Change what is given (ValueError for a bad ratio, TracingNotConfigured to
        enable without an endpoint); nothing changes when a check fails."""
        ratio = self.sample_ratio if sample_ratio is None else _check_ratio(sample_ratio)
        if enabled and self._provider is None:
            raise TracingNotConfigured("tracing needs an OTLP endpoint: start the server with --otlp-traces-endpoint")
        self.sample_ratio = ratio
        if enabled is not None:
            self.enabled = enabled
        if detailed is not None:
            self.detailed = detailed
        return self.settings()

    def sample(self, headers: Mapping[str, str] | None = None, model: str | None = None) -> "RequestTracer | None":
        """A tracer for one HTTP request if tracing is on and the request is sampled.

        The span start (arrival) is now; `headers` may carry the client's
        traceparent / tracestate."""
        if not self.enabled:
            return None
        ratio = self.sample_ratio
        if ratio < 1.0 and (ratio <= 0.0 or self._random() >= ratio):
            return None
        if self._tracer is None:
            self._tracer = self._provider.get_tracer(INSTRUMENTATION_NAME)
        return RequestTracer(self._tracer, context_from_carrier(trace_headers(headers)),
                             model or self.model_name, self.detailed, time.time_ns())

    def close(self) -> None:
        """Flush the api's spans (bounded); tracing stays off afterwards."""
        self.enabled = False
        close_provider(self._provider)
        self._provider = None


def sample_request(tracing: RequestTracing | None, headers: Mapping[str, str] | None,
                   model: str | None = None) -> "RequestTracer | None":
    """`tracing.sample(...)`, or None when the app has no tracing object."""
    return None if tracing is None else tracing.sample(headers, model)


class RequestTracer:
    """One sampled HTTP request: opens an `llm_request` span per engine request."""

    __slots__ = ("_tracer", "_parent", "model", "detailed", "arrival_ns")

    def __init__(self, tracer, parent, model: str, detailed: bool, arrival_ns: int) -> None:
        self._tracer = tracer
        self._parent = parent
        self.model = model
        self.detailed = detailed
        self.arrival_ns = arrival_ns

    def start(self, request_id: str, params, num_prompt_tokens: int) -> "RequestSpan | None":
        """The engine request's span, or None when the client's trace context says
        "not sampled" (the span would not record; nothing is carried)."""
        from opentelemetry import trace
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        attributes = {
            SpanAttributes.GEN_AI_REQUEST_ID: request_id,
            SpanAttributes.GEN_AI_RESPONSE_MODEL: self.model,
            SpanAttributes.GEN_AI_REQUEST_TEMPERATURE: float(params.temperature),
            SpanAttributes.GEN_AI_REQUEST_TOP_P: float(params.top_p),
            SpanAttributes.GEN_AI_USAGE_PROMPT_TOKENS: int(num_prompt_tokens),
        }
        if params.max_tokens is not None:
            attributes[SpanAttributes.GEN_AI_REQUEST_MAX_TOKENS] = int(params.max_tokens)
        span = self._tracer.start_span("llm_request", context=self._parent, kind=SpanKind.SERVER,
                                       attributes=attributes, start_time=self.arrival_ns)
        if not span.is_recording():
            return None
        carrier: dict[str, str] = {}
        TraceContextTextMapPropagator().inject(carrier, context=trace.set_span_in_context(span))
        if self.detailed:
            carrier[DETAILED_KEY] = "1"
        return RequestSpan(span, carrier, self.arrival_ns)


class RequestSpan:
    """An open `llm_request` span, fed each RequestOutputDelta of its request
    (by the EngineClient's router); the finished delta ends it."""

    __slots__ = ("_span", "carrier", "_start_ns", "_first_token_ns", "_num_completion_tokens", "_queue_time_s")

    def __init__(self, span, carrier: dict[str, str], start_ns: int) -> None:
        self._span = span
        self.carrier = carrier
        self._start_ns = start_ns
        self._first_token_ns: int | None = None
        self._num_completion_tokens = 0
        self._queue_time_s: float | None = None

    def observe(self, delta) -> None:
        try:
            self._observe(delta)
        except Exception:  # WHY: a tracing bug must never stop the client's output router
            log.exception("tracing: could not record a delta of %s", delta.request_id)

    def _observe(self, delta) -> None:
        if delta.new_token_ids:
            if self._first_token_ns is None:
                self._first_token_ns = time.time_ns()
            self._num_completion_tokens += len(delta.new_token_ids)
        if delta.queue_time_s is not None:
            self._queue_time_s = delta.queue_time_s
        if delta.finished:
            self._end(delta.finish_reason or "stop", delta.stop_reason)

    def _end(self, finish_reason: str, stop_reason) -> None:
        from opentelemetry.trace import Status, StatusCode

        end_ns = time.time_ns()
        span = self._span
        span.set_attribute(SpanAttributes.GEN_AI_USAGE_COMPLETION_TOKENS, self._num_completion_tokens)
        span.set_attribute(SpanAttributes.GEN_AI_LATENCY_E2E, (end_ns - self._start_ns) / 1e9)
        if self._first_token_ns is not None:
            span.set_attribute(SpanAttributes.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN,
                               (self._first_token_ns - self._start_ns) / 1e9)
        if self._queue_time_s is not None:
            span.set_attribute(SpanAttributes.GEN_AI_LATENCY_TIME_IN_QUEUE, self._queue_time_s)
        span.set_attribute(SpanAttributes.GEN_AI_RESPONSE_FINISH_REASONS, (finish_reason,))
        if stop_reason is not None:
            span.set_attribute(SpanAttributes.STOP_REASON, str(stop_reason))
        if finish_reason == "abort":
            # Client gone, operator abort, or refused by the engine (the reason says which).
            detail = stop_reason if isinstance(stop_reason, str) else "aborted"
            span.set_status(Status(StatusCode.ERROR, f"request aborted: {detail}"))
        span.end(end_time=end_ns)


def _check_ratio(value: float) -> float:
    ratio = float(value)
    if math.isnan(ratio) or not 0.0 <= ratio <= 1.0:
        raise ValueError(f"sample_ratio must be between 0 and 1, got {value!r}")
    return ratio

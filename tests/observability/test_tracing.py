"""OTLP tracing end to end: a real `trillium serve` exporting to a receiver in the test.

The receiver is a tiny OTLP/HTTP server on a loopback port that decodes
each POST /v1/traces with the real protobuf (`ExportTraceServiceRequest`).
Checked: the `llm_request` span is the child of the client's traceparent
and carries vLLM's gen_ai.* attributes (token counts equal the response's
usage); the detailed stage spans come from the scheduler and detokenizer
processes, in the same trace, children of the llm_request span; the admin
route /tracing switches tracing off, re-samples and turns detailed spans
off at run time, and nothing is sent for a request that is not traced.

"Nothing was sent" is checked without sleeping: each process exports its
spans in the order they end, so once the spans of a later traced request
have arrived, those of an earlier one would have arrived too.
"""

from __future__ import annotations

import http.server
import secrets
import threading
import time

import attrs
import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from support.serve_process import ServeProcess, child_pids
from trillium.observability.tracing import DETAILED_KEY, RequestTracing

TOKEN = "tracing-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
DETAILED = {"queue", "prefill", "decode", "detokenize"}
_WAIT_S = 30.0


@attrs.frozen
class ReceivedSpan:
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    trace_state: str
    kind: int
    status_code: int
    start_ns: int
    end_ns: int
    attributes: dict
    resource: dict


def _value(any_value):
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return tuple(_value(v) for v in any_value.array_value.values)
    return getattr(any_value, kind) if kind else None


def _attributes(key_values) -> dict:
    return {kv.key: _value(kv.value) for kv in key_values}


class OtlpReceiver:
    """POST /v1/traces on a free loopback port; keeps every span it decodes."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self._changed = threading.Condition()
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.path != "/v1/traces":
                    self.send_response(404)
                else:
                    request = ExportTraceServiceRequest()
                    request.ParseFromString(body)
                    receiver._add(request)
                    self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_port}/v1/traces"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def _add(self, request: ExportTraceServiceRequest) -> None:
        received = []
        for resource_spans in request.resource_spans:
            resource = _attributes(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    received.append(ReceivedSpan(
                        name=span.name, trace_id=span.trace_id.hex(), span_id=span.span_id.hex(),
                        parent_span_id=span.parent_span_id.hex(), trace_state=span.trace_state,
                        kind=span.kind, status_code=span.status.code, start_ns=span.start_time_unix_nano,
                        end_ns=span.end_time_unix_nano, attributes=_attributes(span.attributes), resource=resource,
                    ))
        with self._changed:
            self.spans.extend(received)
            self._changed.notify_all()

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self._changed:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait_for(self, trace_id: str, names: set[str], count: int = 1) -> list[ReceivedSpan]:
        """The trace's spans once `count` spans of each name in `names` arrived (bounded wait)."""
        deadline = time.monotonic() + _WAIT_S
        with self._changed:
            while True:
                spans = [s for s in self.spans if s.trace_id == trace_id]
                if all(sum(s.name == name for s in spans) >= count for name in names):
                    return spans
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"spans {sorted(names)} x{count} of trace {trace_id} not received; "
                                         f"got {sorted(s.name for s in spans)}")
                self._changed.wait(left)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture(scope="module")
def receiver():
    r = OtlpReceiver()
    yield r
    r.close()


@pytest.fixture(scope="module")
def server(checkpoint, receiver):
    proc = ServeProcess(
        str(checkpoint("llama")), "--kv-cache-memory", "4MiB",
        "--otlp-traces-endpoint", receiver.endpoint, "--collect-detailed-traces",
        # WHY 100 ms: the SDK's default batch delay is 5 s; the test waits for each export.
        env={"TRILLIUM_ADMIN_TOKEN": TOKEN, "OTEL_BSP_SCHEDULE_DELAY": "100"},
    ).wait_healthy()
    yield proc
    proc.stop()


@pytest.fixture
def tracing_reset(server):
    yield
    reply = httpx.post(server.admin_url + "/tracing", json={"enabled": True, "sample_ratio": 1.0, "detailed": True},
                       headers=AUTH, timeout=10)
    assert reply.status_code == 200, reply.text


def _traceparent() -> tuple[str, str, dict]:
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, parent_id, {"traceparent": f"00-{trace_id}-{parent_id}-01", "tracestate": "client=7"}


def _complete(server, headers: dict, **extra) -> dict:
    body = {"model": "test-model", "prompt": [5, 6, 7, 8, 9], "max_tokens": 6, "ignore_eos": True,
            "temperature": 0.7, "top_p": 0.9, **extra}
    reply = httpx.post(server.base_url + "/v1/completions", json=body, headers=headers, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()


def _set_tracing(server, **body) -> dict:
    reply = httpx.post(server.admin_url + "/tracing", json=body, headers=AUTH, timeout=10)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_request_span_joins_the_client_trace_and_the_actors_join_it(server, receiver):
    trace_id, parent_id, headers = _traceparent()
    reply = _complete(server, headers)
    spans = receiver.wait_for(trace_id, {"llm_request"} | DETAILED)

    (request_span,) = [s for s in spans if s.name == "llm_request"]
    assert request_span.parent_span_id == parent_id
    assert request_span.trace_state == "client=7"
    assert request_span.kind == 2  # SPAN_KIND_SERVER
    attributes = request_span.attributes
    assert attributes["gen_ai.request.id"] == reply["id"]
    assert attributes["gen_ai.response.model"] == "test-model"
    assert attributes["gen_ai.request.max_tokens"] == 6
    assert attributes["gen_ai.request.temperature"] == pytest.approx(0.7)
    assert attributes["gen_ai.request.top_p"] == pytest.approx(0.9)
    assert attributes["gen_ai.usage.prompt_tokens"] == reply["usage"]["prompt_tokens"] == 5
    assert attributes["gen_ai.usage.completion_tokens"] == reply["usage"]["completion_tokens"] == 6
    assert attributes["gen_ai.response.finish_reasons"] == ("length",)
    e2e_s = attributes["gen_ai.latency.e2e"]
    assert 0 < attributes["gen_ai.latency.time_to_first_token"] <= e2e_s
    assert 0 <= attributes["gen_ai.latency.time_in_queue"] <= e2e_s
    assert e2e_s == pytest.approx((request_span.end_ns - request_span.start_ns) / 1e9, abs=1e-3)

    api_pid = server.process.pid
    actor_pids = set(child_pids(api_pid))
    assert request_span.resource["process.pid"] == api_pid
    assert request_span.resource["trillium.process"] == "api"
    assert request_span.resource["service.name"] == "trillium"
    detailed = {s.name: s for s in spans if s.name in DETAILED}
    for span in detailed.values():
        assert span.parent_span_id == request_span.span_id, span.name
        assert span.resource["process.pid"] in actor_pids, span.name
        assert request_span.start_ns <= span.start_ns <= span.end_ns <= request_span.end_ns, span.name
    assert {detailed[n].resource["trillium.process"] for n in ("queue", "prefill", "decode")} == {"scheduler"}
    assert detailed["detokenize"].resource["trillium.process"] == "detokenizer"
    assert detailed["queue"].end_ns <= detailed["prefill"].start_ns + 1000  # stages follow each other
    assert detailed["prefill"].end_ns <= detailed["decode"].start_ns + 1000
    assert detailed["prefill"].attributes["gen_ai.usage.prompt_tokens"] == 5
    assert detailed["decode"].attributes["gen_ai.usage.completion_tokens"] == 6
    assert detailed["decode"].attributes["trillium.num_decode_steps"] == 5
    assert detailed["detokenize"].attributes["gen_ai.usage.completion_tokens"] == 6


def test_each_choice_gets_its_own_request_span(server, receiver):
    trace_id, parent_id, headers = _traceparent()
    reply = _complete(server, headers, n=2, seed=3)
    spans = receiver.wait_for(trace_id, {"llm_request", "detokenize"}, count=2)
    request_spans = [s for s in spans if s.name == "llm_request"]
    assert sorted(s.attributes["gen_ai.request.id"] for s in request_spans) == [f"{reply['id']}-0",
                                                                                f"{reply['id']}-1"]
    assert all(s.parent_span_id == parent_id for s in request_spans)
    assert sum(s.attributes["gen_ai.usage.completion_tokens"] for s in request_spans) == \
        reply["usage"]["completion_tokens"]
    span_ids = {s.span_id for s in request_spans}
    assert {s.parent_span_id for s in spans if s.name in DETAILED} == span_ids


def test_tracing_switches_at_run_time(server, receiver, tracing_reset):
    assert httpx.get(server.admin_url + "/tracing", headers=AUTH, timeout=10).json() == {
        "enabled": True, "sample_ratio": 1.0, "detailed": True, "otlp_traces_endpoint": receiver.endpoint}

    assert _set_tracing(server, enabled=False)["enabled"] is False
    off_trace, _, headers = _traceparent()
    _complete(server, headers)

    settings = _set_tracing(server, enabled=True, sample_ratio=0)
    assert (settings["enabled"], settings["sample_ratio"]) == (True, 0.0)
    unsampled_trace, _, headers = _traceparent()
    _complete(server, headers)

    _set_tracing(server, sample_ratio=1.0, detailed=False)
    plain_trace, _, headers = _traceparent()
    _complete(server, headers)
    receiver.wait_for(plain_trace, {"llm_request"})

    _set_tracing(server, detailed=True)
    barrier_trace, _, headers = _traceparent()
    _complete(server, headers)
    receiver.wait_for(barrier_trace, {"llm_request"} | DETAILED)
    # Every process has exported what ended before the barrier request.
    assert receiver.trace(off_trace) == []
    assert receiver.trace(unsampled_trace) == []
    assert [s.name for s in receiver.trace(plain_trace)] == ["llm_request"]


def test_tracing_route_needs_the_token_and_checks_values(server, tracing_reset):
    url = server.admin_url + "/tracing"
    assert httpx.get(url, timeout=10).status_code == 401
    assert httpx.post(url, json={"enabled": False}, timeout=10).status_code == 401
    for body in ({"sample_ratio": 1.5}, {"sample_ratio": -0.1}, {"sample_ratio": "0.5"}, {"enabled": "yes"},
                 {"detailed": 1}):
        reply = httpx.post(url, json=body, headers=AUTH, timeout=10)
        assert reply.status_code == 400, (body, reply.text)
        assert reply.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(url, headers=AUTH, timeout=10).json()["sample_ratio"] == 1.0  # unchanged


@pytest.mark.parametrize("tracing", [RequestTracing(), None], ids=["no-endpoint", "no-tracing-object"])
async def test_enabling_without_an_endpoint_is_409(tracing):
    from trillium.config import EngineConfig
    from trillium.control_plane import ControlPlaneEngine, create_admin_app

    engine = ControlPlaneEngine(client=None, engine_config=EngineConfig(model="m"), admin_token="t",
                                tracing=tracing)
    app = create_admin_app(engine)
    headers = {"Authorization": "Bearer t"}
    async with app.test_app() as test_app:
        client = test_app.test_client()
        reply = await client.post("/tracing", json={"enabled": True}, headers=headers)
        assert reply.status_code == 409
        assert "--otlp-traces-endpoint" in (await reply.get_json())["error"]["message"]
        reply = await client.post("/tracing", json={"enabled": False}, headers=headers)
        assert reply.status_code == 200
        reply = await client.get("/tracing", headers=headers)
        assert (await reply.get_json())["enabled"] is False


def test_sampling_decision_and_carrier():
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from trillium.sampling_params import SamplingParams

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    draws = iter([0.1, 0.3, 0.2])
    tracing = RequestTracing("http://unused", provider=provider, rng=lambda: next(draws))
    tracing.update(sample_ratio=0.25)
    assert tracing.sample() is not None  # 0.1 < 0.25
    assert tracing.sample() is None  # 0.3
    tracing.update(enabled=False)
    assert tracing.sample() is None  # off: no draw, nothing built
    tracing.update(enabled=True, sample_ratio=1.0, detailed=True)
    with pytest.raises(ValueError):
        tracing.update(enabled=False, sample_ratio=float("nan"))
    assert tracing.enabled  # a refused update changes nothing

    trace_id, parent_id = "ab" * 16, "cd" * 8
    span = tracing.sample({"traceparent": f"00-{trace_id}-{parent_id}-01"}, "m").start("r1", SamplingParams(), 3)
    assert span.carrier["traceparent"].startswith(f"00-{trace_id}-") and span.carrier[DETAILED_KEY] == "1"
    # The client said "not sampled": no span records, nothing is carried into the engine.
    assert tracing.sample({"traceparent": f"00-{trace_id}-{parent_id}-00"}).start("r2", SamplingParams(), 3) is None
    assert exporter.get_finished_spans() == ()  # r1 is still open
    provider.shutdown()

"""Prometheus metrics of one data-plane app, in its own CollectorRegistry.

WHY a per-app registry: several apps (tests, a data plane beside a control
plane) can live in one process without their metric names clashing in the
global registry.

Two kinds of series, vLLM's names under the `trillium:` prefix:

- engine state, read at scrape time from the client's latest
  `SchedulerStats` (num_requests_running / waiting, kv_cache_usage_perc,
  preemptions, prefix-cache queries and hits) and from the api's own
  in-flight count;
- request outcomes, recorded by `generation.py` as each engine request
  runs: finished requests by reason, prompt and generation tokens, e2e
  latency and time to first token.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0)


class _EngineStatsCollector:
    """Gauges and counters read from the engine's latest SchedulerStats at scrape time."""

    def __init__(self, model_name: str, stats: Callable[[], object], num_in_flight: Callable[[], int]) -> None:
        self._model_name = model_name
        self._stats = stats
        self._num_in_flight = num_in_flight

    def collect(self):
        labels = ["model_name"]
        values = [self._model_name]
        stats = self._stats()

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=labels)
            family.add_metric(values, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=labels)
            family.add_metric(values, value)
            return family

        yield gauge("trillium:num_requests_running", "Requests in the engine's running batch.",
                    stats.num_running if stats else 0)
        yield gauge("trillium:num_requests_waiting", "Requests waiting to be scheduled.",
                    stats.num_waiting if stats else 0)
        yield gauge("trillium:kv_cache_usage_perc", "Fraction of device KV cache blocks in use (0-1).",
                    stats.kv_usage if stats else 0.0)
        yield gauge("trillium:num_requests_in_flight", "HTTP requests admitted by the api and not finished.",
                    self._num_in_flight())
        yield counter("trillium:num_preemptions", "Requests preempted by the scheduler.",
                      stats.num_preempted_total if stats else 0)
        yield counter("trillium:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      stats.prefix_cache_queries_total if stats else 0)
        yield counter("trillium:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                      stats.prefix_cache_hits_total if stats else 0)


class DataPlaneMetrics:
    def __init__(self, model_name: str, stats: Callable[[], object], num_in_flight: Callable[[], int]) -> None:
        self.registry = CollectorRegistry()
        self._model_name = model_name
        self._finished = Counter(
            "trillium:request_success", "Finished engine requests by finish reason.",
            ["model_name", "finished_reason"], registry=self.registry,
        )
        self._prompt_tokens = Counter(
            "trillium:prompt_tokens", "Prompt tokens submitted.", ["model_name"], registry=self.registry
        )
        self._generation_tokens = Counter(
            "trillium:generation_tokens", "Tokens generated.", ["model_name"], registry=self.registry
        )
        self._e2e = Histogram(
            "trillium:e2e_request_latency_seconds", "Arrival to last token, per engine request.",
            ["model_name"], buckets=_LATENCY_BUCKETS_S, registry=self.registry,
        )
        self._ttft = Histogram(
            "trillium:time_to_first_token_seconds", "Arrival to first generated token.",
            ["model_name"], buckets=_TTFT_BUCKETS_S, registry=self.registry,
        )
        self.registry.register(_EngineStatsCollector(model_name, stats, num_in_flight))

    def on_submitted(self, num_prompt_tokens: int) -> None:
        self._prompt_tokens.labels(self._model_name).inc(num_prompt_tokens)

    def on_first_token(self, ttft_s: float) -> None:
        self._ttft.labels(self._model_name).observe(ttft_s)

    def on_finished(self, finish_reason: str, num_generated_tokens: int, e2e_s: float) -> None:
        self._finished.labels(self._model_name, finish_reason).inc()
        self._generation_tokens.labels(self._model_name).inc(num_generated_tokens)
        self._e2e.labels(self._model_name).observe(e2e_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)

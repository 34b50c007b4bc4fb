"""The data plane's Prometheus series, in the server's registry (or one of its own).

The engine series (trillium/observability/metrics.py: request counts,
latencies, token counts, queue and KV state) are measured in the engine
and folded in by `EngineMetrics`; this module adds what only the data
plane knows:

    trillium:num_requests_in_flight{model_name}   HTTP requests admitted and not finished

`trillium serve` passes its process-wide registry (`DataPlaneEngine.metrics_registry`),
so /metrics here and on the admin port show the same full set. An app built
without one (tests, embedding) gets a registry of its own with the engine
series fed from its client.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily

from trillium.observability.metrics import CONTENT_TYPE, registry_for, render

__all__ = ["CONTENT_TYPE", "DataPlaneMetrics"]


class _InFlightCollector:
    def __init__(self, model_name: str, num_in_flight: Callable[[], int]) -> None:
        self._model_name = model_name
        self._num_in_flight = num_in_flight

    def collect(self):
        family = GaugeMetricFamily("trillium:num_requests_in_flight",
                                   "HTTP requests admitted by the api and not finished.", labels=["model_name"])
        family.add_metric([self._model_name], self._num_in_flight())
        yield family


class DataPlaneMetrics:
    def __init__(self, model_name: str, client, num_in_flight: Callable[[], int],
                 registry: CollectorRegistry | None = None) -> None:
        self.registry = registry = registry_for(registry, model_name, client)
        registry.register(_InFlightCollector(model_name, num_in_flight))

    def render(self) -> bytes:
        return render(self.registry)

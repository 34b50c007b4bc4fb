"""The control plane's Prometheus series, in the server's registry (or one of its own).

`trillium serve` passes its process-wide registry
(`ControlPlaneEngine.metrics_registry`), which also holds the engine and
data-plane series, so /metrics on either port shows the full set. An
admin app built without one gets its own, with the engine series fed from
its client.

Read at scrape time from `EngineStatus` (so they agree with /server_info):

    trillium:weight_version_info{model_name, weight_version}   1
    trillium:is_sleeping{model_name}                           0 | 1
    trillium:is_paused{model_name}                             0 | 1
    trillium:engine_state{model_name, state}                   1 for the current state, 0 for the others
    trillium:profiling_active{model_name}                      0 | 1

Recorded by the weight-update path:

    trillium:weight_updates_total{model_name, source, outcome}     source: disk | tensor | distributed
    trillium:weight_update_duration_seconds{model_name, source}    admission closed -> engine reply
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

from trillium.actors.protocol.vocabulary import EngineState
from trillium.observability.metrics import CONTENT_TYPE, registry_for, render

__all__ = ["CONTENT_TYPE", "AdminMetrics", "KNOWN_STATES"]
# The label values, in a stable order (the enum's values: "serving", "draining", ...).
KNOWN_STATES = (EngineState.SERVING, EngineState.DRAINING, EngineState.PAUSED, EngineState.SLEEPING,
                EngineState.UPDATING_WEIGHTS)
UPDATE_SOURCES = ("disk", "tensor", "distributed")
UPDATE_OUTCOMES = ("success", "error")
_UPDATE_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class _StatusCollector:
    def __init__(self, model_name: str, status, profiling: Callable[[], bool]) -> None:
        self._model_name = model_name
        self._status = status
        self._profiling = profiling

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, doc, labels=["model_name"])
        family.add_metric([self._model_name], value)
        return family

    def collect(self):
        state = self._status.engine_state
        info = GaugeMetricFamily("trillium:weight_version_info", "Weight version being served (label).",
                                 labels=["model_name", "weight_version"])
        info.add_metric([self._model_name, self._status.weight_version], 1)
        yield info
        yield self._gauge("trillium:is_sleeping", "1 while the engine sleeps.", float(self._status.is_sleeping))
        yield self._gauge("trillium:is_paused", "1 while generation is paused.", float(self._status.is_paused))
        states = GaugeMetricFamily("trillium:engine_state", "Engine lifecycle state (1 = current).",
                                   labels=["model_name", "state"])
        for known in dict.fromkeys((*KNOWN_STATES, state)):
            states.add_metric([self._model_name, str(known)], float(known == state))
        yield states
        yield self._gauge("trillium:profiling_active", "1 while torch.profiler traces are recorded.",
                          float(self._profiling()))


class AdminMetrics:
    def __init__(self, model_name: str, status, profiling: Callable[[], bool], client=None,
                 registry: CollectorRegistry | None = None) -> None:
        self.registry = registry = registry_for(registry, model_name, client)
        self._model_name = model_name
        self._updates = Counter("trillium:weight_updates", "Weight updates by source and outcome.",
                                ["model_name", "source", "outcome"], registry=self.registry)
        self._update_s = Histogram("trillium:weight_update_duration_seconds",
                                   "Weight update time: admission closed to engine reply.",
                                   ["model_name", "source"], buckets=_UPDATE_BUCKETS_S, registry=self.registry)
        # WHY every source and outcome at 0: the dashboard's update panels have series (and a rate()
        # baseline) on a server that has not updated its weights yet.
        for source in UPDATE_SOURCES:
            self._update_s.labels(model_name, source)
            for outcome in UPDATE_OUTCOMES:
                self._updates.labels(model_name, source, outcome)
        self.registry.register(_StatusCollector(model_name, status, profiling))

    def on_weight_update(self, source: str, outcome: str, duration_s: float) -> None:
        self._updates.labels(self._model_name, source, outcome).inc()
        self._update_s.labels(self._model_name, source).observe(duration_s)

    def render(self) -> bytes:
        return render(self.registry)

"""The engine series of every data-parallel replica in one registry, labelled `engine`.

Each replica's engine series are built exactly as with one engine
(observability/metrics.py `EngineMetrics`, fed by that replica's own
EngineClient) in a registry of their own; `ReplicaSeries`, registered in
the server's registry, renders them all with `engine="<replica index>"`
added to every sample, one family per metric name (the exposition format
allows a name once).

WHY `engine`: vLLM's Prometheus logger labels every series of a
data-parallel deployment with ["model_name", "engine"], the engine index
as a string (vllm/v1/metrics/loggers.py `PrometheusStatLogger`); dashboards
written for it sum or split by that label. With one replica there is no
label (the series are exactly today's).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric

ENGINE_LABEL = "engine"


class ReplicaSeries:
    def __init__(self, registries: list[CollectorRegistry]) -> None:
        self._registries = registries

    def collect(self):
        families: dict[str, Metric] = {}
        for index, registry in enumerate(self._registries):
            for family in registry.collect():
                merged = families.get(family.name)
                if merged is None:
                    merged = families[family.name] = Metric(family.name, family.documentation, family.type,
                                                            family.unit)
                for sample in family.samples:
                    labels = {**sample.labels, ENGINE_LABEL: str(index)}
                    merged.samples.append(sample._replace(labels=labels))
        yield from families.values()

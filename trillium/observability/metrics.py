"""The engine's Prometheus series, fed by each `SchedulerStats` the api receives.

Metrics are measured in the engine (scheduler/metrics.py: per request and
per step) and shipped with every SchedulerStats; `EngineMetrics.observe`
folds those events into counters and histograms here, in the api process,
where /metrics serves them. Gauges and lifetime totals (running, waiting,
KV usage, preemptions, prefix cache) are read from the latest stats at
scrape time. Names and semantics follow vLLM's, under `trillium:`:

    gauges      num_requests_running, num_requests_waiting, kv_cache_usage_perc,
                actor_up{actor}, actor_mailbox_depth{actor}
    counters    num_preemptions, prefix_cache_queries, prefix_cache_hits, prompt_tokens,
                generation_tokens, request_success{finished_reason}          (exported with _total)
    histograms  time_to_first_token_seconds, inter_token_latency_seconds,
                e2e_request_latency_seconds, request_queue_time_seconds,
                request_prefill_time_seconds, request_decode_time_seconds,
                request_inference_time_seconds, request_prompt_tokens,
                request_generation_tokens, iteration_tokens_total,
                engine_step_duration_seconds
    LoRA        lora_requests_info{running_lora_adapters, waiting_lora_adapters, max_lora}
                (vLLM's info gauge: the value is the time of the reading), lora_loads_total,
                lora_unloads_total, lora_swap_ins_total (adapters moved into a device slot)
                -- at 0 (no adapters, max_lora "0") without --enable-lora
    KV tiers    kv_tier_usage_perc{tier}, kv_tier_hits_total{tier} (prefix-cache hits, blocks),
                kv_tier_evictions_total{tier} (blocks), kv_tier_bytes_moved_total{direction}
                (to_host, to_device, to_disk, from_disk), kv_tier_failed_reads_total (corrupt
                disk blocks, recomputed), kv_tier_load_seconds{tier} (histogram: host, a step's
                copies into the device; disk, a request's wait in the loading state); tier is
                "device", "host" or "disk"; kv_swaps_total{direction} (out, in: swap preemption)
                -- the tiers that are off (host, disk) are exported at 0
    spec decode spec_decode_num_drafts_total, spec_decode_num_draft_tokens_total,
                spec_decode_num_accepted_tokens_total, spec_decode_num_accepted_tokens_per_pos_total{position}
                (vLLM's names; observability/spec_decode_metrics.py), and Trillium's
                spec_decode_num_steps_disabled_by_batch_size_total (disable_by_batch_size)
    links       engine_rejected_frames_total{actor,reason}: frames an engine inbox dropped
                (observability/link_metrics.py; from start-up, at 0)
    liveness    engine_stalled{actor} (1 while the watchdog finds the actor stalled),
                engine_stalls_total{actor} (stall onsets; actors/liveness.py) -- `trillium serve`

`request_success_total{finished_reason}` counts each request's final
output as the client gets it (`finished_output`, from the detokenizer's
last delta): a stop string matched by the last token allowed by
max_tokens is a "stop" there, as in the response, where the scheduler alone
would say "length".

Counters only ever grow: the events arrive once each, and the lifetime
totals come from the scheduler, which lives as long as the server (sleep,
wake and weight updates keep it).

`trillium serve` builds one registry for the process; both HTTP planes
render it, so either port's /metrics has the full set.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from trillium.actors.protocol.outputs import KvTierStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
FINISH_REASONS = ("stop", "length", "abort")

_LATENCY_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                      120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                   10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                  20.0, 40.0, 80.0)
_STEP_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def _token_buckets(max_value: int = 1 << 17) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's build_1_2_5_buckets)."""
    buckets, exponent = [], 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return tuple(buckets)
            buckets.append(value)
        exponent += 1


class _StateCollector:
    """Gauges and lifetime totals read from the latest SchedulerStats at scrape time."""

    def __init__(self, model_name: str, stats: Callable[[], object], api_mailbox_depth: Callable[[], int],
                 actors_alive: Callable[[], dict[str, bool]] | None) -> None:
        self._model_name = model_name
        self._stats = stats
        self._api_mailbox_depth = api_mailbox_depth
        self._actors_alive = actors_alive

    def collect(self):
        model = self._model_name
        stats = self._stats()

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([model], value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([model], value)
            return family

        yield gauge("trillium:num_requests_running", "Requests in the engine's running batch.",
                    stats.num_running if stats else 0)
        yield gauge("trillium:num_requests_waiting", "Requests waiting to be scheduled.",
                    stats.num_waiting if stats else 0)
        yield gauge("trillium:kv_cache_usage_perc", "Fraction of device KV cache blocks in use (0-1).",
                    stats.kv_usage if stats else 0.0)
        yield counter("trillium:num_preemptions", "Requests preempted by the scheduler.",
                      stats.num_preempted_total if stats else 0)
        yield counter("trillium:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      stats.prefix_cache_queries_total if stats else 0)
        yield counter("trillium:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                      stats.prefix_cache_hits_total if stats else 0)
        yield from _tier_families(model, stats)
        depth = GaugeMetricFamily("trillium:actor_mailbox_depth",
                                  "Messages waiting in an actor's inbox (scheduler: at its last drain).",
                                  labels=["model_name", "actor"])
        depth.add_metric([model, "scheduler"], stats.mailbox_depth if stats else 0)
        depth.add_metric([model, "api"], self._api_mailbox_depth())
        yield depth
        if self._actors_alive is not None:
            up = GaugeMetricFamily("trillium:actor_up", "1 while the actor process runs.",
                                   labels=["model_name", "actor"])
            for actor, alive in sorted(self._actors_alive().items()):
                up.add_metric([model, actor], float(alive))
            yield up


# WHY rows for tiers that are off: every series the dashboard queries exists from start-up (at 0), so no
# panel says "no data" and rate() has a baseline when a tier is switched on later.
_OFF_TIERS = (KvTierStats("host", 0.0, 0, 0, 0), KvTierStats("disk", 0.0, 0, 0, 0))


def _tier_families(model: str, stats):
    """The KV tier series: the configured tiers' rows, host and disk at 0 where they are off."""
    tiers = tuple(stats.kv_tiers) if stats is not None else ()
    named = {tier.tier for tier in tiers}
    tiers += tuple(tier for tier in _OFF_TIERS if tier.tier not in named)
    total = (lambda field: getattr(stats, field)) if stats is not None else (lambda field: 0)
    usage = GaugeMetricFamily("trillium:kv_tier_usage_perc", "Fraction of a KV tier's blocks in use (0-1).",
                              labels=["model_name", "tier"])
    hits = CounterMetricFamily("trillium:kv_tier_hits", "Prefix-cache hits served by a KV tier, in blocks.",
                               labels=["model_name", "tier"])
    evictions = CounterMetricFamily("trillium:kv_tier_evictions", "Cached KV blocks a tier dropped for room.",
                                    labels=["model_name", "tier"])
    for tier in tiers:
        usage.add_metric([model, tier.tier], tier.usage)
        hits.add_metric([model, tier.tier], tier.hit_blocks_total)
        evictions.add_metric([model, tier.tier], tier.evicted_blocks_total)
    moved = CounterMetricFamily("trillium:kv_tier_bytes_moved", "KV bytes copied between the KV tiers.",
                                labels=["model_name", "direction"])
    for direction, field in (("to_host", "kv_bytes_to_host_total"), ("to_device", "kv_bytes_to_device_total"),
                             ("to_disk", "kv_bytes_to_disk_total"), ("from_disk", "kv_bytes_from_disk_total")):
        moved.add_metric([model, direction], total(field))
    swaps = CounterMetricFamily("trillium:kv_swaps", "Preempted requests whose KV went to the host tier "
                                "(out) and came back (in): --preemption-mode swap.", labels=["model_name", "direction"])
    swaps.add_metric([model, "out"], total("num_swapped_out_total"))
    swaps.add_metric([model, "in"], total("num_swapped_in_total"))
    failed = CounterMetricFamily("trillium:kv_tier_failed_reads",
                                 "Disk KV blocks that failed their check (corrupt, truncated): recomputed.",
                                 labels=["model_name"])
    failed.add_metric([model], total("kv_disk_failed_reads_total"))
    yield from (usage, hits, evictions, moved, swaps, failed)


class _LoRACollector:
    def __init__(self, model_name: str, stats: Callable[[], object], loras) -> None:
        self._model_name = model_name
        self._stats = stats
        self._loras = loras

    def collect(self):
        stats, loras, model = self._stats(), self._loras, self._model_name
        names = lambda ids: ",".join(loras.name_of(i) for i in ids) if loras is not None else ""  # noqa: E731
        info = GaugeMetricFamily(
            "trillium:lora_requests_info", "Adapters of running and waiting requests (value: time of reading).",
            labels=["model_name", "running_lora_adapters", "waiting_lora_adapters", "max_lora"])
        info.add_metric([model, names(stats.running_lora_ids) if stats else "",
                         names(stats.waiting_lora_ids) if stats else "",
                         str(stats.max_loras if stats else 0)], time.time())
        yield info
        loads, unloads = (loras.num_loads, loras.num_unloads) if loras is not None else (0, 0)
        for name, doc, value in (("trillium:lora_loads", "LoRA adapters loaded.", loads),
                                 ("trillium:lora_unloads", "LoRA adapters unloaded.", unloads)):
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([model], value)
            yield family


class _LivenessCollector:
    """The stall watchdog's view (actors/liveness.py StallDetector), every actor at 0 from the start."""

    def __init__(self, model_name: str, detector) -> None:
        self._model_name = model_name
        self._detector = detector

    def collect(self):
        model, detector = self._model_name, self._detector
        stalled = GaugeMetricFamily("trillium:engine_stalled", "1 while the watchdog finds the actor stalled.",
                                    labels=["model_name", "actor"])
        stalls = CounterMetricFamily("trillium:engine_stalls", "Times the watchdog found the actor stalled "
                                     "(no pong, or no step with work queued, for --engine-stall-timeout-s).",
                                     labels=["model_name", "actor"])
        current = detector.stall.actor if detector.stall is not None else None
        for actor in sorted(detector.num_stalls):
            stalled.add_metric([model, actor], float(actor == current))
            stalls.add_metric([model, actor], detector.num_stalls[actor])
        yield stalled
        yield stalls


class EngineMetrics:
    """Engine series in `registry`; call `observe(stats)` for each SchedulerStats."""

    def __init__(
        self,
        registry: CollectorRegistry,
        model_name: str,
        stats: Callable[[], object],
        *,
        api_mailbox_depth: Callable[[], int] = lambda: 0,
        actors_alive: Callable[[], dict[str, bool]] | None = None,
        loras=None,
    ) -> None:
        self.registry = registry
        self._model = model_name
        labels = ["model_name"]

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, [*labels, *extra], registry=registry)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            family = Histogram(name, doc, labels, buckets=buckets, registry=registry)
            family.labels(model_name)  # WHY: its buckets exist (at 0) before the first observation
            return family

        self._prompt_tokens = counter("trillium:prompt_tokens", "Prefilled prompt tokens (at first token).")
        self._generation_tokens = counter("trillium:generation_tokens", "Generated tokens.")
        self._prompt_tokens.labels(model_name)
        self._generation_tokens.labels(model_name)
        self._success = counter("trillium:request_success", "Finished requests by finish reason.",
                                ("finished_reason",))
        for reason in FINISH_REASONS:  # WHY: series exist (at 0) before the first finish
            self._success.labels(model_name, reason)
        self._ttft = histogram("trillium:time_to_first_token_seconds", "Arrival to first token.", _TTFT_BUCKETS_S)
        self._itl = histogram("trillium:inter_token_latency_seconds", "Time between consecutive tokens.",
                              _ITL_BUCKETS_S)
        self._e2e = histogram("trillium:e2e_request_latency_seconds", "Arrival to finish.", _LATENCY_BUCKETS_S)
        self._queue = histogram("trillium:request_queue_time_seconds", "Time waiting before first scheduled.",
                                _LATENCY_BUCKETS_S)
        self._prefill = histogram("trillium:request_prefill_time_seconds", "First scheduled to first token.",
                                  _LATENCY_BUCKETS_S)
        self._decode = histogram("trillium:request_decode_time_seconds", "First token to last token.",
                                 _LATENCY_BUCKETS_S)
        self._inference = histogram("trillium:request_inference_time_seconds",
                                    "First scheduled to last token.", _LATENCY_BUCKETS_S)
        token_buckets = _token_buckets()
        self._request_prompt = histogram("trillium:request_prompt_tokens", "Prompt tokens per finished request.",
                                         token_buckets)
        self._request_generation = histogram("trillium:request_generation_tokens",
                                             "Generated tokens per finished request.", token_buckets)
        self._iteration = histogram("trillium:iteration_tokens_total", "Tokens scheduled per engine step.",
                                    token_buckets)
        self._step = histogram("trillium:engine_step_duration_seconds", "Executor time per engine step.",
                               _STEP_BUCKETS_S)
        self._kv_load = Histogram("trillium:kv_tier_load_seconds",
                                  "KV tier loads: host, a step's copies to the device; disk, a request's "
                                  "wait for its blocks.", [*labels, "tier"], buckets=_STEP_BUCKETS_S,
                                  registry=registry)
        for tier in ("host", "disk"):
            self._kv_load.labels(model_name, tier)
        registry.register(_StateCollector(model_name, stats, api_mailbox_depth, actors_alive))
        from trillium.observability.spec_decode_metrics import SpecDecodeCollector

        registry.register(SpecDecodeCollector(model_name, stats))  # speculative decoding
        # WHY without --enable-lora too: the LoRA panels read 0 instead of "no data".
        self._swap_ins = counter("trillium:lora_swap_ins", "LoRA adapters loaded into a device slot.")
        self._swap_ins.labels(model_name)
        registry.register(_LoRACollector(model_name, stats, loras))

    def watch_liveness(self, detector) -> None:
        """Export the stall watchdog's series (`trillium serve`)."""
        self.registry.register(_LivenessCollector(self._model, detector))

    def attach(self, client) -> None:
        """Feed from an EngineClient: its SchedulerStats and its requests' final outputs."""
        client.stats_listeners.append(self.observe)
        client.finish_listeners.append(self.finished_output)
        from trillium.observability.link_metrics import RejectedFramesCollector

        self.registry.register(RejectedFramesCollector(self._model, client.rejected_frames))

    def finished_output(self, delta) -> None:
        self._success.labels(self._model, delta.finish_reason or "stop").inc()

    def observe(self, stats) -> None:
        """Fold the events of one SchedulerStats into the counters and histograms."""
        model = self._model
        if stats.num_prompt_tokens:
            self._prompt_tokens.labels(model).inc(stats.num_prompt_tokens)
        if stats.num_generation_tokens:
            self._generation_tokens.labels(model).inc(stats.num_generation_tokens)
        if stats.num_lora_swap_ins:
            self._swap_ins.labels(model).inc(stats.num_lora_swap_ins)
        for values, histogram in ((stats.ttfts_s, self._ttft), (stats.itls_s, self._itl),
                                  (stats.step_tokens, self._iteration), (stats.step_durations_s, self._step)):
            if values:
                child = histogram.labels(model)
                for value in values:
                    child.observe(value)
        for tier, seconds in stats.kv_load_s:
            self._kv_load.labels(model, tier).observe(seconds)
        for finished in stats.finished:
            self._e2e.labels(model).observe(finished.e2e_s)
            self._queue.labels(model).observe(finished.queue_s)
            self._request_prompt.labels(model).observe(finished.num_prompt_tokens)
            self._request_generation.labels(model).observe(finished.num_generation_tokens)
            for value, histogram in ((finished.prefill_s, self._prefill), (finished.decode_s, self._decode),
                                     (finished.inference_s, self._inference)):
                if value is not None:
                    histogram.labels(model).observe(value)


def registry_for(registry: CollectorRegistry | None, model_name: str, client) -> CollectorRegistry:
    """`registry` when given (the server's, engine series already in it); else a new
    one with the engine series fed from `client` (an app built on its own)."""
    if registry is not None:
        return registry
    registry = CollectorRegistry()
    if client is not None:
        EngineMetrics(registry, model_name, lambda: client.last_stats,
                      api_mailbox_depth=lambda: client.mailbox_depth).attach(client)
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)

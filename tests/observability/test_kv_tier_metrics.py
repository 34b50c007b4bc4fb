"""The KV tier series: exported from the SchedulerStats' tier numbers; without
a host tier (the stats carry none) the host and disk rows are exported at 0,
so the dashboard's tier panels have data from start-up (issue 16, item 7)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from trillium.actors.protocol.outputs import KvTierStats, SchedulerStats
from trillium.observability.metrics import EngineMetrics, render


def _scrape(stats) -> dict[str, float]:
    registry = CollectorRegistry()
    EngineMetrics(registry, "m", lambda: stats)
    return {
        sample.name + str(sorted((k, v) for k, v in sample.labels.items() if k != "model_name")): sample.value
        for family in text_string_to_metric_families(render(registry).decode())
        for sample in family.samples
    }


def _stats(**tiers) -> SchedulerStats:
    return SchedulerStats(1, 0, 0, 0, 0.25, 10, 0, 0, 0, **tiers)


def test_tier_series_follow_the_stats():
    samples = _scrape(_stats(
        kv_tiers=(KvTierStats("device", 0.25, 16, 7, 5), KvTierStats("host", 0.5, 64, 3, 1)),
        kv_bytes_to_host_total=4096, kv_bytes_to_device_total=2048,
    ))
    assert samples["trillium:kv_tier_usage_perc[('tier', 'device')]"] == 0.25
    assert samples["trillium:kv_tier_usage_perc[('tier', 'host')]"] == 0.5
    assert samples["trillium:kv_tier_hits_total[('tier', 'device')]"] == 7
    assert samples["trillium:kv_tier_hits_total[('tier', 'host')]"] == 3
    assert samples["trillium:kv_tier_evictions_total[('tier', 'host')]"] == 1
    assert samples["trillium:kv_tier_bytes_moved_total[('direction', 'to_host')]"] == 4096
    assert samples["trillium:kv_tier_bytes_moved_total[('direction', 'to_device')]"] == 2048


def test_tier_series_at_zero_without_a_host_tier():
    for stats in (None, _stats()):
        tier_samples = {name: value for name, value in _scrape(stats).items() if "kv_tier" in name or "kv_swaps" in name}
        for tier in ("host", "disk"):
            assert tier_samples[f"trillium:kv_tier_usage_perc[('tier', '{tier}')]"] == 0
            assert tier_samples[f"trillium:kv_tier_hits_total[('tier', '{tier}')]"] == 0
            assert tier_samples[f"trillium:kv_tier_evictions_total[('tier', '{tier}')]"] == 0
            assert tier_samples[f"trillium:kv_tier_load_seconds_count[('tier', '{tier}')]"] == 0
        for direction in ("to_host", "to_device", "to_disk", "from_disk"):
            assert tier_samples[f"trillium:kv_tier_bytes_moved_total[('direction', '{direction}')]"] == 0
        assert tier_samples["trillium:kv_tier_failed_reads_total[]"] == 0
        assert tier_samples["trillium:kv_swaps_total[('direction', 'out')]"] == 0
        assert not [name for name in tier_samples if "'device'" in name], "no device row without tiers"

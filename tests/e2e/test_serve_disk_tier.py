"""The disk KV tier across a restart of `trillium serve` (SIGTERM, then a new
server on the same --kv-disk-path): a long prompt pushed through the host
tier to disk by the first server hits the disk tier in the second one,
with the same greedy completion."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from support.serve_process import ServeProcess


# 24 KV blocks of 16 tokens on the device (8 KiB each for the test model), 6 in host memory.
TIER_ARGS = ("--kv-cache-memory", "192KiB", "--kv-host-bytes", "48KiB", "--kv-disk-bytes", "4MiB",
             "--executor-threads", "1")


def complete(server: ServeProcess, prompt: list[int]) -> str:
    reply = httpx.post(server.base_url + "/v1/completions", timeout=60,
                       json={"model": "test-model", "prompt": prompt, "max_tokens": 6, "temperature": 0})
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["text"]


def disk_hits(server: ServeProcess) -> float:
    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "trillium:kv_tier_hits_total" and sample.labels.get("tier") == "disk":
                return sample.value
    raise AssertionError("no disk tier series in /metrics")


def test_blocks_on_disk_hit_after_a_server_restart(checkpoint, tmp_path):
    model = str(checkpoint("llama"))
    disk = str(tmp_path / "kv")
    prompts = [[5 + (7 * i + k) % 400 for k in range(120)] for i in range(6)]  # 7 full blocks each

    first = ServeProcess(model, *TIER_ARGS, "--kv-disk-path", disk).wait_healthy()
    try:
        expected = complete(first, prompts[0])
        for prompt in prompts[1:]:  # 35 more blocks push prompt 0's through the host to disk
            complete(first, prompt)
    finally:
        assert first.stop() == 0, first.log()

    second = ServeProcess(model, *TIER_ARGS, "--kv-disk-path", disk).wait_healthy()
    try:
        assert disk_hits(second) == 0
        assert complete(second, prompts[0]) == expected
        assert disk_hits(second) >= 6  # the host tier holds 6 blocks: that many come back at once
    finally:
        assert second.stop() == 0, second.log()

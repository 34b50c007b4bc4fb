"""--async-scheduling over HTTP, on the in-process data-plane harness (real engine, no process start).

A client that leaves mid-stream is aborted while the scheduler plans a step
ahead of the one running: the engine goes idle long before the request's
2000 tokens, the abort is counted once, and what was streamed before it is
the start of the same request's greedy output, asked again. Mirrors vLLM's
async scheduling (vllm/v1/core/sched/async_scheduler.py): the token computed
for a request in the step after it ended is dropped, never sent.
"""

from __future__ import annotations

import json

import httpx
import pytest

from support.data_plane_server import ServerHarness, abort_count, stream_then_leave


@pytest.fixture(scope="module")
def async_server(checkpoint):
    path = checkpoint("llama", max_position_embeddings=2048)  # dp_server's checkpoint: built once
    harness = ServerHarness(path, {"default": {}}, max_num_seqs=8, async_scheduling=True).start()
    yield harness
    harness.stop()


async def test_async_scheduling_aborts_a_client_gone_mid_stream_and_keeps_its_tokens_exact(async_server):
    body = {"prompt": [5, 6, 7], "max_tokens": 2000, "ignore_eos": True, "stream": True, "temperature": 0}
    async with httpx.AsyncClient(base_url=async_server.url(), timeout=60) as http:
        aborts_before = abort_count((await http.get("/metrics")).text)
        async with httpx.AsyncClient(base_url=async_server.url(), timeout=60) as doomed:
            lines = await stream_then_leave(doomed, "/v1/completions", body, events=4)
            streamed = [json.loads(line[6:])["choices"][0]["text"] for line in lines]
            start_step = async_server.last_stats.step_id
        stats = await async_server.probe_until_idle(http)
        assert stats.step_id - start_step < 1000, "aborted, not run to its end"
        assert abort_count((await http.get("/metrics")).text) == aborts_before + 1
        again = await http.post("/v1/completions", json={**body, "stream": False, "max_tokens": 24})
        choice = again.json()["choices"][0]
    assert choice["finish_reason"] == "length" and again.json()["usage"]["completion_tokens"] == 24
    assert choice["text"].startswith("".join(streamed)) and "".join(streamed)

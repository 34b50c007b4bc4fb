"""--num-scheduler-steps over HTTP, on the in-process data-plane harness (real engine, no process start).

What a streaming client sees of multi-step decode (scheduler/multi_step.py): the
same text and token count as the request unstreamed, in fewer chunks than tokens
(a step's tokens arrive together); and a client that leaves mid-stream is
aborted after the step running, not at its request's end. Mirrors vLLM's v0
multi-step scheduling (vllm/engine/arg_utils.py EngineArgs.num_scheduler_steps).
"""

from __future__ import annotations

import json

import httpx
import pytest

from support.data_plane_server import ServerHarness, stream_then_leave


@pytest.fixture(scope="module")
def multi_step_server(checkpoint):
    path = checkpoint("llama", max_position_embeddings=2048)  # dp_server's checkpoint: built once
    harness = ServerHarness(path, {"default": {}}, max_num_seqs=8, num_scheduler_steps=4).start()
    yield harness
    harness.stop()


async def test_streamed_chunks_carry_a_steps_tokens_and_the_same_text(multi_step_server):
    body = {"prompt": [5, 6, 7], "max_tokens": 33, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    async with httpx.AsyncClient(base_url=multi_step_server.url(), timeout=60) as http:
        texts, usage = [], None
        async with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if chunk["choices"] and chunk["choices"][0]["text"]:
                        texts.append(chunk["choices"][0]["text"])
                    usage = chunk.get("usage") or usage
        whole = await http.post("/v1/completions", json={**body, "stream": False, "stream_options": None})
    assert whole.status_code == 200, whole.text
    assert "".join(texts) == whole.json()["choices"][0]["text"]
    assert usage["completion_tokens"] == whole.json()["usage"]["completion_tokens"] == 33
    # The prefill step's token, then 8 steps of 4: a chunk per step, not per token.
    assert len(texts) <= 9 + 2


async def test_a_client_gone_mid_stream_is_aborted(multi_step_server):
    body = {"prompt": [5, 6, 7], "max_tokens": 2000, "ignore_eos": True, "stream": True, "temperature": 0}
    async with httpx.AsyncClient(base_url=multi_step_server.url(), timeout=60) as http:
        await stream_then_leave(http, "/v1/completions", body, events=3)
        start_step = multi_step_server.last_stats.step_id
        stats = await multi_step_server.probe_until_idle(http)
    assert stats.step_id - start_step < 400, "aborted, not run to its end (500 steps of 4)"

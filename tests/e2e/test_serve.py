"""`trillium serve` end to end: a real server subprocess, the official openai SDK.

Greedy completions and chats equal `trillium.LLM` token for token; seeded
n=3 is reproducible; stop strings cut exactly; logprobs agree between
streamed and non-streamed calls; 32 concurrent streams complete with the
right usage; errors have OpenAI's shape; a client that disconnects frees its
request; SIGTERM drains and leaves no child process behind.
"""

from __future__ import annotations

import httpx
import openai
import pytest
import trio

from support.serve_process import ServeProcess, child_pids, is_alive
from support.waiting import wait_until
from trillium import LLM, SamplingParams

PROMPTS = ["Once upon a time", "The little dog", "She said hello to"]


@pytest.fixture(scope="module")
def model_path(checkpoint):
    return str(checkpoint("llama"))


@pytest.fixture(scope="module")
def server(model_path):
    proc = ServeProcess(model_path, "--max-num-seqs", "32", "--kv-cache-memory", "16MiB").wait_healthy()
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture(scope="module")
def reference(model_path):
    """Greedy outputs of the in-process engine for PROMPTS."""
    with LLM(model_path, kv_cache_memory="16MiB") as llm:
        completions = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16))
        chat = llm.chat([{"role": "user", "content": "Tell me a story"}], SamplingParams(temperature=0, max_tokens=16))
    return {"completions": [o.outputs[0] for o in completions], "chat": chat[0].outputs[0]}


def sdk(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def test_completions_match_offline_engine(server, reference):
    client = sdk(server)
    result = client.completions.create(model="test-model", prompt=PROMPTS, max_tokens=16, temperature=0)
    assert [c.text for c in sorted(result.choices, key=lambda c: c.index)] == [
        o.text for o in reference["completions"]
    ]
    assert result.usage.completion_tokens == sum(len(o.token_ids) for o in reference["completions"])


def test_chat_and_stream_match_offline_engine(server, reference):
    client = sdk(server)
    messages = [{"role": "user", "content": "Tell me a story"}]
    full = client.chat.completions.create(model="test-model", messages=messages, max_tokens=16, temperature=0)
    assert full.choices[0].message.content == reference["chat"].text
    stream = client.chat.completions.create(
        model="test-model", messages=messages, max_tokens=16, temperature=0,
        stream=True, stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reference["chat"].text
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_seeded_n3_reproducible(server):
    client = sdk(server)
    kwargs = dict(model="test-model", prompt="Once", max_tokens=12, temperature=1.0, n=3, seed=42)
    first = client.completions.create(**kwargs)
    second = client.completions.create(**kwargs)
    assert len(first.choices) == 3
    assert [c.text for c in first.choices] == [c.text for c in second.choices]


def test_stop_string_cuts_exactly(server, reference):
    text = reference["completions"][0].text
    stop = text[4:7]
    if not stop.strip():
        pytest.skip("reference text too short")
    result = sdk(server).completions.create(
        model="test-model", prompt=PROMPTS[0], max_tokens=16, temperature=0, stop=[stop]
    )
    assert result.choices[0].text == text[: text.index(stop)]
    assert result.choices[0].finish_reason == "stop"


def test_logprobs_stream_and_non_stream_agree(server):
    client = sdk(server)
    kwargs = dict(model="test-model", messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
                  temperature=0, logprobs=True, top_logprobs=3)
    full = client.chat.completions.create(**kwargs).choices[0].logprobs.content
    streamed = [
        entry for chunk in client.chat.completions.create(**kwargs, stream=True)
        if chunk.choices and chunk.choices[0].logprobs for entry in chunk.choices[0].logprobs.content
    ]
    assert [e.token for e in full] == [e.token for e in streamed]
    for a, b in zip(full, streamed):
        assert abs(a.logprob - b.logprob) < 1e-6 and len(a.top_logprobs) == 3


async def test_32_concurrent_streams(server):
    client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    usages: list[int] = []
    texts: list[str] = []

    async def one(i: int) -> None:
        stream = await client.completions.create(
            model="test-model", prompt=f"Story number {i}:", max_tokens=10 + i % 7, temperature=0.8,
            seed=i, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
        text = ""
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
            if chunk.usage:
                usages.append(chunk.usage.completion_tokens)
        texts.append(text)

    async with trio.open_nursery() as nursery:
        for i in range(32):
            nursery.start_soon(one, i)
    assert sorted(usages) == sorted(10 + i % 7 for i in range(32))
    assert len(texts) == 32


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"model": "test-model", "prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
        ({"model": "test-model", "prompt": "x", "temperature": "hot"}, 400, "temperature"),
        ({"model": "test-model", "prompt": "x", "top_p": 7}, 400, "top_p"),
        ({"model": "test-model", "prompt": "x " * 400, "max_tokens": 10}, 400, None),
        ({"model": "nope", "prompt": "x"}, 404, "model"),
    ],
)
def test_errors_have_openai_shape(server, body, status, param):
    response = httpx.post(server.base_url + "/v1/completions", json=body, timeout=30)
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    if param is not None:
        assert error["param"] == param


def test_malformed_json_is_400(server):
    response = httpx.post(server.base_url + "/v1/chat/completions", content=b"{not json",
                          headers={"content-type": "application/json"}, timeout=30)
    assert response.status_code == 400 and "error" in response.json()


def _running(server) -> float:
    for line in httpx.get(server.base_url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("trillium:num_requests_running"):
            return float(line.split()[-1])
    raise AssertionError("trillium:num_requests_running missing from /metrics")


def test_disconnect_mid_stream_frees_the_request(server):
    body = {"model": "test-model", "prompt": "Once", "max_tokens": 200, "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        with client.stream("POST", "/v1/completions", json=body) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    break  # one chunk arrived: the request is running; now hang up
    # Poll with a bound instead of sleeping a fixed time.
    wait_until(lambda: _running(server) == 0, timeout_s=30, interval_s=0.05,
               what="the aborted request to stop running")


def test_api_key_and_sigterm_leave_no_children(model_path):
    proc = ServeProcess(model_path, "--kv-cache-memory", "8MiB", env={"TRILLIUM_API_KEY": "sekret"}).wait_healthy()
    try:
        children = child_pids(proc.process.pid)
        assert len(children) == 3
        url = proc.base_url + "/v1/models"
        assert httpx.get(url, timeout=10).status_code == 401
        assert httpx.get(url, headers={"Authorization": "Bearer wrong"}, timeout=10).status_code == 401
        ok = httpx.get(url, headers={"Authorization": "Bearer sekret"}, timeout=10)
        assert ok.status_code == 200 and ok.json()["data"][0]["id"] == "test-model"
    finally:
        code = proc.stop()
    assert code == 0, proc.log()
    assert not any(is_alive(pid) for pid in children)

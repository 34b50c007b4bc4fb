"""--num-scheduler-steps and --stream-interval over HTTP, on the in-process data-plane harness
(real engine, no process start).

What a streaming client sees of multi-step decode (scheduler/multi_step.py): the tokens as
the step's forwards sample them (AheadTokens), with the same text, token count and logprobs
as the request unstreamed; and a client that leaves mid-stream is aborted
after the step running, not at its request's end. With --stream-interval N, chunks of at
least N tokens after the first (vLLM's v1/engine/output_processor.py
RequestState.make_request_output; SGLang's server_args.py --stream-interval), same text, a
stop string still exact. Mirrors vLLM's v0 multi-step scheduling
(vllm/engine/arg_utils.py EngineArgs.num_scheduler_steps).
"""

from __future__ import annotations

import json

import httpx
import pytest

from support.data_plane_server import MESSAGES_TEMPLATE, MODEL_NAME, ServerHarness, stream_then_leave
from trillium.data_plane.chat_options import ChatOptions


def _harness(checkpoint, **engine_args):
    path = checkpoint("llama", max_position_embeddings=2048)  # dp_server's checkpoint: built once
    thinking = {"chat": ChatOptions.build(chat_template=MESSAGES_TEMPLATE, reasoning_parser="qwen3")}
    return ServerHarness(path, {"default": {}, "thinking": thinking}, max_num_seqs=8, **engine_args).start()


@pytest.fixture(scope="module")
def multi_step_server(checkpoint):
    harness = _harness(checkpoint, num_scheduler_steps=4)
    yield harness
    harness.stop()


async def _chunks(server, body: dict) -> tuple[list[dict], dict, dict]:
    """(the streamed choices, the usage, the same request unstreamed)."""
    async with httpx.AsyncClient(base_url=server.url(), timeout=60) as http:
        choices, usage = [], None
        async with http.stream("POST", "/v1/completions", json={**body, "stream": True,
                               "stream_options": {"include_usage": True}}) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    choices.extend(chunk["choices"])
                    usage = chunk.get("usage") or usage
        whole = await http.post("/v1/completions", json={**body, "stream": False})
    assert whole.status_code == 200, whole.text
    return choices, usage, whole.json()


def _tokens_per_chunk(choices: list[dict]) -> list[int]:
    return [len(c["logprobs"]["tokens"]) for c in choices if c["logprobs"] and c["logprobs"]["tokens"]]


async def test_each_forwards_token_streams_as_it_is_sampled_with_the_same_text_and_logprobs(multi_step_server):
    body = {"prompt": [5, 6, 7], "max_tokens": 33, "ignore_eos": True, "temperature": 0, "logprobs": 2}
    choices, usage, whole = await _chunks(multi_step_server, body)
    assert "".join(c["text"] for c in choices) == whole["choices"][0]["text"]
    assert usage["completion_tokens"] == whole["usage"]["completion_tokens"] == 33
    # NOTE: how many chunks depends on timing: AheadTokens leave from the executor's trio
    # thread, which may run only after a short step's result (this tiny model's forwards take
    # ~1 ms, mostly under the GIL); the scheduler then drops them and the result carries their
    # tokens. That each forward's tokens go out ahead is checked where it is deterministic:
    # tests/actors/executor/test_core.py and tests/actors/scheduler/test_loop.py.
    assert sum(_tokens_per_chunk(choices)) == 33
    streamed = [c["logprobs"] for c in choices if c["logprobs"] and c["logprobs"]["tokens"]]
    expected = whole["choices"][0]["logprobs"]
    assert [t for lp in streamed for t in lp["tokens"]] == expected["tokens"]
    assert [p for lp in streamed for p in lp["token_logprobs"]] == pytest.approx(expected["token_logprobs"])
    assert [t for lp in streamed for t in lp["top_logprobs"]] == expected["top_logprobs"]


async def test_a_client_gone_mid_stream_is_aborted(multi_step_server):
    body = {"prompt": [5, 6, 7], "max_tokens": 2000, "ignore_eos": True, "stream": True, "temperature": 0}
    async with httpx.AsyncClient(base_url=multi_step_server.url(), timeout=60) as http:
        await stream_then_leave(http, "/v1/completions", body, events=3)
        start_step = multi_step_server.last_stats.step_id
        stats = await multi_step_server.probe_until_idle(http)
    assert stats.step_id - start_step < 400, "aborted, not run to its end (500 steps of 4)"


@pytest.fixture(scope="module", params=[1, 4], ids=["one-forward-steps", "multi-step-4"])
def interval_server(request, checkpoint):
    harness = _harness(checkpoint, num_scheduler_steps=request.param, stream_interval=3)
    yield harness
    harness.stop()


async def test_a_stream_interval_sends_chunks_of_at_least_n_tokens_after_the_first(interval_server):
    body = {"prompt": [5, 6, 7], "max_tokens": 33, "ignore_eos": True, "temperature": 0, "logprobs": 0}
    choices, usage, whole = await _chunks(interval_server, body)
    assert "".join(c["text"] for c in choices) == whole["choices"][0]["text"]
    assert usage["completion_tokens"] == 33
    sizes = _tokens_per_chunk(choices)
    assert sum(sizes) == 33 and sizes[0] == 1
    assert all(n >= 3 for n in sizes[1:-1]), sizes
    assert len(sizes) <= 1 + 32 // 3 + 1


async def test_unstreamed_choices_held_for_their_end_equal_the_streamed_ones(interval_server):
    """An unstreamed response is final-only (SamplingParams.final_only: the scheduler holds every
    token after the first for the request's end): n = 2 sampled choices, their text, tokens and
    logprobs the same as the same request streamed, choice by choice (vLLM numbers n's seeds
    alike either way)."""
    body = {"prompt": [5, 6, 7], "max_tokens": 21, "ignore_eos": True, "temperature": 1.0, "seed": 11,
            "n": 2, "logprobs": 1}
    choices, usage, whole = await _chunks(interval_server, body)
    assert usage["completion_tokens"] == whole["usage"]["completion_tokens"] == 42
    for index, expected in enumerate(whole["choices"]):
        mine = [c for c in choices if c["index"] == index]
        assert "".join(c["text"] for c in mine) == expected["text"]
        streamed = [c["logprobs"] for c in mine if c["logprobs"] and c["logprobs"]["tokens"]]
        assert [t for lp in streamed for t in lp["tokens"]] == expected["logprobs"]["tokens"]
        assert [p for lp in streamed for p in lp["token_logprobs"]] == pytest.approx(
            expected["logprobs"]["token_logprobs"])


async def test_a_stop_string_ends_the_text_where_it_would_unstreamed(interval_server):
    body = {"prompt": [5, 6, 7], "max_tokens": 40, "ignore_eos": True, "temperature": 0}
    _, _, free = await _chunks(interval_server, body)
    text = free["choices"][0]["text"]
    stop = text[len(text) // 2: len(text) // 2 + 2]
    choices, _, whole = await _chunks(interval_server, {**body, "stop": [stop]})
    assert whole["choices"][0]["finish_reason"] == "stop"
    assert "".join(c["text"] for c in choices) == whole["choices"][0]["text"] == text[: text.index(stop)]


async def test_reasoning_tokens_count_through_the_end_of_thinking_in_a_chunk_of_answer(interval_server):
    """A thinking budget forces </think> after 5 thinking tokens (the template's "<think>\n" spent one),
    the answer follows; with chunks of 3+ tokens the chunk that ends the thinking holds answer tokens
    too. completion_tokens_details.reasoning_tokens counts every token through the one completing
    </think>, streamed and unstreamed alike (README "reasoning_tokens": Trillium's rule)."""
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Tell me about the river"}],
            "max_tokens": 24, "temperature": 0, "logprobs": True, "thinking_token_budget": 5,
            "chat_template_kwargs": {"enable_thinking": True}}
    async with httpx.AsyncClient(base_url=interval_server.url("thinking"), timeout=60) as http:
        whole = await http.post("/v1/chat/completions", json=body)
        assert whole.status_code == 200, whole.text
        usage = None
        async with http.stream("POST", "/v1/chat/completions", json={
                **body, "stream": True, "stream_options": {"include_usage": True}}) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    usage = json.loads(line[6:]).get("usage") or usage
    choice = whole.json()["choices"][0]
    tokens = [t["token"] for t in choice["logprobs"]["content"]]
    through = next(i for i in range(1, len(tokens) + 1) if "</think>" in "".join(tokens[:i]))
    assert choice["message"]["content"] and through < len(tokens)  # an answer follows the thinking
    assert whole.json()["usage"]["completion_tokens_details"]["reasoning_tokens"] == through
    assert usage["completion_tokens_details"]["reasoning_tokens"] == through


@pytest.fixture(scope="module")
def burst_server(checkpoint):
    harness = _harness(checkpoint, num_scheduler_steps=4, multi_step_stream_outputs=False)
    yield harness
    harness.stop()


async def test_no_multi_step_stream_outputs_sends_a_steps_tokens_together(burst_server):
    """vLLM v0's --no-multi-step-stream-outputs (vllm/engine/arg_utils.py
    EngineArgs.multi_step_stream_outputs: "If False, then multi-step will stream outputs at the
    end of all steps"): the prefill step's token, then chunks of whole 4-forward steps."""
    body = {"prompt": [5, 6, 7], "max_tokens": 33, "ignore_eos": True, "temperature": 0, "logprobs": 0}
    choices, _, whole = await _chunks(burst_server, body)
    assert "".join(c["text"] for c in choices) == whole["choices"][0]["text"]
    sizes = _tokens_per_chunk(choices)
    assert sizes[0] == 1 and sum(sizes) == 33 and all(n % 4 == 0 for n in sizes[1:]), sizes

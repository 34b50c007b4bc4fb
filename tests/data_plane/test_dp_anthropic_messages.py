"""Anthropic's Messages API end to end, through the `anthropic` SDK, on the data-plane harness.

Mirrors vLLM's Anthropic endpoint (vllm-project/vllm
vllm/entrypoints/anthropic/serving.py, named serving_messages.py in older
versions; protocol.py; api_router.py): the request runs as the equivalent chat
completion, so greedy text, usage and the rendered prompt equal
/v1/chat/completions' for the same conversation; `tool_choice` "tool" / "any"
force the reply with the chat path's named / required grammar (as OpenAI's
named tool_choice does) and come back as `tool_use` blocks; the stream is
Anthropic's typed events. Where Trillium differs from vLLM: unknown fields
are a 400 naming them, a thinking block needs --reasoning-parser, and
errors keep Anthropic's error types per status (vLLM copies OpenAI's).

Apps (tests/data_plane/conftest.py): "default" (the checkpoint's template),
"keyed" (--api-key), "messages" (a template that renders tools, tool calls,
tool results and thinking; hermes tool parser, qwen3 reasoning parser), "tools-llama3_json"
(tool_choice auto read by that parser).
"""

from __future__ import annotations

import json
from typing import Literal

import anthropic
import httpx
import pytest
from pydantic import BaseModel, ConfigDict

from support.data_plane_server import API_KEY, MODEL_NAME

USER = [{"role": "user", "content": "Tell me about the river and the town"}]


class Weather(BaseModel):
    model_config = ConfigDict(extra="forbid")
    city: Literal["Paris", "Oslo", "Lima"]
    unit: Literal["celsius", "fahrenheit"]


WEATHER_TOOL = {"name": "get_weather", "description": "The weather now", "input_schema": Weather.model_json_schema()}
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def sdk(dp_server):
    with anthropic.Anthropic(base_url=dp_server.url(), api_key="unused", max_retries=0) as client:
        yield client


@pytest.fixture(scope="module")
def tools_sdk(dp_server):
    with anthropic.Anthropic(base_url=dp_server.url("messages"), api_key="unused", max_retries=0) as client:
        yield client


def _chat(dp_server, app: str = "default", **body) -> dict:
    reply = httpx.post(dp_server.url(app) + "/v1/chat/completions", json={"model": MODEL_NAME, **body}, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()


def _text(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def _stop_inside(text: str) -> tuple[str, int]:
    """A 3-character stop string whose first occurrence in `text` is past its start."""
    for j in range(4, len(text) - 3):
        stop = text[j:j + 3]
        if text.find(stop) >= 3:
            return stop, text.find(stop)
    raise AssertionError(f"no usable stop string in {text!r}")


def test_greedy_text_usage_and_count_equal_chat_completions(dp_server, sdk):
    message = sdk.messages.create(model=MODEL_NAME, max_tokens=16, system="Be brief.", messages=USER,
                                  extra_body=GREEDY)
    chat = _chat(dp_server, messages=[{"role": "system", "content": "Be brief."}, *USER], max_tokens=16, **GREEDY)
    choice = chat["choices"][0]
    assert _text(message) and _text(message) == choice["message"]["content"]
    assert message.id.startswith("msg_") and message.role == "assistant" and message.model == MODEL_NAME
    assert message.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[choice["finish_reason"]]
    assert (message.usage.input_tokens, message.usage.output_tokens) == (chat["usage"]["prompt_tokens"],
                                                                        chat["usage"]["completion_tokens"])
    counted = sdk.messages.count_tokens(model=MODEL_NAME, system="Be brief.", messages=USER)
    assert counted.input_tokens == chat["usage"]["prompt_tokens"]


def test_stream_events_and_stop_sequence(dp_server, sdk):
    text = _chat(dp_server, messages=USER, max_tokens=24, **GREEDY)["choices"][0]["message"]["content"]
    with sdk.messages.stream(model=MODEL_NAME, max_tokens=24, messages=USER, extra_body=GREEDY) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    whole = sdk.messages.create(model=MODEL_NAME, max_tokens=24, messages=USER, extra_body=GREEDY)
    assert streamed == _text(whole) == _text(final)
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    assert streamed == text
    # The raw stream: Anthropic's event names and order, no [DONE].
    stop, at = _stop_inside(text)
    body = {"model": MODEL_NAME, "max_tokens": 24, "messages": USER, "stream": True, "stop_sequences": [stop],
            "temperature": 0}
    with httpx.stream("POST", dp_server.url() + "/v1/messages", json=body, timeout=60,
                      headers={"X-Request-Id": "rid-7"}) as reply:
        assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
        assert reply.headers["X-Request-Id"] == "rid-7" and reply.headers["X-Weight-Version"]
        raw = reply.read().decode()
    events = [(e.split("\n")[0].removeprefix("event: "), json.loads(e.split("\n")[1].removeprefix("data: ")))
              for e in raw.strip().split("\n\n")]
    names = [name for name, _ in events]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"} and all(name == data["type"] for name, data in events)
    assert "".join(data["delta"]["text"] for _, data in events[3:-3]) == text[:at]
    assert events[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": stop}
    assert events[0][1]["message"]["usage"]["input_tokens"] == events[-2][1]["usage"]["input_tokens"]
    assert events[0][1]["message"]["id"] == "msg_rid-7"


def test_forced_tool_use_whole_and_streamed(tools_sdk):
    kwargs = dict(model=MODEL_NAME, max_tokens=100, messages=[{"role": "user", "content": "Weather in Paris?"}],
                  tools=[WEATHER_TOOL], tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY)
    message = tools_sdk.messages.create(**kwargs)
    (block,) = message.content
    assert block.type == "tool_use" and block.name == "get_weather" and block.id
    Weather.model_validate(block.input)
    assert message.stop_reason == "tool_use"
    with tools_sdk.messages.stream(**kwargs) as stream:
        pieces = [e.delta.partial_json for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert pieces and json.loads("".join(pieces)) == block.input
    assert final.content[0].type == "tool_use" and final.content[0].input == block.input
    assert final.stop_reason == "tool_use"
    # "any" is the chat path's required grammar; disable_parallel_tool_use allows one call.
    message = tools_sdk.messages.create(**{**kwargs, "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
                                           "max_tokens": 200})
    (block,) = message.content
    assert block.type == "tool_use" and message.stop_reason == "tool_use"
    Weather.model_validate(block.input)


def test_structured_output_format(sdk):
    """output_config.format is the chat path's json_schema response_format: the text is one Weather."""
    kwargs = dict(model=MODEL_NAME, max_tokens=100, messages=USER, extra_body=GREEDY,
                  output_config={"format": {"type": "json_schema", "schema": Weather.model_json_schema()}})
    message = sdk.messages.create(**kwargs)
    Weather.model_validate_json(_text(message))
    assert message.stop_reason == "end_turn"
    with sdk.messages.stream(**kwargs) as stream:
        assert "".join(stream.text_stream) == _text(message)


def test_auto_tool_choice_reads_the_parsers_calls(dp_server):
    """tool_choice auto: the server's --tool-call-parser (llama3_json here) reads the reply; the reply
    is forced into that parser's format with output_config's schema, as test_dp_tool_parsers_e2e.py
    forces it with structured_outputs."""
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
              "properties": {"name": {"enum": ["get_weather"]}, "parameters": Weather.model_json_schema()}}
    kwargs = dict(model=MODEL_NAME, max_tokens=100, messages=[{"role": "user", "content": "Weather in Paris?"}],
                  tools=[WEATHER_TOOL], tool_choice={"type": "auto"}, extra_body=GREEDY,
                  output_config={"format": {"type": "json_schema", "schema": schema}})
    url = dp_server.url("tools-llama3_json")
    with anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0) as client:
        message = client.messages.create(**kwargs)
        with client.messages.stream(**kwargs) as stream:
            final = stream.get_final_message()
    (block,) = message.content
    assert block.type == "tool_use" and block.name == "get_weather" and message.stop_reason == "tool_use"
    Weather.model_validate(block.input)
    assert [(b.type, b.name, b.input) for b in final.content] == [("tool_use", "get_weather", block.input)]
    assert final.stop_reason == "tool_use"


def test_tool_round_trip_and_prefill_render_as_chat(dp_server, tools_sdk):
    """A conversation with thinking, tool_use and tool_result blocks renders the prompt its chat form does."""
    anthropic_messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Ask the tool.", "signature": "opaque"},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
             "input": {"city": "Paris", "unit": "celsius"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 degrees"}]},
        {"role": "assistant", "content": "In Paris it is"},
    ]
    chat_messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "Ask the tool.", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "18 degrees"},
        {"role": "assistant", "content": "In Paris it is"},
    ]
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "The weather now",
                                               "parameters": Weather.model_json_schema()}}]
    chat = _chat(dp_server, "messages", messages=chat_messages, tools=tools, tool_choice="none", max_tokens=8,
                 continue_final_message=True, add_generation_prompt=False, **GREEDY)
    counted = tools_sdk.messages.count_tokens(model=MODEL_NAME, messages=anthropic_messages, tools=[WEATHER_TOOL])
    assert counted.input_tokens == chat["usage"]["prompt_tokens"]
    message = tools_sdk.messages.create(model=MODEL_NAME, max_tokens=8, messages=anthropic_messages,
                                        tools=[WEATHER_TOOL], tool_choice={"type": "none"}, extra_body=GREEDY)
    assert _text(message) == (chat["choices"][0]["message"]["content"] or "")
    assert message.usage.input_tokens == chat["usage"]["prompt_tokens"]


def test_thinking_blocks(dp_server, tools_sdk):
    """thinking enabled: the template opens <think>; a reply that never closes it is all thinking."""
    reasoning = _chat(dp_server, "messages", messages=USER, max_tokens=20,
                      chat_template_kwargs={"enable_thinking": True}, **GREEDY)["choices"][0]["message"]["reasoning"]
    stop, at = _stop_inside(reasoning)
    kwargs = dict(model=MODEL_NAME, max_tokens=1025, messages=USER, stop_sequences=[stop],
                  thinking={"type": "enabled", "budget_tokens": 1024}, extra_body=GREEDY)
    message = tools_sdk.messages.create(**kwargs)
    (block,) = message.content
    assert block.type == "thinking" and block.thinking == reasoning[:at] and block.signature
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", stop)
    with tools_sdk.messages.stream(**kwargs) as stream:
        pieces = [e.delta.thinking for e in stream
                  if e.type == "content_block_delta" and e.delta.type == "thinking_delta"]
        final = stream.get_final_message()
    assert "".join(pieces) == reasoning[:at] and final.content[0].signature
    disabled = tools_sdk.messages.create(model=MODEL_NAME, max_tokens=12, messages=USER,
                                         thinking={"type": "disabled"}, extra_body=GREEDY)
    chat = _chat(dp_server, "messages", messages=USER, max_tokens=12, chat_template_kwargs={"enable_thinking": False},
                 **GREEDY)
    assert [b.type for b in disabled.content] in (["text"], [])
    assert _text(disabled) == (chat["choices"][0]["message"]["content"] or "")


def _error_shape(error: anthropic.APIStatusError, kind: str, words: str) -> None:
    assert error.body["type"] == "error" and error.body["error"]["type"] == kind, error.body
    assert words in error.body["error"]["message"]


@pytest.mark.parametrize("call, kind, words", [
    (dict(extra_body={"frobnicate": 1}), anthropic.BadRequestError, "frobnicate"),
    (dict(messages=[{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": "x",
                                                                               "media_type": "image/png"}}]}]),
     anthropic.BadRequestError, "messages[0].content[0].type"),
    (dict(thinking={"type": "enabled", "budget_tokens": 1024}, max_tokens=2048), anthropic.BadRequestError,
     "--reasoning-parser"),
    (dict(tools=[WEATHER_TOOL], tool_choice={"type": "tool", "name": "nope"}), anthropic.BadRequestError,
     "no tool named"),
    (dict(model="no-such-model"), anthropic.NotFoundError, "no-such-model"),
])
def test_bad_requests_get_anthropic_errors(sdk, call, kind, words):
    kwargs = {"model": MODEL_NAME, "max_tokens": 8, "messages": USER, **call}
    with pytest.raises(kind) as info:
        sdk.messages.create(**kwargs)
    _error_shape(info.value, "not_found_error" if kind is anthropic.NotFoundError else "invalid_request_error", words)
    with pytest.raises(kind):
        with sdk.messages.stream(**kwargs) as stream:
            stream.get_final_message()
    with pytest.raises(anthropic.BadRequestError) as info:
        sdk.messages.count_tokens(model=MODEL_NAME, messages=USER, extra_body={"frobnicate": 1})
    _error_shape(info.value, "invalid_request_error", "frobnicate")


def test_raw_errors_keep_anthropic_shape(dp_server):
    url = dp_server.url() + "/v1/messages"
    cases = [
        (httpx.post(url, json={"model": MODEL_NAME, "messages": USER}), 400, "max_tokens"),
        (httpx.post(url, content=b"{not json", headers={"content-type": "application/json"}), 400, "malformed"),
        (httpx.get(url), 405, "GET /v1/messages"),
        (httpx.post(url + "/count_tokens", json={"model": MODEL_NAME, "messages": []}), 400, "messages"),
    ]
    for reply, status, words in cases:
        assert reply.status_code == status, reply.text
        body = reply.json()
        assert set(body) == {"type", "error"} and body["type"] == "error" and words in body["error"]["message"]
    assert httpx.post(dp_server.url() + "/v1/chat/completions", json={}).json()["error"]["param"] == "messages"
    counting = {"model": MODEL_NAME, "messages": USER}
    assert httpx.post(url + "/count_tokens?beta=true", json=counting).json()["input_tokens"] > 0
    reply = httpx.post(url + "/count_tokens?stream=1", json=counting)
    assert reply.status_code == 400 and "stream: unknown query parameter" in reply.json()["error"]["message"]


def test_api_key_as_x_api_key_or_bearer(dp_server, monkeypatch):
    for name in ("ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    url = dp_server.url("keyed")
    kwargs = dict(model=MODEL_NAME, max_tokens=4, messages=USER)
    with anthropic.Anthropic(base_url=url, default_headers={"x-api-key": API_KEY}, max_retries=0) as client:
        assert client.messages.create(**kwargs).usage.output_tokens >= 1
    with anthropic.Anthropic(base_url=url, auth_token=API_KEY, max_retries=0) as client:
        assert client.messages.count_tokens(model=MODEL_NAME, messages=USER).input_tokens > 0
    with anthropic.Anthropic(base_url=url, default_headers={"x-api-key": "wrong"}, max_retries=0) as client:
        with pytest.raises(anthropic.AuthenticationError) as info:
            client.messages.create(**kwargs)
    _error_shape(info.value, "authentication_error", "API key")
    reply = httpx.post(url + "/v1/chat/completions", headers={"x-api-key": API_KEY},
                       json={"model": MODEL_NAME, "messages": USER, "max_tokens": 2})
    assert reply.status_code == 200, reply.text


def test_thinking_budget_ends_the_thinking(dp_server, tools_sdk):
    """vLLM's thinking_token_budget on the chat route (ThinkingTokenBudgetLogitsProcessor,
    vllm/v1/sample/logits_processor/builtin.py; Anthropic's budget_tokens becomes it,
    test_anthropic_units.py): the template opens <think>, the model would think for all of max_tokens; with a budget it thinks
    that many tokens, `</think>` is forced, and the answer follows."""
    body = dict(messages=USER, max_tokens=24, chat_template_kwargs={"enable_thinking": True}, logprobs=True,
                **GREEDY)
    free = _chat(dp_server, "messages", **body)["choices"][0]
    budgeted = _chat(dp_server, "messages", thinking_token_budget=5, **body)["choices"][0]
    assert free["message"]["content"] is None  # all thinking without a budget
    free_tokens = [t["token"] for t in free["logprobs"]["content"]]
    tokens = [t["token"] for t in budgeted["logprobs"]["content"]]
    # The template's "<think>\n" spent one thinking token already (vLLM counts the prompt's thinking too).
    assert tokens[:4] == free_tokens[:4] and tokens[4] != free_tokens[4]
    assert "".join(tokens[4:]).startswith("</think>")
    assert budgeted["message"]["reasoning"] == "".join(tokens[:4])
    assert budgeted["message"]["content"]  # the answer after the forced </think>
    no_parser = httpx.post(dp_server.url() + "/v1/chat/completions",
                           json={"model": MODEL_NAME, "thinking_token_budget": 5, **body}, timeout=60)
    assert no_parser.status_code == 400 and "--reasoning-parser" in no_parser.json()["error"]["message"]

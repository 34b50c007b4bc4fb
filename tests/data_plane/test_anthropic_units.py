"""Anthropic Messages -> chat request conversion, reply blocks, stream events and error shape (no server).

What a conversation becomes mirrors vLLM's converter
(vllm/entrypoints/anthropic/serving.py `_convert_anthropic_to_openai_request`,
`messages_full_converter`, `message_stream_converter`; request fields from
vllm/entrypoints/anthropic/protocol.py), with Trillium's differences: a
tool_result answers its `tool_use_id` (vLLM reads the block's `id`), a last
assistant message is a prefill to continue, and a field or block Trillium
would not act on is a 400 naming it (vLLM drops it).
"""

from __future__ import annotations

import json

import pytest

from trillium.data_plane.anthropic_messages import chat_request, content_blocks, error_body, stop_reason
from trillium.data_plane.anthropic_protocol import CountTokensRequest, MessagesRequest
from trillium.data_plane.anthropic_stream import BlockEvents
from trillium.data_plane.chat_options import ChatOptions
from trillium.data_plane.errors import ApiError
from trillium.data_plane.protocol import parse_request

REASONING = ChatOptions.build(reasoning_parser="qwen3")
WEATHER = {"name": "get_weather", "description": "Weather now",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}


def _parse(body: dict, model=MessagesRequest):
    defaults = {"model": "m", "max_tokens": 50} if model is MessagesRequest else {"model": "m"}
    return parse_request(model, json.dumps({**defaults, **body}).encode())


def _chat(body: dict, options: ChatOptions = ChatOptions()):
    return chat_request(_parse(body), options)


def _error(body: dict, options: ChatOptions = ChatOptions(), model=MessagesRequest) -> ApiError:
    with pytest.raises(ApiError) as info:
        chat_request(_parse(body, model), options)
    assert info.value.status == 400
    return info.value


def test_conversation_becomes_template_messages():
    chat = _chat({
        "system": [{"type": "text", "text": "Be "},
                   {"type": "text", "text": "brief.", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Use the tool.", "signature": "sig"},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "18C"}]},
                {"type": "tool_result", "tool_use_id": "toolu_2", "content": "down", "is_error": True},
                {"type": "text", "text": "Thanks"}]},
        ],
        "tools": [WEATHER], "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "stop_sequences": ["END"], "temperature": 0.5, "top_p": 0.9, "top_k": 4, "metadata": {"user_id": "u"},
    })
    assert [m.to_template() for m in chat.messages] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Use the tool.",
         "tool_calls": [{"id": "toolu_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "content": "18C", "tool_call_id": "toolu_1"},
        {"role": "tool", "content": "Error: down", "tool_call_id": "toolu_2"},
        {"role": "user", "content": "Thanks"},
    ]
    assert chat.tools == [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                                            "parameters": WEATHER["input_schema"]}}]
    assert chat.tool_choice == "required" and chat.parallel_tool_calls is False
    assert (chat.max_tokens, chat.stop, chat.temperature, chat.top_p, chat.top_k) == (50, ("END",), 0.5, 0.9, 4)
    assert chat.add_generation_prompt and not chat.continue_final_message


def test_prefill_named_tool_and_thinking():
    chat = _chat({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, I"}],
                  "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "get_weather"},
                  "thinking": {"type": "enabled", "budget_tokens": 1024}, "max_tokens": 2000}, REASONING)
    assert chat.continue_final_message and chat.add_generation_prompt is False
    assert chat.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    assert chat.chat_template_kwargs == {"enable_thinking": True}
    assert chat.thinking_token_budget == 1024  # enforced as vLLM's thinking_token_budget
    disabled = _chat({"messages": [{"role": "user", "content": "Hi"}], "thinking": {"type": "disabled"}})
    assert disabled.chat_template_kwargs == {"enable_thinking": False} and disabled.include_reasoning is False
    adaptive = _chat({"messages": [{"role": "user", "content": "Hi"}], "thinking": {"type": "adaptive"}})
    assert adaptive.chat_template_kwargs is None and adaptive.include_reasoning is not False
    counted = chat_request(_parse({"messages": [{"role": "user", "content": "Hi"}]}, CountTokensRequest), ChatOptions())
    assert counted.max_tokens is None


def test_output_config_is_the_chat_response_format():
    schema = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"]}
    chat = _chat({"messages": [{"role": "user", "content": "Hi"}],
                  "output_config": {"format": {"type": "json_schema", "schema": schema}, "effort": "low"}})
    assert chat.response_format == {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
    assert chat.reasoning_effort == "low"


@pytest.mark.parametrize("body, options, param", [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, ChatOptions(),
     "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "citations": [{"x": 1}]}]}]},
     ChatOptions(), "messages[0].content[0].citations"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]}, ChatOptions(),
     "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "n", "input": {}}]}]},
     ChatOptions(), "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, ChatOptions(),
     "messages[0].content[0].text"),
    ({"messages": [{"role": "user", "content": "x"}], "system": [{"type": "tool_use"}]}, ChatOptions(),
     "system[0].type"),
    ({"messages": [{"role": "user", "content": "x"}], "thinking": {"type": "enabled", "budget_tokens": 1024}},
     ChatOptions(), "thinking"),
    ({"messages": [{"role": "user", "content": "x"}], "thinking": {"type": "enabled", "budget_tokens": 50}},
     REASONING, "thinking.budget_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "tool"}}, ChatOptions(),
     "tool_choice.name"),
    ({"messages": [{"role": "user", "content": "x"}],
      "output_config": {"format": {"type": "json_schema", "schema": {"type": "nonsense"}}}}, ChatOptions(),
     "output_config.format.schema"),
])
def test_bad_content_names_the_field(body, options, param):
    assert _error(body, options).param == param


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "user", "content": "x"}], "frobnicate": 1}, "frobnicate"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{**WEATHER, "strict": True}]}, "tools[0].strict"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "web_search_20250305", "name": "s"}]},
     "tools[0].input_schema"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "x"}], "thinking": {"type": "enabled", "display": "omitted"}},
     "thinking.display"),
])
def test_bad_fields_are_400s(body, param):
    with pytest.raises(ApiError) as info:
        _parse(body)
    assert info.value.status == 400 and info.value.param == param
    assert _parse({"messages": [{"role": "user", "content": "x"}], "service_tier": "auto"}).model_extra


def test_reply_blocks_and_stop_reasons():
    message = {"content": "It is", "reasoning_content": "hmm",
               "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}},
                              {"id": "call_2", "type": "function", "function": {"name": "f", "arguments": '{"a"'}}]}
    blocks = content_blocks(message)
    assert [b["type"] for b in blocks] == ["thinking", "text", "tool_use"]
    assert blocks[0]["thinking"] == "hmm" and blocks[0]["signature"]
    assert blocks[1]["text"] == 'It is{"a"'  # a call cut short stays text
    assert blocks[2] == {"type": "tool_use", "id": "call_1", "name": "f", "input": {"a": 1}}
    assert content_blocks({"content": None, "tool_calls": []}) == []
    assert stop_reason("stop", None, False, 3, 10) == ("end_turn", None)
    assert stop_reason("stop", 7, False, 3, 10) == ("end_turn", None)  # a stop token id
    assert stop_reason("stop", "END", False, 3, 10) == ("stop_sequence", "END")
    assert stop_reason("stop", None, True, 3, 10) == ("tool_use", None)
    assert stop_reason("length", None, True, 10, 10) == ("max_tokens", None)
    assert stop_reason("length", None, False, 4, 10) == ("model_context_window_exceeded", None)
    assert stop_reason("abort", None, False, 4, 10) == (None, None)


def _events(raw: list[bytes]) -> list[tuple[str, dict]]:
    out = []
    for item in raw:
        head, data = item.decode().rstrip("\n").split("\n")
        out.append((head.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
        assert out[-1][0] == out[-1][1]["type"]
    return out


def test_block_events_open_one_block_at_a_time():
    blocks = BlockEvents()
    raw = blocks.feed({"reasoning_content": "a"}) + blocks.feed({"reasoning_content": "b", "content": "c"})
    raw += blocks.feed({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                        "function": {"name": "f", "arguments": ""}}]})
    raw += blocks.feed({"tool_calls": [{"index": 0, "function": {"arguments": '{"x"'}}]})
    raw += blocks.feed({"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}},
                                       {"index": 1, "id": "call_2", "type": "function",
                                        "function": {"name": "g", "arguments": "{}"}}]})
    raw += blocks.close() + blocks.close()
    events = _events(raw)
    shape = [(kind, data.get("index"), (data.get("delta") or data.get("content_block") or {}).get("type"))
             for kind, data in events]
    assert shape == [
        ("content_block_start", 0, "thinking"), ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "thinking_delta"), ("content_block_delta", 0, "signature_delta"),
        ("content_block_stop", 0, None), ("content_block_start", 1, "text"), ("content_block_delta", 1, "text_delta"),
        ("content_block_stop", 1, None), ("content_block_start", 2, "tool_use"),
        ("content_block_delta", 2, "input_json_delta"), ("content_block_delta", 2, "input_json_delta"),
        ("content_block_stop", 2, None), ("content_block_start", 3, "tool_use"),
        ("content_block_delta", 3, "input_json_delta"), ("content_block_stop", 3, None),
    ]
    assert events[8][1]["content_block"] == {"type": "tool_use", "id": "call_1", "name": "f", "input": {}}
    assert events[9][1]["delta"]["partial_json"] + events[10][1]["delta"]["partial_json"] == '{"x": 1}'


@pytest.mark.parametrize("status, kind", [(400, "invalid_request_error"), (401, "authentication_error"),
                                          (404, "not_found_error"), (413, "request_too_large"),
                                          (405, "invalid_request_error"), (500, "api_error"),
                                          (503, "overloaded_error")])
def test_error_types_by_status(status, kind):
    assert error_body(ApiError(status, "why")) == {"type": "error", "error": {"type": kind, "message": "why"}}

"""POST /v1/responses through the openai SDK (`client.responses.create` / `.stream`) on the data-plane harness.

The Responses API is served as the chat request it amounts to, as vLLM's
vllm/entrypoints/openai/responses/serving.py does (utils.py
`construct_input_messages`: instructions as a system message, a string input
as one user message, items as chat messages; `build_response_output_items`:
reasoning, message and function_call items). So greedy, a response's
output_text is /v1/chat/completions's content for the same conversation.
A random model never calls a tool by itself: a named tool_choice (its
grammar) or the request's `structured_outputs.choice` (vLLM's extra field;
the parser's format, as test_dp_tool_parsers_e2e.py does) make it.
"""

from __future__ import annotations

import json
from typing import Literal

import openai
import pytest
from pydantic import BaseModel

from support.data_plane_server import MODEL_NAME
from test_dp_tool_parsers_e2e import REPLIES

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
           "required": ["city"], "additionalProperties": False}
TOOL = {"type": "function", "name": "get_weather", "description": "the weather", "parameters": WEATHER}
CHAT_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "the weather",
                                              "parameters": WEATHER}}


class City(BaseModel):
    city: Literal["Paris", "Oslo"]


def _client(server, app: str = "default") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url(app) + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def sdk(dp_server):
    with _client(dp_server) as client:
        yield client


def _chat_text(client: openai.OpenAI, messages: list[dict], max_tokens: int = 8, **extra) -> str:
    reply = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=max_tokens,
                                           temperature=0, **extra)
    return reply.choices[0].message.content or ""


def test_string_input_and_instructions_match_chat(sdk):
    plain = sdk.responses.create(model=MODEL_NAME, input="Tell me a story.", max_output_tokens=8, temperature=0)
    assert plain.object == "response" and plain.id.startswith("resp_") and plain.model == MODEL_NAME
    assert plain.output_text == _chat_text(sdk, [{"role": "user", "content": "Tell me a story."}])
    assert plain.status == "incomplete" and plain.incomplete_details.reason == "max_output_tokens"
    (message,) = plain.output
    assert message.type == "message" and message.role == "assistant" and message.status == "incomplete"
    assert plain.usage.output_tokens == 8 and plain.usage.total_tokens == plain.usage.input_tokens + 8
    told = sdk.responses.create(model=MODEL_NAME, input="Tell me a story.", instructions="Be brief.",
                                max_output_tokens=8, temperature=0)
    assert told.instructions == "Be brief."
    assert told.output_text == _chat_text(sdk, [{"role": "system", "content": "Be brief."},
                                                {"role": "user", "content": "Tell me a story."}])
    assert told.usage.input_tokens > plain.usage.input_tokens


def test_item_list_input_matches_chat(sdk):
    items = [
        {"role": "developer", "content": "Answer in French."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi "},
                                                        {"type": "input_text", "text": "there"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Hello!", "annotations": []}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    chat = [
        {"role": "developer", "content": "Answer in French."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello!", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    reply = sdk.responses.create(model=MODEL_NAME, input=items, max_output_tokens=8, temperature=0, store=False)
    assert reply.output_text == _chat_text(sdk, chat) and reply.store is False


def test_json_schema_text_format(sdk):
    fmt = {"type": "json_schema", "name": "weather", "schema": WEATHER, "strict": True}
    reply = sdk.responses.create(model=MODEL_NAME, input="Where?", text={"format": fmt}, max_output_tokens=40,
                                 temperature=0)
    assert reply.status == "completed" and reply.text.format.type == "json_schema"
    assert json.loads(reply.output_text)["city"] in ("Paris", "Oslo")
    assert reply.output_text == _chat_text(sdk, [{"role": "user", "content": "Where?"}], 40, response_format={
        "type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER, "strict": True}})
    parsed = sdk.responses.parse(model=MODEL_NAME, input="Where?", text_format=City, max_output_tokens=40,
                                 temperature=0)
    assert parsed.output_parsed.city in ("Paris", "Oslo")
    loose = sdk.responses.create(model=MODEL_NAME, input="Where?", text={"format": {"type": "json_object"}},
                                 max_output_tokens=40, temperature=0)
    assert loose.output_text == _chat_text(sdk, [{"role": "user", "content": "Where?"}], 40,
                                           response_format={"type": "json_object"})


def _check_call(item, call_id_prefix: str = "call_") -> None:
    assert item.type == "function_call" and item.name == "get_weather" and item.status == "completed"
    assert item.call_id.startswith(call_id_prefix) and item.id.startswith("fc_")
    assert json.loads(item.arguments)["city"] in ("Paris", "Oslo")


def test_named_tool_choice_whole_and_streamed(sdk):
    kwargs = dict(model=MODEL_NAME, input="Weather in Paris?", tools=[TOOL], max_output_tokens=40, temperature=0,
                  tool_choice={"type": "function", "name": "get_weather"})
    reply = sdk.responses.create(**kwargs)
    (call,) = reply.output
    _check_call(call)
    assert reply.tool_choice.name == "get_weather" and reply.tools[0].name == "get_weather"
    chat = sdk.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Weather in Paris?"}],
                                       tools=[CHAT_TOOL], max_tokens=40, temperature=0,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert call.arguments == chat.choices[0].message.tool_calls[0].function.arguments
    with sdk.responses.stream(**kwargs) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    (streamed,) = final.output
    _check_call(streamed)
    assert streamed.arguments == call.arguments
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert "response.function_call_arguments.delta" in kinds
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done",
                          "response.completed"]


def test_required_tool_choice(sdk):
    """vLLM's "required" grammar (vllm/tool_parsers/utils.py): at least one call of a given tool."""
    reply = sdk.responses.create(model=MODEL_NAME, input="Weather?", tools=[TOOL], tool_choice="required",
                                 parallel_tool_calls=False, max_output_tokens=60, temperature=0)
    (call,) = reply.output
    _check_call(call)
    assert reply.status == "completed" and reply.parallel_tool_calls is False


def test_auto_tool_choice_reads_the_parser_format(dp_server):
    """tools-llama3_json: the reply forced into that parser's format comes back as a function_call item."""
    with _client(dp_server, "tools-llama3_json") as client:
        reply = client.responses.create(model=MODEL_NAME, input="Weather in Paris?", tools=[TOOL],
                                        max_output_tokens=60, temperature=0,
                                        extra_body={"structured_outputs": {"choice": [REPLIES["llama3_json"]]}})
    (call,) = reply.output
    _check_call(call)
    assert json.loads(call.arguments) == {"city": "Paris"} and reply.status == "completed"


def test_stream_events_of_a_text_reply(sdk):
    kwargs = dict(model=MODEL_NAME, input="Tell me a story.", max_output_tokens=8, temperature=0)
    whole = sdk.responses.create(**kwargs)
    events = list(sdk.responses.create(**kwargs, stream=True))
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    text = "".join(e.delta for e in deltas)
    assert text == whole.output_text == events[-4].text
    item_id = events[2].item.id
    assert all(e.item_id == item_id and e.output_index == 0 for e in deltas)
    last = events[-1].response
    assert last.status == "incomplete" and last.output[0].id == item_id and last.output_text == text
    assert last.usage.output_tokens == 8


def test_streamed_completed_response_via_stream_helper(sdk):
    fmt = {"type": "json_schema", "name": "weather", "schema": WEATHER}
    with sdk.responses.stream(model=MODEL_NAME, input="Where?", text={"format": fmt}, max_output_tokens=40,
                              temperature=0) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == text
    assert json.loads(text)["city"] in ("Paris", "Oslo")


def test_reasoning_items_with_a_reasoning_parser(dp_server):
    """--reasoning-parser deepseek_r1: the thinking is a reasoning item (vLLM's build_response_output_items);
    a random reply never closes </think>, so it is all reasoning, as chat's reasoning_content is."""
    with _client(dp_server, "reasoning") as client:
        kwargs = dict(model=MODEL_NAME, input="Think.", max_output_tokens=6, temperature=0,
                      reasoning={"effort": "low"})
        reply = client.responses.create(**kwargs)
        chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Think."}],
                                              max_tokens=6, temperature=0, reasoning_effort="low")
        events = list(client.responses.create(**kwargs, stream=True))
    message = chat.choices[0].message
    thinking = message.model_dump()["reasoning_content"]
    assert thinking and reply.output[0].type == "reasoning" and reply.output[0].content[0].text == thinking
    assert reply.output_text == (message.content or "") and reply.reasoning.effort == "low"
    assert reply.usage.output_tokens_details.reasoning_tokens == chat.usage.completion_tokens_details.reasoning_tokens
    streamed = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert streamed == thinking and events[-1].response.output[0].type == "reasoning"

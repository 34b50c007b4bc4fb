"""The pure parts of /v1/responses: items -> chat messages, the event stream, the bounded store.

Item conversion mirrors vLLM's vllm/entrypoints/openai/responses/utils.py
(`construct_input_messages`, `_construct_message_from_response_item`): a
function_call joins the assistant turn before it as a tool call, a
reasoning item becomes that turn's reasoning, a function_call_output is a
tool message, a stored response's reasoning output is not carried over.
Events follow OpenAI's streaming reference (the openai SDK's
lib/streaming/responses/_responses.py accumulates them).
"""

from __future__ import annotations

import json

import pytest
import trio

from trillium.data_plane.errors import ApiError
from trillium.data_plane.responses_output import ResponseEvents
from trillium.data_plane.responses_request import ResponsesRequest, chat_request, conversation
from trillium.data_plane.responses_store import ResponseStore, StoredResponse


def _req(**body) -> ResponsesRequest:
    return ResponsesRequest.model_validate(body)


def test_items_become_chat_messages():
    req = _req(input=[
        {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{\"x\": 1}"},
        {"type": "function_call_output", "call_id": "c1", "output": "1"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "2"}]},
    ])
    assert conversation(req, None, None) == [
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "ok", "reasoning_content": "hm", "reasoning": "hm", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{\"x\": 1}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "1"},
        {"role": "tool", "tool_call_id": "c2", "content": "2"},
    ]


def test_history_and_previous_output_come_first_without_reasoning():
    history = [{"role": "user", "content": "q"}]
    output = [{"id": "rs_1", "type": "reasoning", "summary": [], "status": "completed",
               "content": [{"type": "reasoning_text", "text": "think"}]},
              {"id": "msg_1", "type": "message", "role": "assistant", "status": "completed",
               "content": [{"type": "output_text", "text": "A", "annotations": [], "logprobs": []}]},
              {"id": "fc_1", "type": "function_call", "call_id": "c", "name": "f", "arguments": "{}",
               "status": "completed"}]
    messages = conversation(_req(input=[{"type": "function_call_output", "call_id": "c", "output": "r"}]),
                            history, output)
    assert messages == [{"role": "user", "content": "q"},
                        {"role": "assistant", "content": "A", "tool_calls": [
                            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                        {"role": "tool", "tool_call_id": "c", "content": "r"}]
    assert history == [{"role": "user", "content": "q"}]  # the stored conversation is not changed


def test_chat_request_maps_the_fields():
    req = _req(input="hi", instructions="sys", max_output_tokens=7, temperature=0.5, top_p=0.9,
               tools=[{"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": True}],
               tool_choice={"type": "function", "name": "f"}, parallel_tool_calls=False,
               text={"format": {"type": "json_schema", "name": "n", "schema": {"type": "object"}}},
               reasoning={"effort": "high"}, seed=3, stream=True)
    chat = chat_request(req, conversation(req, None, None))
    assert [m.to_template() for m in chat.messages] == [{"role": "system", "content": "sys"},
                                                       {"role": "user", "content": "hi"}]
    assert chat.max_completion_tokens == 7 and chat.temperature == 0.5 and chat.top_p == 0.9 and chat.seed == 3
    assert chat.tools == [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"},
                                                            "strict": True}}]
    assert chat.tool_choice == {"type": "function", "function": {"name": "f"}} and chat.parallel_tool_calls is False
    assert chat.response_format == {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}}}
    assert chat.reasoning_effort == "high" and chat.stream is True


@pytest.mark.parametrize(("body", "param"), [
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": "x", "name": "bob"}]}, "input[0].name"),
    ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "zzz"}]}, "input[0].encrypted_content"),
    ({"input": [{"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]}]},
     "input[0].content[0].type"),
])
def test_bad_items_name_their_path(body, param):
    with pytest.raises(ApiError) as caught:
        conversation(_req(**body), None, None)
    assert caught.value.status == 400 and caught.value.param == param


def _decode(events: list[bytes]) -> list[dict]:
    decoded = []
    for raw in events:
        head, data = raw.decode().split("\n", 1)
        body = json.loads(data.removeprefix("data: "))
        assert head == "event: " + body["type"] and raw.endswith(b"\n\n")
        decoded.append(body)
    return decoded


def test_event_stream_of_reasoning_text_and_calls():
    events = ResponseEvents({"id": "resp_1", "status": "in_progress", "output": []})
    raw = events.start()
    raw += events.feed({"reasoning_content": "th"}) + events.feed({"reasoning_content": "ink"})
    raw += events.feed({"content": "Hi"})
    raw += events.feed({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                        "function": {"name": "f", "arguments": ""}}]})
    raw += events.feed({"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]})
    closing, response = events.finish("completed", None, {"input_tokens": 1})
    decoded = _decode(raw + closing)
    assert [e["sequence_number"] for e in decoded] == list(range(len(decoded)))
    assert [e["type"] for e in decoded] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta", "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert [e["output_index"] for e in decoded[2:-1]] == [0] * 7 + [1] * 6 + [2] * 4
    assert decoded[2]["item"]["status"] == "in_progress" and decoded[2]["item"]["content"][0]["text"] == ""
    reasoning, message, call = response["output"]
    assert reasoning["content"][0]["text"] == "think" and message["content"][0]["text"] == "Hi"
    assert call == {"id": call["id"], "type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}",
                    "status": "completed"}
    assert decoded[-1]["response"] == response and response["status"] == "completed"


def test_incomplete_stream_ends_with_response_incomplete():
    events = ResponseEvents({"id": "resp_1", "status": "in_progress", "output": []})
    events.feed({"content": "cut"})
    closing, response = events.finish("incomplete", {"reason": "max_output_tokens"}, None)
    decoded = _decode(closing)
    assert decoded[-1]["type"] == "response.incomplete" and response["output"][0]["status"] == "incomplete"
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}


def _entry(status: str = "completed", cancel=None) -> StoredResponse:
    return StoredResponse({"status": status}, [], cancel)


async def test_store_is_bounded_lru_and_cancels_an_evicted_run():
    store = ResponseStore(2)
    running = trio.CancelScope()
    store.put("a", _entry("in_progress", running))
    store.put("b", _entry())
    assert store.get("a") is not None  # a is now the most recently used
    store.put("c", _entry())
    assert store.get("b") is None and len(store) == 2 and not running.cancel_called
    store.put("d", _entry())
    assert store.get("a") is None and running.cancel_called
    assert store.delete("c") and not store.delete("c")
    assert not ResponseStore(0).enabled
    with pytest.raises(ValueError, match="--responses-store-size"):
        ResponseStore(-1)

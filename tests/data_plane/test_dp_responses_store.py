"""/v1/responses's store: previous_response_id, retrieve, eviction, background + cancel, and bad input.

Mirrors vLLM's vllm/entrypoints/openai/responses/serving.py: a chained
response's conversation is the previous one's messages and output (its
instructions do not carry over; utils.py `construct_input_messages`), an
unknown id is a 404 "Response with id '...' not found.", `background` needs
`store`, cancelling a response that is not running in the background is a
400 "Cannot cancel a synchronous response.", and a cancelled background
response reads "cancelled". Unlike vLLM (an unbounded store, off unless
VLLM_ENABLE_RESPONSES_API_STORE) the store is on and bounded
(--responses-store-size; the "store2" app keeps 2). Bad input is a 4xx in
OpenAI's error shape naming the parameter, never a silent no-op.
"""

from __future__ import annotations

import httpx
import openai
import pytest

from support.data_plane_server import MODEL_NAME
from support.waiting import wait_until


def _client(server, app: str = "default") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url(app) + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def sdk(dp_server):
    with _client(dp_server) as client:
        yield client


def _chat_text(client: openai.OpenAI, messages: list[dict]) -> str:
    reply = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=6, temperature=0)
    return reply.choices[0].message.content or ""


def test_previous_response_id_continues_the_conversation(sdk):
    first = sdk.responses.create(model=MODEL_NAME, input="Hello.", instructions="Be kind.", max_output_tokens=6,
                                 temperature=0)
    second = sdk.responses.create(model=MODEL_NAME, input="Go on.", previous_response_id=first.id,
                                  max_output_tokens=6, temperature=0)
    assert second.previous_response_id == first.id and second.instructions is None
    turns = [{"role": "user", "content": "Hello."}]
    if first.output_text:
        turns.append({"role": "assistant", "content": first.output_text})
    assert second.output_text == _chat_text(sdk, [*turns, {"role": "user", "content": "Go on."}])
    third = sdk.responses.create(model=MODEL_NAME, input="More.", previous_response_id=second.id,
                                 instructions="Be short.", max_output_tokens=6, temperature=0)
    turns += [{"role": "user", "content": "Go on."}]
    if second.output_text:
        turns.append({"role": "assistant", "content": second.output_text})
    assert third.output_text == _chat_text(sdk, [{"role": "system", "content": "Be short."}, *turns,
                                                 {"role": "user", "content": "More."}])


def test_retrieve_delete_and_store_false(sdk):
    kept = sdk.responses.create(model=MODEL_NAME, input="Keep me.", max_output_tokens=4, temperature=0)
    assert kept.store is True
    assert sdk.responses.retrieve(kept.id).model_dump() == kept.model_dump()
    sdk.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError, match=f"Response with id '{kept.id}' not found."):
        sdk.responses.retrieve(kept.id)
    dropped = sdk.responses.create(model=MODEL_NAME, input="Forget me.", max_output_tokens=4, store=False)
    assert dropped.store is False
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(dropped.id)
    with pytest.raises(openai.NotFoundError) as caught:
        sdk.responses.create(model=MODEL_NAME, input="x", previous_response_id=dropped.id)
    assert caught.value.body["param"] == "previous_response_id"


def test_streamed_response_is_stored(sdk):
    with sdk.responses.stream(model=MODEL_NAME, input="Stream me.", max_output_tokens=4, temperature=0) as stream:
        events = list(stream)
    last = events[-1].response
    assert sdk.responses.retrieve(last.id).model_dump() == last.model_dump()


def test_store_evicts_the_least_recently_used(dp_server):
    with _client(dp_server, "store2") as client:
        ids = [client.responses.create(model=MODEL_NAME, input=f"n{i}", max_output_tokens=2).id for i in range(3)]
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(ids[0])
        with pytest.raises(openai.NotFoundError):
            client.responses.create(model=MODEL_NAME, input="x", previous_response_id=ids[0])
        assert client.responses.retrieve(ids[1]).id == ids[1]  # now the most recently used
        client.responses.create(model=MODEL_NAME, input="n3", max_output_tokens=2)
        assert client.responses.retrieve(ids[1]).id == ids[1]
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(ids[2])


def test_background_runs_and_cancel(sdk, dp_server):
    done = sdk.responses.create(model=MODEL_NAME, input="Later.", max_output_tokens=4, temperature=0,
                                background=True)
    assert done.status in ("queued", "in_progress") and done.background is True
    wait_until(lambda: sdk.responses.retrieve(done.id).status not in ("queued", "in_progress"), timeout_s=60,
               interval_s=0.05, what="the background response to finish")
    finished = sdk.responses.retrieve(done.id)
    assert finished.status in ("completed", "incomplete") and 0 < finished.usage.output_tokens <= 4
    assert finished.output_text == sdk.responses.create(model=MODEL_NAME, input="Later.", max_output_tokens=4,
                                                        temperature=0).output_text
    with pytest.raises(openai.BadRequestError, match="Cannot cancel a synchronous response."):
        sdk.responses.cancel(done.id)
    long = sdk.responses.create(model=MODEL_NAME, input="A long story.", max_output_tokens=1900, background=True,
                                extra_body={"ignore_eos": True})
    wait_until(lambda: dp_server.num_in_flight() == 1, timeout_s=30, interval_s=0.01,
               what="the background request to reach the engine")
    cancelled = sdk.responses.cancel(long.id)
    assert cancelled.id == long.id and cancelled.status == "cancelled"
    after = sdk.responses.retrieve(long.id)
    assert after.status == "cancelled" and after.usage is None and after.output == []
    wait_until(lambda: dp_server.num_in_flight() == 0, timeout_s=30, interval_s=0.02,
               what="the cancelled request to leave the engine")
    with pytest.raises(openai.NotFoundError):
        sdk.responses.cancel("resp_unknown")


BAD_BODIES = [
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "tools": [{"type": "function", "name": "f", "cache_control": {}}]}, "tools[0].cache_control"),
    ({"input": "x", "tools": [{"type": "function"}]}, "tools[0].name"),
    ({"input": "x", "tools": [{"type": "function", "name": "f", "parameters": "{}"}], "tool_choice": "none"},
     "tools[0].parameters"),
    ({"input": "x", "frobnicate": 1}, "frobnicate"),
    ({"input": "x", "include": ["message.output_text.logprobs"]}, "include"),
    ({"input": "x", "truncation": "auto"}, "truncation"),
    ({"input": "x", "prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"input": "x", "conversation": "conv_1"}, "conversation"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": []}, "input"),
    ({"input": 3}, "input"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}}, "text.format.schema"),
    ({"input": "x", "text": {"format": {"type": "grammar"}}}, "text.format.type"),
    ({"input": "x", "reasoning": {"effort": "low", "summary": "auto"}}, "reasoning.summary"),
    ({"input": "x", "tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"input": "x", "tools": [{"type": "function", "name": "f"}]}, "tool_choice"),  # auto needs a parser
    ({"input": "x", "tool_choice": {"type": "function", "name": "g"}, "tools": [{"type": "function", "name": "f"}]},
     "tool_choice"),
    ({"input": "x", "max_output_tokens": 5000}, "max_output_tokens"),
    ({"input": "x", "temperature": "hot"}, "temperature"),
    ({"input": "x", "background": True, "store": False}, "background"),
    ({"input": "x", "background": True, "stream": True}, "background"),
]


@pytest.mark.parametrize(("body", "param"), BAD_BODIES, ids=[p for _, p in BAD_BODIES])
def test_bad_input_is_a_400_naming_the_parameter(dp_server, body, param):
    reply = httpx.post(dp_server.url() + "/v1/responses", json={"model": MODEL_NAME, **body}, timeout=30)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param and error["message"]


def test_bad_requests_around_the_store(dp_server):
    url = dp_server.url() + "/v1/responses"
    missing = httpx.get(url + "/resp_nope", timeout=30)
    assert missing.status_code == 404 and missing.json()["error"]["message"] == "Response with id 'resp_nope' not found."
    stored = httpx.post(url, json={"input": "x", "max_output_tokens": 2}, timeout=30).json()
    streamed = httpx.get(f"{url}/{stored['id']}", params={"stream": "true"}, timeout=30)
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "stream"
    assert httpx.get(f"{url}/{stored['id']}", params={"stream": "false"}, timeout=30).status_code == 200
    assert httpx.post(url, json={"model": "nope", "input": "x"}, timeout=30).status_code == 404
    assert httpx.post(url, content=b"{not json", timeout=30).status_code == 400


def test_openapi_describes_the_route(dp_server):
    document = httpx.get(dp_server.url() + "/openapi.json", timeout=30).json()
    body = document["paths"]["/v1/responses"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body["$ref"] == "#/components/schemas/ResponsesRequest"
    assert {"input", "instructions", "previous_response_id"} <= set(document["components"]["schemas"][
        "ResponsesRequest"]["properties"])

"""Every error the data plane returns: status, OpenAI's JSON shape, and `param`.

Bad input of every kind is a 400 naming the parameter (never a 500); an
unknown model is a 404, a wrong key a 401 (on /v1/* only), a full queue a
503 with Retry-After. A field Trillium does not implement is a 400 naming it.
"""

from __future__ import annotations

import httpx
import openai
import pytest

from support.data_plane_server import API_KEY, MODEL_NAME


MSG = [{"role": "user", "content": "hi"}]

COMPLETION_CASES = [
    ({}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": [1, 2, "x"]}, "prompt"),
    ({"prompt": [1, 99999]}, "prompt"),
    ({"prompt": [3] * 2048}, "prompt"),
    ({"prompt": "a", "max_tokens": "5"}, "max_tokens"),
    ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "a", "max_tokens": 5000}, "max_tokens"),
    ({"prompt": "a", "max_tokens": 2.5}, "max_tokens"),
    ({"prompt": "a", "temperature": -1}, "temperature"),
    ({"prompt": "a", "temperature": "hot"}, "temperature"),
    ({"prompt": "a", "top_p": 0}, "top_p"),
    ({"prompt": "a", "top_p": 1.5}, "top_p"),
    ({"prompt": "a", "n": 0}, "n"),
    ({"prompt": "a", "n": 1000}, "n"),
    ({"prompt": "a", "best_of": 3}, "best_of"),
    ({"prompt": "a", "suffix": "end"}, "suffix"),
    ({"prompt": "a", "stop": 5}, "stop"),
    ({"prompt": "a", "stop": [""]}, "stop"),
    ({"prompt": "a", "logprobs": 21}, "logprobs"),
    ({"prompt": "a", "logprobs": True}, "logprobs"),
    ({"prompt": "a", "logit_bias": {"abc": 1}}, "logit_bias"),
    ({"prompt": "a", "logit_bias": {"99999": 1}}, "logit_bias"),
    ({"prompt": "a", "logit_bias": {"5": 1000}}, "logit_bias"),
    ({"prompt": "a", "logit_bias": {"5": "x"}}, "logit_bias.5"),
    ({"prompt": "a", "presence_penalty": 3}, "presence_penalty"),
    ({"prompt": "a", "frequency_penalty": -3}, "frequency_penalty"),
    ({"prompt": "a", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "a", "top_k": -5}, "top_k"),
    ({"prompt": "a", "min_p": 2}, "min_p"),
    ({"prompt": "a", "max_tokens": 5, "min_tokens": 20}, "min_tokens"),
    ({"prompt": "a", "stop_token_ids": [99999]}, "stop_token_ids"),
    ({"prompt": "a", "stop_token_ids": ["x"]}, "stop_token_ids[0]"),
    ({"prompt": "a", "seed": "x"}, "seed"),
    ({"prompt": "a", "speculative": "no"}, "speculative"),
    ({"prompt": "a", "seed": 2**63}, "seed"),
    ({"prompt": "a", "priority": 2**70}, "priority"),
    ({"prompt": "a", "stream": "yes"}, "stream"),
    ({"prompt": "a", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "a", "stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ({"prompt": "a", "echo": "x"}, "echo"),
    ({"prompt": "a", "ignore_eos": "no"}, "ignore_eos"),
]

CHAT_CASES = [
    ({}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content"),
    ({"messages": MSG, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": MSG, "top_logprobs": 2}, "top_logprobs"),
    ({"messages": MSG, "logprobs": 1}, "logprobs"),
    ({"messages": MSG, "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": MSG, "max_completion_tokens": 99999}, "max_completion_tokens"),
    ({"messages": MSG, "max_tokens": 99999}, "max_tokens"),
    # tools imply tool_choice "auto", which needs --enable-auto-tool-choice (vLLM's 400)
    ({"messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
    ({"messages": MSG, "tools": [{"type": "retrieval"}], "tool_choice": "none"}, "tools[0].type"),
    ({"messages": MSG, "tools": [{"type": "function", "function": {}}], "tool_choice": "none"},
     "tools[0].function"),
    ({"messages": MSG, "tool_choice": "auto"}, "tool_choice"),
    ({"messages": MSG, "tool_choice": "sometimes"}, "tool_choice"),
    ({"messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ({"messages": MSG, "chat_template": "{{ messages }}"}, "chat_template"),
    ({"messages": MSG, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
     "response_format.json_schema.schema"),
    ({"messages": MSG, "response_format": {"type": "xml"}}, "response_format.type"),
    ({"messages": MSG, "temperature": -0.5}, "temperature"),
    ({"messages": [{"role": "user", "content": "word " * 3000}]}, "messages"),
]


def _assert_error(response: httpx.Response, status: int, param: str | None, code=None) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code
    return error


@pytest.fixture
async def http(dp_server):
    async with httpx.AsyncClient(base_url=dp_server.url(), timeout=60) as client:
        yield client


@pytest.mark.parametrize(("body", "param"), COMPLETION_CASES)
async def test_completion_bad_parameters(http, body, param):
    error = _assert_error(await http.post("/v1/completions", json=body), 400, param)
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize(("body", "param"), CHAT_CASES)
async def test_chat_bad_parameters(http, body, param):
    error = _assert_error(await http.post("/v1/chat/completions", json=body), 400, param)
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("raw", [b"{bad json", b"[1, 2]", b"", b'{"prompt": "a", "temperature": NaN}'])
async def test_malformed_bodies(http, raw):
    response = await http.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"


async def test_unknown_fields_are_refused_unless_null(http):
    # Issue 12: no request field is silently ignored (request_fields.py).
    response = await http.post("/v1/completions", json={"prompt": "a", "max_tokens": 2, "frobnicate": 1})
    _assert_error(response, 400, "frobnicate")
    response = await http.post("/v1/completions", json={"prompt": "a", "max_tokens": 2, "frobnicate": None})
    assert response.status_code == 200


async def test_unknown_model_is_404(http):
    for path, body in (("/v1/completions", {"prompt": "a"}), ("/v1/chat/completions", {"messages": MSG})):
        error = _assert_error(await http.post(path, json={**body, "model": "gpt-9"}), 404, "model",
                              "model_not_found")
        assert "gpt-9" in error["message"]
    _assert_error(await http.post("/tokenize", json={"model": "gpt-9", "prompt": "a"}), 404, "model")


async def test_unknown_route_and_method_are_json(http):
    _assert_error(await http.get("/v1/nothing"), 404, None, 404)
    _assert_error(await http.get("/v1/completions"), 405, None, 405)
    # an error sent before the route read the body must not wedge the keep-alive connection
    _assert_error(await http.post("/v1/nothing", json={"prompt": "a" * 5000}), 404, None, 404)
    assert (await http.get("/version")).status_code == 200


async def test_tokenize_errors(http):
    _assert_error(await http.post("/tokenize", json={}), 400, "prompt")
    _assert_error(await http.post("/tokenize", json={"prompt": "a", "messages": MSG}), 400, "prompt")
    _assert_error(await http.post("/detokenize", json={"tokens": [-1]}), 400, "tokens")
    _assert_error(await http.post("/detokenize", json={"tokens": "abc"}), 400, "tokens")


async def test_sdk_raises_typed_errors(dp_server):
    async with openai.AsyncOpenAI(base_url=dp_server.url() + "/v1", api_key="x", max_retries=0) as sdk:
        with pytest.raises(openai.BadRequestError) as info:
            await sdk.completions.create(model=MODEL_NAME, prompt="a", temperature=-1)
        assert info.value.body["param"] == "temperature"
        with pytest.raises(openai.NotFoundError):
            await sdk.chat.completions.create(model="nope", messages=MSG)


async def test_api_key_guards_all_but_the_probes(dp_server):
    """ISSUE 16: with --api-key, /tokenize, /detokenize and /metrics need the key too;
    /health and /version stay open (probes)."""
    async with httpx.AsyncClient(base_url=dp_server.url("keyed")) as http:
        body = {"prompt": "a", "max_tokens": 1}
        _assert_error(await http.post("/v1/completions", json=body), 401, None, "invalid_api_key")
        wrong = {"Authorization": "Bearer sk-wrong"}
        _assert_error(await http.post("/v1/completions", json=body, headers=wrong), 401, None)
        _assert_error(await http.get("/v1/models", headers={"Authorization": API_KEY}), 401, None)
        ok = {"Authorization": f"Bearer {API_KEY}"}
        assert (await http.post("/v1/completions", json=body, headers=ok)).status_code == 200
        for path in ("/health", "/version"):
            assert (await http.get(path)).status_code == 200, path
        _assert_error(await http.get("/metrics"), 401, None, "invalid_api_key")
        assert (await http.get("/metrics", headers=ok)).status_code == 200
        for path, body in (("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [1]})):
            _assert_error(await http.post(path, json=body), 401, None, "invalid_api_key")
            assert (await http.post(path, json=body, headers=ok)).status_code == 200, path
    async with openai.AsyncOpenAI(base_url=dp_server.url("keyed") + "/v1", api_key="bad", max_retries=0) as sdk:
        with pytest.raises(openai.AuthenticationError):
            await sdk.models.list()
    async with openai.AsyncOpenAI(base_url=dp_server.url("keyed") + "/v1", api_key=API_KEY, max_retries=0) as sdk:
        assert [m.id for m in (await sdk.models.list()).data] == [MODEL_NAME]


async def test_full_queue_is_503_with_retry_after(dp_server):
    long_body = {"prompt": [5, 6, 7], "max_tokens": 2000, "ignore_eos": True, "stream": True}
    async with httpx.AsyncClient(base_url=dp_server.url("queue1"), timeout=60) as http:
        async with http.stream("POST", "/v1/completions", json=long_body) as stream:
            assert stream.status_code == 200
            lines = stream.aiter_lines()
            assert (await lines.__anext__()).startswith("data: ")
            error = _assert_error(await http.post("/v1/completions", json={"prompt": "a"}), 503, None)
            assert error["code"] == "server_overloaded"
            response = await http.post("/v1/chat/completions", json={"messages": MSG})
            assert response.status_code == 503 and int(response.headers["Retry-After"]) >= 1
            # bad input is still a 400, not a 503
            _assert_error(await http.post("/v1/completions", json={"prompt": 5}), 400, "prompt")
        await dp_server.wait_until(lambda: dp_server.num_in_flight("queue1") == 0, "the queue1 app to be empty")
        response = await http.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
        assert response.status_code == 200

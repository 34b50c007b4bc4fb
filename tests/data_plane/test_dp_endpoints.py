"""The non-generation endpoints: tokenize / detokenize, health, version,
metrics (names, counts, per-app registries) and the OpenAPI document."""

from __future__ import annotations

import httpx
import pytest

import trillium
from support.data_plane_server import MODEL_NAME, TOOLS_TEMPLATE


@pytest.fixture
async def http(dp_server):
    async with httpx.AsyncClient(base_url=dp_server.url(), timeout=60) as client:
        yield client


async def test_tokenize_detokenize_round_trip(dp_server, http):
    text = "Once upon a time, a cat"
    response = await http.post("/tokenize", json={"prompt": text, "add_special_tokens": False})
    assert response.status_code == 200
    body = response.json()
    assert body["tokens"] == dp_server.tokenizer.encode(text, add_special_tokens=False)
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 2048
    back = await http.post("/detokenize", json={"tokens": body["tokens"], "model": MODEL_NAME})
    assert back.status_code == 200 and back.json() == {"prompt": text}

    with_bos = (await http.post("/tokenize", json={"prompt": text})).json()
    assert with_bos["tokens"] == dp_server.tokenizer.encode(text)

    long_text = "the quick brown fox " * 400  # over the inline limit: tokenized in a worker thread
    long = (await http.post("/tokenize", json={"prompt": long_text, "add_special_tokens": False})).json()
    assert long["tokens"] == dp_server.tokenizer.encode(long_text, add_special_tokens=False)

    messages = [{"role": "user", "content": "hi"}]
    chat = (await http.post("/tokenize", json={"messages": messages})).json()
    assert chat["tokens"] == dp_server.tokenizer.encode_chat(messages)


WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


async def test_tokenize_chat_fields_render_as_chat_completions_does(dp_server):
    """vLLM's TokenizeChatRequest (vllm/entrypoints/serve/tokenize/protocol.py): tools,
    chat_template_kwargs, continue_final_message and return_token_strs; the count is the
    prompt a chat completion with the same conversation and tools uses."""
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    async with httpx.AsyncClient(base_url=dp_server.url("tools-llama3_json"), timeout=60) as tools_app:
        body = {"messages": messages, "tools": [WEATHER_TOOL], "return_token_strs": True}
        reply = (await tools_app.post("/tokenize", json=body)).json()
        hf = dp_server.tokenizer.hf
        text = hf.apply_chat_template(messages, tools=[WEATHER_TOOL], chat_template=TOOLS_TEMPLATE,
                                      add_generation_prompt=True, tokenize=False)
        assert reply["tokens"] == hf.encode(text, add_special_tokens=False)
        assert reply["token_strs"] == hf.convert_ids_to_tokens(reply["tokens"])
        chat = (await tools_app.post("/v1/chat/completions", json={
            "model": MODEL_NAME, "messages": messages, "tools": [WEATHER_TOOL], "tool_choice": "none",
            "max_tokens": 1})).json()
        assert chat["usage"]["prompt_tokens"] == reply["count"]

        continued = (await tools_app.post("/tokenize", json={
            "messages": [*messages, {"role": "assistant", "content": "It is"}],
            "add_generation_prompt": False, "continue_final_message": True})).json()
        assert continued["count"] > 0 and "token_strs" not in continued

        for bad, param in [
            ({"prompt": "x", "tools": [WEATHER_TOOL]}, "tools"),
            ({"messages": messages, "continue_final_message": True}, "continue_final_message"),
            ({"messages": messages, "chat_template": "{{ 'x' }}"}, "chat_template"),
            ({"messages": messages, "tools": [{"type": "web_search"}]}, "tools[0].type"),
            ({"messages": messages, "mm_processor_kwargs": {"num_crops": 4}}, "mm_processor_kwargs"),
        ]:
            response = await tools_app.post("/tokenize", json=bad)
            assert response.status_code == 400, (bad, response.text)
            assert response.json()["error"]["param"] == param, response.text


async def test_health_and_version(http):
    response = await http.get("/health")
    assert response.status_code == 200
    assert (await http.get("/version")).json() == {"version": trillium.__version__}


async def test_metrics_exposes_engine_and_request_series(dp_server, http):
    response = await http.post("/v1/completions", json={"prompt": "a", "max_tokens": 3, "ignore_eos": True})
    assert response.status_code == 200
    text = (await http.get("/metrics")).text
    for name in (
        "trillium:num_requests_running", "trillium:num_requests_waiting", "trillium:kv_cache_usage_perc",
        "trillium:num_requests_in_flight", "trillium:request_success_total", "trillium:prompt_tokens_total",
        "trillium:generation_tokens_total", "trillium:e2e_request_latency_seconds_bucket",
        "trillium:time_to_first_token_seconds_bucket", "trillium:prefix_cache_hits_total",
    ):
        assert name in text, name
    assert f'trillium:request_success_total{{finished_reason="length",model_name="{MODEL_NAME}"}}' in text

    # the engine series are the engine's: another app on the same engine client reports the same tokens
    async with httpx.AsyncClient(base_url=dp_server.url("queue1")) as other:
        other_text = (await other.get("/metrics")).text
    assert "trillium:num_requests_running" in other_text
    assert _sample(other_text, "trillium:generation_tokens_total") == _sample(text, "trillium:generation_tokens_total") > 0


def _sample(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_openapi_lists_routes_with_schemas(http):
    document = (await http.get("/openapi.json")).json()
    assert document["openapi"].startswith("3.")
    paths = document["paths"]
    for path in ("/v1/models", "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize",
                 "/health", "/version", "/metrics"):
        assert path in paths, path
    schemas = document["components"]["schemas"]
    assert "prompt" in schemas["CompletionRequest"]["properties"]
    assert "messages" in schemas["ChatCompletionRequest"]["properties"]
    ref = paths["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    assert ref == "#/components/schemas/ChatCompletionRequest"

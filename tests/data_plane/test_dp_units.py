"""Pure pieces of the data plane, without an engine: request parsing, the
request -> SamplingParams mapping, error params, logprob wire formats."""

from __future__ import annotations

import json

import pytest

from trillium.actors.protocol.execute import PromptLogprobs, TokenLogprobs
from trillium.data_plane.errors import ApiError, from_value_error, param_of
from trillium.data_plane.logprobs import MIN_LOGPROB, CompletionLogprobs, chat_logprobs
from trillium.data_plane.protocol import ChatCompletionRequest, CompletionRequest, parse_request
from trillium.data_plane.sampling import chat_params, chat_renames, completion_params


def _parse(model, body: dict):
    return parse_request(model, json.dumps(body).encode())


def test_prompt_forms_normalize():
    assert _parse(CompletionRequest, {"prompt": "a"}).prompt == ["a"]
    assert _parse(CompletionRequest, {"prompt": ["a", "b"]}).prompt == ["a", "b"]
    assert _parse(CompletionRequest, {"prompt": [1, 2]}).prompt == [[1, 2]]
    assert _parse(CompletionRequest, {"prompt": [[1], [2, 3]]}).prompt == [[1], [2, 3]]
    with pytest.raises(ApiError) as info:
        _parse(CompletionRequest, {"prompt": [True, 2]})
    assert info.value.param == "prompt"


def test_parse_errors_name_nested_params():
    with pytest.raises(ApiError) as info:
        _parse(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}, {"role": "bot"}]})
    assert info.value.status == 400 and info.value.param == "messages[1].role"
    with pytest.raises(ApiError) as info:
        parse_request(CompletionRequest, b"{nope")
    assert info.value.param is None and "malformed JSON" in info.value.message


def test_text_parts_are_joined():
    req = _parse(ChatCompletionRequest, {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]})
    assert req.messages[0].to_template() == {"role": "user", "content": "ab"}


def test_completion_params_mapping():
    req = _parse(CompletionRequest, {
        "prompt": "a", "n": 2, "best_of": 2, "stop": "x", "logit_bias": {"7": 1.5}, "echo": True, "logprobs": 2,
        "top_k": 5, "seed": 3, "min_tokens": 1, "stop_token_ids": [4], "ignore_eos": True,
    })
    params = completion_params(req)
    assert (params.n, params.stop, params.logit_bias, params.top_k, params.seed) == (2, ("x",), {7: 1.5}, 5, 3)
    assert params.max_tokens == 16 and params.logprobs == 2 and params.prompt_logprobs == 2
    assert params.stop_token_ids == (4,) and params.ignore_eos and params.min_tokens == 1
    assert completion_params(_parse(CompletionRequest, {"prompt": "a", "max_tokens": None})).max_tokens is None


def test_chat_params_mapping():
    base = {"messages": [{"role": "user", "content": "x"}]}
    params = chat_params(_parse(ChatCompletionRequest, {**base, "max_tokens": 9, "max_completion_tokens": 4}))
    assert params.max_tokens == 4 and params.logprobs is None
    assert chat_params(_parse(ChatCompletionRequest, base)).max_tokens is None
    assert chat_params(_parse(ChatCompletionRequest, {**base, "logprobs": True})).logprobs == 0
    req = _parse(ChatCompletionRequest, {**base, "logprobs": True, "top_logprobs": 3, "max_completion_tokens": 2})
    assert chat_params(req).logprobs == 3
    assert chat_renames(req)["max_tokens"] == "max_completion_tokens"


def test_spaces_between_special_tokens_reaches_the_detokenize_spec():
    """vLLM's name and default (true) on completions and chat, SGLang's on /generate; the flag
    travels SamplingParams -> the scheduler's DetokenizeSpec (the detokenizer applies it)."""
    import numpy as np

    from trillium.actors.protocol.requests import AddRequest
    from trillium.actors.scheduler.request import Request
    from trillium.data_plane.generate_request import engine_params, parse_generate

    base = {"messages": [{"role": "user", "content": "x"}]}
    assert completion_params(_parse(CompletionRequest, {"prompt": "a"})).spaces_between_special_tokens is True
    off = {"spaces_between_special_tokens": False}
    assert completion_params(_parse(CompletionRequest, {"prompt": "a", **off})).spaces_between_special_tokens is False
    assert chat_params(_parse(ChatCompletionRequest, {**base, **off})).spaces_between_special_tokens is False
    spec = parse_generate(json.dumps({"input_ids": [1, 2], "sampling_params": off}).encode()).prompts[0]
    params = engine_params(spec, 2)
    assert params.spaces_between_special_tokens is False
    add = AddRequest("r", np.array([1, 2], np.int32), params, eos_token_ids=(), arrival_time=0.0)
    assert Request(add, arrival_seq=0, max_model_len=256).detokenize_spec().spaces_between_special_tokens is False


def test_value_errors_map_to_params():
    assert param_of(ValueError("invalid sampling parameter 'top_p': must be in (0, 1]")) == "top_p"
    assert param_of(ValueError("max_tokens: prompt (3 tokens) + ...")) == "max_tokens"
    assert param_of(ValueError("something else entirely")) is None
    error = from_value_error(ValueError("prompt: must not be empty"), {"prompt": "messages"})
    assert (error.status, error.param, error.body()["error"]["type"]) == (400, "messages", "invalid_request_error")


def _entry(token_id: int, logprob: float, tops: tuple[tuple[int, float], ...]) -> TokenLogprobs:
    return TokenLogprobs(token_id, logprob, 1, tuple(t for t, _ in tops), tuple(v for _, v in tops))


def _text(token_id: int) -> str:
    return {1: "a", 2: "bb", 3: "ccc", 4: "é"}[token_id]


def test_completion_logprobs_legacy_with_echo():
    lp = CompletionLogprobs(_text, num_top=1)
    prompt = PromptLogprobs("r", start=1, entries=(_entry(2, -0.5, ((3, -0.1),)),))
    lp.add_prompt([1, 2], prompt)
    lp.add((_entry(3, float("-inf"), ((1, -0.2),)),))
    out = lp.to_json()
    assert out["tokens"] == ["a", "bb", "ccc"]
    assert out["token_logprobs"] == [None, -0.5, MIN_LOGPROB]
    assert out["top_logprobs"] == [None, {"ccc": -0.1, "bb": -0.5}, {"a": -0.2, "ccc": MIN_LOGPROB}]
    assert out["text_offset"] == [0, 1, 3]
    assert lp.take()["tokens"] == ["a", "bb", "ccc"] and lp.take()["tokens"] == []


def test_chat_logprobs_format():
    (item,) = chat_logprobs((_entry(4, -1.0, ((4, -1.0), (1, -2.0))),), _text, num_top=1)
    assert item == {"token": "é", "logprob": -1.0, "bytes": [195, 169],
                    "top_logprobs": [{"token": "é", "logprob": -1.0, "bytes": [195, 169]}]}


class _BrokenTokenizer:
    eos_token_ids = (2,)

    def encode(self, text, add_special_tokens=True):
        raise RuntimeError("tokenizer exploded")


async def test_unexpected_errors_are_500_in_openai_shape(caplog):
    from trillium.data_plane import DataPlaneEngine, create_app

    engine = DataPlaneEngine(client=None, tokenizer=_BrokenTokenizer(), served_model_name="m",
                             max_model_len=64, vocab_size=100)
    app = create_app(engine)
    async with app.test_app() as test_app:
        response = await test_app.test_client().post("/v1/completions", json={"prompt": "a"})
        assert response.status_code == 500
        error = (await response.get_json())["error"]
        assert (error["type"], error["code"], error["param"]) == ("server_error", "internal_error", None)
        assert "exploded" not in error["message"]  # internals stay in the log
    assert any("unhandled error" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("extra", [{}, {"usage": None}])
def test_chunk_events_encode_exactly_like_event(extra):
    from trillium.data_plane.streaming import ChunkEvents, event

    header = {"id": "cmpl-1", "object": "text_completion", "created": 7, "model": "m",
              "system_fingerprint": None, "weight_version": "v\"2"}
    chunk = ChunkEvents(header, extra)
    for item in ({"index": 0, "text": "hé \"quoted\"\n", "logprobs": None, "finish_reason": None},
                 {"index": 3, "delta": {}, "logprobs": {"content": [1.5]}, "finish_reason": "stop"}):
        assert chunk(item) == event({**header, "choices": [item], **extra})

"""Pure unit tests of data_plane/rollout_fields.py and request_fields.py.

Mirrors: vllm/sampling_params.py `update_from_tokenizer` (bad words as given,
left-stripped, and with a leading space only when that is a different first
token and as many tokens), vLLM's `_base_request_id` (the X-Request-Id
header before the body's request_id), CompletionRequest.truncate_prompt_tokens
(ge=-1; -1 = the context) and `ChatCompletionResponse.prompt_logprobs`
(`list[dict[int, Logprob] | None]`, one entry per prompt token).
"""

from __future__ import annotations

import pytest
import trio

from trillium.actors.protocol.execute import PromptLogprobs, TokenLogprobs
from trillium.data_plane.errors import ApiError
from trillium.data_plane.protocol import ChatCompletionRequest, CompletionRequest, parse_request
from trillium.data_plane.rollout_fields import (
    RequestIds,
    bad_words_token_ids,
    prompt_logprobs_json,
    truncate_prompt,
)

VOCAB = {"foo": [1, 2], " foo": [3, 2], "bar": [4], " bar": [5, 6], "baz": [7], " baz": [7]}


async def encode(text: str) -> list[int]:
    return VOCAB.get(text, [])


def words(*items) -> tuple:
    return trio.run(bad_words_token_ids, list(items), encode)


def test_bad_words_take_the_spaced_form_only_when_it_is_another_word_of_the_same_length():
    assert words("foo") == ((1, 2), (3, 2))
    assert words("  bar") == ((4,),)  # " bar" has another length
    assert words("baz", "baz") == ((7,),)  # same first token; duplicates dropped
    assert words() == ()


@pytest.mark.parametrize("bad", ["", "qux"])
def test_bad_words_that_tokenize_to_nothing_are_a_400(bad):
    with pytest.raises(ApiError) as info:
        words(bad)
    assert info.value.param == "bad_words"


def test_truncation():
    ids = list(range(10))
    assert truncate_prompt(ids, None, None, 64) == ids
    assert truncate_prompt(ids, 3, None, 64) == [7, 8, 9]
    assert truncate_prompt(ids, 3, "left", 64) == [7, 8, 9]
    assert truncate_prompt(ids, 3, "right", 64) == [0, 1, 2]
    assert truncate_prompt(ids, -1, None, 4) == [6, 7, 8, 9]
    assert truncate_prompt(ids, 20, None, 64) == ids
    with pytest.raises(ApiError):
        truncate_prompt(ids, 65, None, 64)


def test_request_ids_header_first_and_engine_ids_unique():
    ids = RequestIds("cmpl", {"X-Request-Id": "h"}, "b")
    assert (ids.base, ids.response_id) == ("h", "cmpl-h")
    again = RequestIds("cmpl", {"X-Request-Id": "h"}, None)
    assert again.response_id == ids.response_id and again.engine_id != ids.engine_id
    body = RequestIds("chatcmpl", {}, "b")
    assert body.response_id == "chatcmpl-b"
    fresh = RequestIds("cmpl", {}, None)
    assert fresh.engine_id == fresh.response_id == f"cmpl-{fresh.base}"


def test_prompt_logprobs_layout():
    entry = TokenLogprobs(token_id=9, logprob=-3.0, rank=4, top_token_ids=(5, 6),
                          top_logprobs=(-0.5, float("-inf")))
    out = prompt_logprobs_json([1, 9], PromptLogprobs("r", 1, (entry,)), 2, lambda t: f"<{t}>")
    assert out[0] is None
    assert out[1] == {9: {"logprob": -3.0, "rank": 4, "decoded_token": "<9>"},
                      5: {"logprob": -0.5, "rank": 1, "decoded_token": "<5>"},
                      6: {"logprob": -9999.0, "rank": 2, "decoded_token": "<6>"}}


@pytest.mark.parametrize(("model", "body", "param"), [
    (CompletionRequest, b'{"prompt": "a", "n_best": true}', "n_best"),
    (CompletionRequest, b'{"prompt": "a", "use_beam_search": true}', "use_beam_search"),
    (CompletionRequest, b'{"prompt": "a", "length_penalty": true}', "length_penalty"),
    (ChatCompletionRequest, b'{"messages": [{"role": "user", "content": "x", "audio": {"id": "1"}}]}',
     "messages[0].audio"),
])
def test_undeclared_fields_that_ask_for_something_are_a_400(model, body, param):
    with pytest.raises(ApiError) as info:
        parse_request(model, body)
    assert info.value.param == param


def test_undeclared_fields_that_ask_for_nothing_pass():
    parse_request(CompletionRequest, b'{"prompt": "a", "use_beam_search": false, "length_penalty": 1, '
                                     b'"guided_json": null, "vllm_xargs": {}, "response_format": {"type": "text"}}')

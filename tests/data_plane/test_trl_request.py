"""Unit tests of trillium.data_plane.trl_request: TRL vllm-serve's /generate/ body and logprob rows.

The shapes mirror huggingface/trl (commit f2cd5771): `GenerateRequest` and the generation_kwargs
merge in trl/scripts/vllm_serve.py, `extract_logprobs` in trl/generation/vllm_generation.py.
"""

from __future__ import annotations

import json

import pytest

from trillium.actors.protocol.execute import TokenLogprobs
from trillium.data_plane.errors import ApiError
from trillium.data_plane.protocol import parse_request
from trillium.data_plane.trl_request import TrlGenerateRequest, logprob_row, sampling_params


def parse(body: dict) -> TrlGenerateRequest:
    return parse_request(TrlGenerateRequest, json.dumps(body).encode())


def test_defaults_are_trls_and_generation_kwargs_win():
    params = sampling_params(parse({"prompts": ["a"]}))
    assert (params.n, params.temperature, params.top_k, params.max_tokens, params.logprobs) == (1, 1.0, -1, 16, 0)
    params = sampling_params(parse({"prompts": [[1, 2]], "max_tokens": 8, "generation_kwargs": {
        "max_tokens": 3, "seed": 5, "stop": "x", "logit_bias": {"7": 1.0}, "frequency_penalty": 0.5}}))
    assert (params.max_tokens, params.seed, params.stop, params.logit_bias) == (3, 5, ("x",), {7: 1.0})
    assert params.frequency_penalty == 0.5
    assert sampling_params(parse({"prompts": ["a"], "generation_kwargs": {"max_tokens": None}})).max_tokens is None


@pytest.mark.parametrize(("body", "param"), [
    ({"prompts": []}, "prompts"),
    ({"prompts": ["a"], "generation_kwargs": {"temperature": None}}, "generation_kwargs.temperature"),
    ({"prompts": ["a"], "generation_kwargs": {"use_beam_search": True}}, "generation_kwargs.use_beam_search"),
    ({"prompts": ["a"], "images": [None, None]}, "images"),
    ({"prompts": ["a"], "frobnicate": 1}, "frobnicate"),
])
def test_bad_bodies_are_400_naming_the_field(body, param):
    with pytest.raises(ApiError) as info:
        sampling_params(parse(body))
    assert info.value.status == 400 and info.value.param is not None and info.value.param.startswith(param)


def test_logprob_rows_put_the_sampled_token_last_when_outside_the_top():
    inside = TokenLogprobs(token_id=4, logprob=-0.5, rank=2, top_token_ids=(9, 4), top_logprobs=(-0.2, -0.5))
    assert logprob_row(inside, 2) == ([-0.2, -0.5], [9, 4])
    outside = TokenLogprobs(token_id=3, logprob=-4.0, rank=7, top_token_ids=(9, 4), top_logprobs=(-0.2, -0.5))
    assert logprob_row(outside, 2) == ([-0.2, -0.5, -4.0], [9, 4, 3])
    assert logprob_row(outside, 0) == ([-4.0], [3])

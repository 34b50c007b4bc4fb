"""RequestLimits and admission counted in engine requests, as pure units (the live
cases are tests/reliability/test_bounds.py). ISSUE 16: a list of 100 prompts x n=50
made 5,000 engine requests under --max-queued-requests 4."""

from __future__ import annotations

import pytest

from trillium.data_plane.errors import ApiError
from trillium.data_plane.generation import Choice, Generation, InflightRequests
from trillium.data_plane.limits import RequestLimits, default_max_queued_requests, num_engine_requests
from trillium.sampling_params import SamplingParams


class _Stream:
    def __init__(self) -> None:
        self.finished = False


def _generation(num_choices: int) -> Generation:
    generation = Generation(client=None, num_engine_requests=num_choices)
    generation.choices = [Choice(i, 0, _Stream(), 0.0) for i in range(num_choices)]
    return generation


def test_admission_charges_prompts_times_n_and_frees_per_choice():
    inflight = InflightRequests(limit=4)
    first = _generation(3)
    inflight.admit(first)
    with pytest.raises(ApiError) as info:
        inflight.admit(_generation(2))  # 3 + 2 > 4
    assert info.value.status == 503
    first.choices[0].stream.finished = True  # one choice done: 2 + 2 fits
    inflight.admit(_generation(2))
    assert inflight.num_engine_requests() == 4 and inflight.count() == 2
    with pytest.raises(ApiError) as info:
        InflightRequests(limit=4).admit(_generation(5))  # never fits: a 400, not a retry
    assert info.value.status == 400 and "--max-queued-requests" in info.value.message


def test_caps_name_the_field_and_the_flag():
    limits = RequestLimits(max_n=2, max_stop_strings=1, max_stop_string_chars=3, max_logit_bias=1,
                           max_prompts_per_request=2).for_model(100)
    assert limits.max_prompt_chars == 1600
    limits.check_params(SamplingParams(n=2, stop=("abc",), logit_bias={1: 1.0}))
    cases = [
        (dict(n=3), "n", "--max-n"), (dict(stop=("a", "b")), "stop", "--max-stop-strings"),
        (dict(stop=("abcd",)), "stop", "--max-stop-string-chars"),
        (dict(logit_bias={1: 1.0, 2: 1.0}), "logit_bias", "--max-logit-bias"),
    ]
    for kwargs, param, flag in cases:
        with pytest.raises(ApiError) as info:
            limits.check_params(SamplingParams(**kwargs), "sampling_params.")
        assert info.value.param == f"sampling_params.{param}" and flag in info.value.message
    with pytest.raises(ApiError, match="--max-prompts-per-request"):
        limits.check_num_prompts(3)
    with pytest.raises(ApiError, match="--max-prompt-chars"):
        limits.check_text("x" * 1601)
    assert num_engine_requests([SamplingParams(n=3), SamplingParams(n=2)]) == 5
    assert default_max_queued_requests(max_num_seqs=64, num_kv_blocks=10) == 40
    with pytest.raises(ValueError):
        RequestLimits(max_n=129)

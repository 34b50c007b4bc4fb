"""Checks every request passes before it reaches the engine (offline API and HTTP alike).

`check_request` raises ValueError naming the bad parameter; it returns the
sampling params with `max_tokens` filled in when the caller left it open.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from trillium.sampling_params import SamplingParams


def check_request(
    prompt_token_ids: Sequence[int], params: SamplingParams, *, vocab_size: int, max_model_len: int
) -> SamplingParams:
    if not prompt_token_ids:
        raise ValueError("prompt: must not be empty")
    num_prompt = len(prompt_token_ids)
    # WHY the length first: a list of millions of ids is refused without walking it.
    if num_prompt >= max_model_len:
        raise ValueError(
            f"prompt: {num_prompt} tokens do not fit the model's context of {max_model_len} "
            "(at least one generated token must fit)"
        )
    if any((not isinstance(t, int)) or isinstance(t, bool) or t < 0 or t >= vocab_size for t in prompt_token_ids):
        raise ValueError(f"prompt_token_ids: token ids must be integers in [0, {vocab_size})")
    params.validate(vocab_size)
    if params.max_tokens is None:
        return attrs.evolve(params, max_tokens=max_model_len - num_prompt)
    if num_prompt + params.max_tokens > max_model_len:
        raise ValueError(
            f"max_tokens: prompt ({num_prompt} tokens) + max_tokens ({params.max_tokens}) "
            f"exceeds the model's context of {max_model_len}"
        )
    return params

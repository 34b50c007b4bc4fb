"""Request bodies -> engine SamplingParams, with the checks the engine relies on.

Pure functions (no I/O): `completion_params` and `chat_params` turn a parsed
request into `SamplingParams` or raise a 400 naming the wire parameter;
`check_prompt` runs `trillium.validation.check_request` for one tokenized
prompt (context length, token ids, every sampling range) and returns the
params with `max_tokens` filled in when the client left it open.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from trillium.data_plane.errors import bad_request, from_value_error
from trillium.data_plane.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest
from trillium.generation_defaults import NO_DEFAULTS, SamplingDefaults
from trillium.data_plane.structured_fields import (GUIDED_FIELDS, from_guided_fields, from_response_format,
                                                   from_vllm_object, pick_one)
from trillium.sampling_params import SamplingParams
from trillium.validation import check_request

_INT64_MAX = 2**63 - 1
_OPTIONAL_FLOATS = ("temperature", "top_p", "presence_penalty", "frequency_penalty", "min_p", "repetition_penalty")


def _logit_bias(raw: dict[str, float] | None) -> dict[int, float] | None:
    if raw is None:
        return None
    bias = {}
    for key, value in raw.items():
        try:
            bias[int(key)] = value
        except ValueError:
            raise bad_request(f"logit_bias: keys must be token ids, got {key!r}", "logit_bias") from None
    return bias


def _check_max_logprobs(name: str, value: int | None, max_logprobs: int) -> None:
    # vLLM's --max-logprobs: asking for more is a 400 naming the field.
    if value is not None and value > max_logprobs:
        raise bad_request(f"{name}: at most {max_logprobs} (the server's --max-logprobs), got {value}", name)


def _common(req: SamplingRequest, defaults: SamplingDefaults) -> dict:
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options: only allowed when stream is true", "stream_options")
    if req.stream_options is not None and req.stream_options.continuous_usage_stats:
        raise bad_request("stream_options.continuous_usage_stats: is not supported",
                          "stream_options.continuous_usage_stats")
    if req.prompt_logprobs is not None and req.stream:
        # vLLM: prompt logprobs are never streamed, so asking for them is an error.
        raise bad_request("prompt_logprobs: not available when stream is true", "prompt_logprobs")
    if req.seed is not None and req.seed + req.n - 1 > _INT64_MAX:
        raise bad_request("seed: seed + n - 1 must fit in int64", "seed")
    kwargs = dict(
        n=req.n,
        stop=req.stop or (),
        seed=req.seed,
        logit_bias=_logit_bias(req.logit_bias),
        min_tokens=req.min_tokens or 0,
        ignore_eos=bool(req.ignore_eos),
        skip_special_tokens=req.skip_special_tokens is not False,
        spaces_between_special_tokens=req.spaces_between_special_tokens is not False,
        include_stop_str_in_output=bool(req.include_stop_str_in_output),
        stop_token_ids=tuple(req.stop_token_ids or ()),
        allowed_token_ids=None if req.allowed_token_ids is None else tuple(req.allowed_token_ids),
        structured_outputs=_structured_outputs(req),
        speculative=req.speculative is not False,
    )
    if req.top_k is not None:
        kwargs["top_k"] = req.top_k
    for name in _OPTIONAL_FLOATS:
        value = getattr(req, name)
        if value is not None:
            kwargs[name] = value
    return defaults.fill(kwargs)  # generation_config.json's defaults where the request left a field unset


def _structured_outputs(req: SamplingRequest):
    """The request's one structured-output constraint (OpenAI's, vLLM's or vLLM's older fields)."""
    guided_names = (*GUIDED_FIELDS, "guided_whitespace_pattern", "guided_decoding_backend")
    guided = {name: getattr(req, name) for name in guided_names}
    guided_field = next((name for name in GUIDED_FIELDS if guided[name] is not None), "guided_json")
    return pick_one({
        "response_format": from_response_format(req.response_format),
        "structured_outputs": from_vllm_object(req.structured_outputs),
        guided_field: from_guided_fields(guided),
    })


def completion_params(req: CompletionRequest, defaults: SamplingDefaults = NO_DEFAULTS,
                      max_logprobs: int = 20) -> SamplingParams:
    if req.suffix:
        raise bad_request("suffix: is not supported", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request(f"best_of: only best_of == n ({req.n}) is supported, got {req.best_of}", "best_of")
    # vLLM: an explicit prompt_logprobs wins; echo alone asks for `logprobs` of the prompt.
    prompt_logprobs = req.prompt_logprobs
    if prompt_logprobs is None and req.echo:
        prompt_logprobs = req.logprobs
    _check_max_logprobs("logprobs", req.logprobs, max_logprobs)
    _check_max_logprobs("prompt_logprobs", req.prompt_logprobs, max_logprobs)
    return SamplingParams(
        **_common(req, defaults),
        max_tokens=req.max_tokens if req.max_tokens is None else defaults.max_tokens(req.max_tokens),
        logprobs=req.logprobs,
        prompt_logprobs=prompt_logprobs,
    )


def chat_params(req: ChatCompletionRequest, defaults: SamplingDefaults = NO_DEFAULTS,
                max_logprobs: int = 20) -> SamplingParams:
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs: requires logprobs to be true", "top_logprobs")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    _check_max_logprobs("top_logprobs", req.top_logprobs, max_logprobs)
    _check_max_logprobs("prompt_logprobs", req.prompt_logprobs, max_logprobs)
    return SamplingParams(
        **_common(req, defaults),
        max_tokens=max_tokens if max_tokens is None else defaults.max_tokens(max_tokens),
        logprobs=(req.top_logprobs or 0) if req.logprobs else None,
        prompt_logprobs=req.prompt_logprobs,
        thinking_token_budget=req.thinking_token_budget,
    )


def chat_renames(req: ChatCompletionRequest) -> dict[str, str]:
    """Engine parameter names -> the chat request's wire names, for error params."""
    renames = {"prompt": "messages", "prompt_token_ids": "messages", "logprobs": "top_logprobs"}
    if req.max_completion_tokens is not None:
        renames["max_tokens"] = "max_completion_tokens"
    return renames


COMPLETION_RENAMES = {"prompt_token_ids": "prompt", "prompt_logprobs": "logprobs"}


def completion_renames(req: CompletionRequest) -> dict[str, str]:
    """COMPLETION_RENAMES, but prompt_logprobs is its own name when the client sent it."""
    if req.prompt_logprobs is None:
        return COMPLETION_RENAMES
    return {"prompt_token_ids": "prompt"}


def check_priority(priority: int, scheduling_policy: str) -> None:
    """vLLM: a priority other than 0 is an error unless the engine schedules by priority."""
    if priority != 0 and scheduling_policy != "priority":
        raise bad_request(f"priority: {priority} needs the priority scheduling policy "
                          f"(--scheduling-policy priority); this server uses {scheduling_policy!r}", "priority")


def check_prompt(
    prompt_token_ids: Sequence[int],
    params: SamplingParams,
    *,
    vocab_size: int,
    max_model_len: int,
    renames: dict[str, str],
    default_max_tokens: int | None = None,
) -> SamplingParams:
    """`default_max_tokens` (generation_config.json's max_new_tokens): the cap of a request
    without max_tokens, within what the context leaves (vLLM's get_max_tokens)."""
    if params.max_tokens is None and default_max_tokens is not None and len(prompt_token_ids) < max_model_len:
        params = attrs.evolve(params, max_tokens=min(default_max_tokens, max_model_len - len(prompt_token_ids)))
    try:
        return check_request(prompt_token_ids, params, vocab_size=vocab_size, max_model_len=max_model_len)
    except ValueError as exc:
        raise from_value_error(exc, renames) from None


__all__ = ["chat_params", "chat_renames", "check_priority", "check_prompt", "completion_params", "completion_renames",
           "COMPLETION_RENAMES"]

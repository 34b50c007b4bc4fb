"""SGLang's native `/generate` body -> one engine request per prompt (pure functions, no I/O).

The body is SGLang's `GenerateReqInput` (sglang python/sglang/srt/managers/io_struct.py)
and its `sampling_params` SGLang's `SamplingParams`
(python/sglang/srt/sampling/sampling_params.py), with SGLang's names and defaults:

    text | input_ids            one prompt, or a batch (a list of strings / of token-id lists)
    sampling_params            a dict, or one dict per prompt (all with the same `n`)
    return_logprob, logprob_start_len, top_logprobs_num   a value, or one per prompt
    return_text_in_logprobs, stream
    lora_path                  a loaded adapter's name (a string, or one per prompt)
    rid                        a string (a batch: the prefix of `<rid>_<i>`), or one per prompt

`parse_generate(body)` returns a `GenerateRequest` or raises a 400 naming the
field. A field SGLang has and Trillium does not implement is accepted only with
SGLang's default value (it then asks for nothing); any other value is a 400
naming it, and a field SGLang does not have is a 400 too. `engine_params`
turns one prompt's sampling params into the engine's `SamplingParams`;
`check_generate_prompt` runs the engine's checks for a tokenized prompt, with
errors in the wire's names.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from typing import Annotated, Any

import attrs
import pydantic
from pydantic import BaseModel, ConfigDict, Field, field_validator

from trillium.data_plane.errors import bad_request, param_of
from trillium.data_plane.protocol import MAX_N, Int64
from trillium.generation_defaults import NO_DEFAULTS, SamplingDefaults
from trillium.data_plane.structured_fields import from_sglang
from trillium.sampling_params import SamplingParams
from trillium.validation import check_request

# SGLang's GenerateReqInput fields Trillium does not implement, with the default
# under which they ask for nothing (None stands for "null or absent" too).
_UNSUPPORTED_FIELDS: dict[str, Any] = {
    "session_id": None, "input_embeds": None, "image_data": None, "video_data": None, "audio_data": None,
    "mm_hashes": None, "mm_content_hashes": None, "use_audio_in_video": False, "video_config": None,
    "token_ids_logprob": None, "return_sampling_mask": False, "return_flat_raw_top_logprobs": False,
    "return_flat_raw_top_logprobs_b64": False, "log_metrics": True, "return_hidden_states": False,
    "return_routed_experts": False, "routed_experts_start_len": 0, "return_indexer_topk": False,
    "modalities": None, "session_params": None, "lora_id": None, "custom_logit_processor": None,
    "positional_embed_overrides": None, "bootstrap_host": None, "bootstrap_port": None,
    "bootstrap_room": None, "bootstrap_pair_key": None, "decode_tp_size": None, "routed_dp_rank": None,
    "data_parallel_rank": None, "disagg_prefill_dp_rank": None, "kv_router_hint": None, "routing_key": None,
    "conversation_id": None, "background": False, "require_reasoning": False, "max_thinking_tokens": None,
    "priority": None, "extra_key": None, "no_logs": False, "custom_labels": None, "return_bytes": False,
    "return_entropy": False, "return_prompt_token_ids": False, "external_trace_header": None,
    "received_time": None, "cache_salt": None,
}
_UNSUPPORTED_SAMPLING: dict[str, Any] = {
    "stop_regex": None, "custom_params": None,
    "logit_bias": None, "sampling_seed": None,
}
_PER_PROMPT = ("return_logprob", "logprob_start_len", "top_logprobs_num")
_KNOWN_FIELDS = frozenset({"text", "input_ids", "sampling_params", *_PER_PROMPT, "return_text_in_logprobs",
                           "stream", "lora_path", "rid"})


class GenerateSamplingParams(BaseModel):
    """SGLang's sampling_params, the ones Trillium implements. null means SGLang's default
    (max_new_tokens null: up to the end of the context)."""

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)

    max_new_tokens: Int64 | None = 128
    min_new_tokens: Int64 | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: Any = None
    stop_token_ids: list[Int64] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    # Tokens a streamed chunk waits for (SGLang's per-request --stream-interval; at least the server's)
    stream_interval: Int64 | None = None  # SamplingParams.validate: 1 to MAX_STREAM_INTERVAL
    # Structured outputs (data_plane/structured_fields.py `from_sglang`)
    json_schema: str | dict[str, Any] | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | dict[str, Any] | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: Any) -> tuple[str, ...]:
        if value is None:
            return ()
        if isinstance(value, str):
            return (value,)
        if isinstance(value, list) and all(isinstance(s, str) for s in value):
            return tuple(value)
        raise ValueError("must be a string or a list of strings")


@attrs.frozen
class PromptSpec:
    """One prompt of the request, before tokenization."""

    text: str | None  # None when given as token ids
    token_ids: list[int] | None
    sampling: GenerateSamplingParams
    rid: str  # the engine id of its request (n > 1: its samples are `<rid>-<i>`)
    lora_path: str | None
    return_logprob: bool
    logprob_start_len: int  # -1: from the last prompt token (SGLang's default)
    top_logprobs_num: int


@attrs.frozen
class GenerateRequest:
    prompts: tuple[PromptSpec, ...]
    n: int
    is_single: bool  # one prompt and n == 1: the response is an object, else a list (SGLang)
    stream: bool
    return_text_in_logprobs: bool
    prompt_field: str  # "text" or "input_ids", for error params


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _reject_unsupported(obj: dict, supported: dict[str, Any], known: frozenset[str], prefix: str) -> None:
    for name, value in obj.items():
        if name in known:
            continue
        wire = prefix + name
        if name not in supported:
            raise bad_request(f"{wire}: unknown field", wire)
        default = supported[name]
        if value is None or (type(value) is type(default) and value == default):
            continue  # SGLang's default: asks for nothing
        raise bad_request(f"{wire}: not supported by Trillium's /generate (only its default, "
                          f"{json.dumps(default)}, is accepted)", wire)


def _prompts(body: dict) -> tuple[list[str] | None, list[list[int]] | None, bool, str]:
    """(texts, token id lists, given as one prompt, the field's name)."""
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise bad_request("text: give exactly one of 'text' or 'input_ids'", "text")
    if text is not None:
        if isinstance(text, str):
            return [text], None, True, "text"
        if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            return list(text), None, False, "text"
        raise bad_request("text: must be a string or a non-empty list of strings", "text")
    if isinstance(ids, list) and ids and all(_is_int(t) for t in ids):
        return None, [list(ids)], True, "input_ids"
    if (isinstance(ids, list) and ids
            and all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in ids)):
        return None, [list(p) for p in ids], False, "input_ids"
    raise bad_request("input_ids: must be a non-empty list of token ids or of token-id lists", "input_ids")


def _per_prompt(body: dict, name: str, num: int, ok, default: Any) -> list[Any]:
    """A field given once or once per prompt (a list of `num`), as one value per prompt."""
    value = body.get(name)
    if value is None:
        return [default] * num
    if isinstance(value, list):
        if len(value) != num:
            raise bad_request(f"{name}: a list needs one value per prompt ({num}), got {len(value)}", name)
        values = value
    else:
        values = [value] * num
    for v in values:
        if v is not None and not ok(v):
            raise bad_request(f"{name}: invalid value {v!r}", name)
    return [default if v is None else v for v in values]


def _sampling(body: dict, num: int) -> list[GenerateSamplingParams]:
    raw = body.get("sampling_params")
    items = [{}] * num if raw is None else [raw] * num if isinstance(raw, dict) else raw
    if not isinstance(items, list) or len(items) != num or not all(isinstance(i, dict) for i in items):
        raise bad_request(f"sampling_params: must be an object or a list of one object per prompt ({num})",
                          "sampling_params")
    parsed = []
    for index, item in enumerate(items):
        prefix = "sampling_params." if isinstance(raw, dict) else f"sampling_params[{index}]."
        try:
            sp = GenerateSamplingParams.model_validate(item)
        except pydantic.ValidationError as exc:
            first = exc.errors(include_url=False)[0]
            param = prefix + ".".join(str(p) for p in first["loc"])
            raise bad_request(f"{param}: {first['msg'].removeprefix('Value error, ')}", param) from None
        _reject_unsupported(sp.model_extra or {}, _UNSUPPORTED_SAMPLING, frozenset(), prefix)
        parsed.append(sp)
    if len({sp.n or 1 for sp in parsed}) > 1:
        raise bad_request("sampling_params: n must be the same for every prompt", "sampling_params")
    return parsed


def _rids(value: Any, num: int, single: bool) -> list[str]:
    if value is None:
        return [uuid.uuid4().hex for _ in range(num)]
    if isinstance(value, str) and value:
        return [value] if single else [f"{value}_{i}" for i in range(num)]
    if isinstance(value, list) and len(value) == num and all(isinstance(r, str) and r for r in value):
        if len(set(value)) != num:
            raise bad_request("rid: duplicate request ids in the batch", "rid")
        return list(value)
    raise bad_request(f"rid: must be a non-empty string or a list of {num} distinct strings", "rid")


def parse_generate(body: bytes) -> GenerateRequest:
    try:
        obj = json.loads(body)
    except ValueError as exc:
        raise bad_request(f"malformed JSON body: {exc}") from None
    if not isinstance(obj, dict):
        raise bad_request("the request body must be a JSON object")
    _reject_unsupported(obj, _UNSUPPORTED_FIELDS, _KNOWN_FIELDS, "")
    texts, token_ids, single, prompt_field = _prompts(obj)
    num = len(texts if texts is not None else token_ids)
    sampling = _sampling(obj, num)
    return_logprob = _per_prompt(obj, "return_logprob", num, lambda v: isinstance(v, bool), False)
    start_len = _per_prompt(obj, "logprob_start_len", num, lambda v: _is_int(v) and v >= -1, -1)
    top_num = _per_prompt(obj, "top_logprobs_num", num, lambda v: _is_int(v) and v >= 0, 0)
    lora = _per_prompt(obj, "lora_path", num, lambda v: isinstance(v, str), None)
    for name in ("return_text_in_logprobs", "stream"):
        if obj.get(name) is not None and not isinstance(obj[name], bool):
            raise bad_request(f"{name}: must be a boolean", name)
    n = sampling[0].n or 1
    rids = _rids(obj.get("rid"), num, single)
    prompts = tuple(
        PromptSpec(
            text=None if texts is None else texts[i], token_ids=None if token_ids is None else token_ids[i],
            sampling=sampling[i], rid=rids[i], lora_path=lora[i], return_logprob=return_logprob[i],
            logprob_start_len=start_len[i], top_logprobs_num=top_num[i],
        )
        for i in range(num)
    )
    return GenerateRequest(prompts=prompts, n=n, is_single=single and n == 1, stream=bool(obj.get("stream")),
                           return_text_in_logprobs=bool(obj.get("return_text_in_logprobs")),
                           prompt_field=prompt_field)


def engine_params(spec: PromptSpec, num_prompt_tokens: int,
                  defaults: SamplingDefaults = NO_DEFAULTS) -> SamplingParams:
    """The engine's SamplingParams for one prompt (prompt logprobs only where
    `logprob_start_len` asks for positions before the last prompt token);
    `defaults`: generation_config.json's, for the sampling fields left null."""
    sp = spec.sampling
    kwargs: dict[str, Any] = dict(
        n=sp.n or 1,
        max_tokens=sp.max_new_tokens,
        min_tokens=sp.min_new_tokens or 0,
        stop=sp.stop or (),
        stop_token_ids=tuple(sp.stop_token_ids or ()),
        ignore_eos=bool(sp.ignore_eos),
        skip_special_tokens=sp.skip_special_tokens is not False,
        spaces_between_special_tokens=sp.spaces_between_special_tokens is not False,
        include_stop_str_in_output=bool(sp.no_stop_trim),
        stream_interval=sp.stream_interval,
        structured_outputs=from_sglang(
            {"json_schema": sp.json_schema, "regex": sp.regex, "ebnf": sp.ebnf, "structural_tag": sp.structural_tag}
        ),
    )
    for name in ("top_k", "temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty",
                 "repetition_penalty"):
        value = getattr(sp, name)
        if value is not None:
            kwargs[name] = value
    kwargs = defaults.fill(kwargs)
    if spec.return_logprob:
        kwargs["logprobs"] = spec.top_logprobs_num
        if 0 <= spec.logprob_start_len < num_prompt_tokens - 1:
            kwargs["prompt_logprobs"] = spec.top_logprobs_num
    return SamplingParams(**kwargs)


# Engine parameter names -> the wire's, in messages and error params.
_RENAMES = (("max_tokens", "max_new_tokens"), ("min_tokens", "min_new_tokens"),
            ("include_stop_str_in_output", "no_stop_trim"), ("prompt_logprobs", "top_logprobs_num"),
            ("logprobs", "top_logprobs_num"))
_TOP_LEVEL = ("top_logprobs_num",)


def _wire_error(exc: ValueError, prompt_field: str):
    """The ApiError for an engine check's ValueError, in the wire's names."""
    message, name = str(exc), param_of(exc)
    if name in ("prompt", "prompt_token_ids"):
        return bad_request(prompt_field + message[len(name):], prompt_field)
    for engine_name, wire_name in _RENAMES:
        message = re.sub(rf"\b{engine_name}\b", wire_name, message)
        name = wire_name if name == engine_name else name
    if name is None:
        return bad_request(message)
    return bad_request(message, name if name in _TOP_LEVEL else f"sampling_params.{name}")


def check_generate_prompt(
    token_ids: Sequence[int], spec: PromptSpec, *, prompt_field: str, vocab_size: int, max_model_len: int,
    defaults: SamplingDefaults = NO_DEFAULTS, max_logprobs: int = 20,
) -> SamplingParams:
    """The engine's params for one tokenized prompt, checked; a 400 in the wire's names."""
    if spec.return_logprob and spec.logprob_start_len >= len(token_ids):
        raise bad_request(f"logprob_start_len: ({spec.logprob_start_len}) is not below the number of prompt "
                          f"tokens ({len(token_ids)})", "logprob_start_len")
    if spec.return_logprob and spec.top_logprobs_num > max_logprobs:
        raise bad_request(f"top_logprobs_num: at most {max_logprobs} (the server's --max-logprobs), got "
                          f"{spec.top_logprobs_num}", "top_logprobs_num")
    try:
        return check_request(token_ids, engine_params(spec, len(token_ids), defaults), vocab_size=vocab_size,
                             max_model_len=max_model_len)
    except ValueError as exc:
        raise _wire_error(exc, prompt_field) from None


__all__ = ["GenerateRequest", "GenerateSamplingParams", "PromptSpec", "check_generate_prompt", "engine_params",
           "parse_generate"]

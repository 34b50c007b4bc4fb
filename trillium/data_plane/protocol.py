"""Pydantic models of the data plane's request bodies (OpenAI names, vLLM extras).

Strict types (a string is not a number, `1` is not `true`), finite floats,
integers within int64 (everything here crosses msgpack), and no field
silently ignored: a field a model does not declare is a 400 naming it unless
its value asks for nothing (null, or the "off" value of a vLLM / OpenAI field
Trillium lacks; request_fields.py). Fields that OpenAI types as
unions (`prompt`, `stop`, message `content`) are validated by hand so a
wrong value reports the field itself as `param`, not a union member.

`parse_request(model, body)` turns malformed JSON or a validation error
into a 400 `ApiError` naming the parameter.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, field_validator

from trillium.data_plane.errors import bad_request
from trillium.data_plane.request_fields import CHAT_OFF_VALUES, COMMON_OFF_VALUES, refuse_unimplemented

Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
MAX_N = 128  # OpenAI's limit on choices per request

_TOKEN_IDS_SCHEMA = {"type": "array", "items": {"type": "integer"}}
_PROMPT_SCHEMA = WithJsonSchema(
    {
        "anyOf": [
            {"type": "string"},
            {"type": "array", "items": {"type": "string"}},
            _TOKEN_IDS_SCHEMA,
            {"type": "array", "items": _TOKEN_IDS_SCHEMA},
        ]
    }
)
_STOP_SCHEMA = WithJsonSchema(
    {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}, {"type": "null"}]}
)
_CONTENT_SCHEMA = WithJsonSchema(
    {
        "anyOf": [
            {"type": "string"},
            {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
                    "required": ["type", "text"],
                },
            },
            {"type": "null"},
        ]
    }
)


class _Body(BaseModel):
    # WHY extra="allow": undeclared fields are kept aside (model_extra) so that
    # refuse_unimplemented can name them (a 400 unless they ask for nothing).
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)
    # Undeclared fields accepted with these values (request_fields.py).
    off_values: ClassVar[dict[str, tuple[Any, ...]]] = {}


class StreamOptions(_Body):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return tuple(value)
    raise ValueError("must be a string or a list of strings")


class SamplingRequest(_Body):
    """Fields completions and chat share."""

    model: str | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: Annotated[Any, _STOP_SCHEMA] = None
    seed: Int64 | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # vLLM extras
    top_k: Int64 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: Int64 | None = None
    ignore_eos: bool | None = False
    skip_special_tokens: bool | None = True
    spaces_between_special_tokens: bool | None = True
    include_stop_str_in_output: bool | None = False
    priority: Int64 | None = 0
    stop_token_ids: list[Int64] | None = None
    # vLLM's rollout fields (trillium/data_plane/rollout_fields.py)
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    prompt_logprobs: Int64 | None = None
    allowed_token_ids: list[Int64] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=2**63 - 1)] | None = None
    truncation_side: Literal["left", "right"] | None = None
    cache_salt: Annotated[str, Field(min_length=1, max_length=1024)] | None = None
    request_id: str | None = None
    add_special_tokens: bool | None = None  # default: True for a completion prompt, False for chat
    speculative: bool | None = None  # Trillium: false opts this request out of speculative decoding
    # Structured outputs, every way clients send them (data_plane/structured_fields.py)
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structural_tag: str | dict[str, Any] | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None
    # Informational (request_fields.INFORMATIONAL_FIELDS): accepted, never acted on.
    metadata: dict[str, Any] | None = None
    session_id: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: Any) -> tuple[str, ...]:
        return _check_stop(value)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingRequest):
    """POST /v1/completions. `prompt` is normalized to a list of str | list[int]."""

    off_values: ClassVar[dict[str, tuple[Any, ...]]] = dict(COMMON_OFF_VALUES)

    prompt: Annotated[Any, _PROMPT_SCHEMA]
    suffix: str | None = None
    echo: bool | None = False
    best_of: Int64 | None = None
    logprobs: Int64 | None = None
    max_tokens: Int64 | None = 16

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value: Any) -> list[str | list[int]]:
        if isinstance(value, str):
            return [value]
        if not isinstance(value, list) or not value:
            raise ValueError("must be a string, a list of strings, a list of token ids or a list of lists")
        if all(_is_token_id(t) for t in value):
            return [list(value)]
        if all(isinstance(p, str) for p in value):
            return list(value)
        if all(isinstance(p, list) and all(_is_token_id(t) for t in p) for p in value):
            return [list(p) for p in value]
        raise ValueError("must be a string, a list of strings, a list of token ids or a list of lists")


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[Any, _CONTENT_SCHEMA] = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    # An assistant turn's thinking, as a reasoning model's reply gave it (templates such as
    # Qwen3's read `reasoning_content`); passed to the template as sent, like vLLM.
    reasoning_content: str | None = None
    reasoning: str | None = None

    @field_validator("content")
    @classmethod
    def _content(cls, value: Any) -> str | None:
        if value is None or isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise ValueError("must be a string or a list of content parts")
        texts = []
        for part in value:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("only text content parts ({'type': 'text', 'text': ...}) are supported")
            texts.append(part["text"])
        return "".join(texts)

    def to_template(self) -> dict[str, Any]:
        """The message as the chat template sees it."""
        message: dict[str, Any] = {"role": self.role, "content": self.content or ""}
        for key in ("name", "tool_call_id", "tool_calls", "reasoning_content", "reasoning"):
            value = getattr(self, key)
            if value is not None:
                message[key] = value
        return message


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions."""

    off_values: ClassVar[dict[str, tuple[Any, ...]]] = dict(CHAT_OFF_VALUES)

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Int64 | None = None
    max_completion_tokens: Int64 | None = None
    logprobs: bool | None = False
    top_logprobs: Int64 | None = None
    # Tool calling (trillium/data_plane/tool_choice.py)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Annotated[Any, WithJsonSchema({})] = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    reasoning_effort: str | None = None  # passed to the chat template
    # vLLM extras
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # needs --trust-request-chat-template
    documents: list[dict[str, Any]] | None = None  # the template's `documents` (RAG)
    include_reasoning: bool | None = True  # with --reasoning-parser: false drops the thinking
    # vLLM's: at most this many thinking tokens, then `</think>` is forced (needs --reasoning-parser)
    thinking_token_budget: Annotated[int, Field(ge=0)] | None = None


class TokenizeRequest(_Body):
    """POST /tokenize: either `prompt` or `messages` (vLLM's TokenizeCompletionRequest /
    TokenizeChatRequest, vllm/entrypoints/serve/tokenize/protocol.py)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for prompt, False for messages
    add_generation_prompt: bool | None = True
    return_token_strs: bool | None = False
    # messages only: rendered as /v1/chat/completions renders them
    continue_final_message: bool | None = False
    chat_template: str | None = None  # needs --trust-request-chat-template
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None  # the template's `tools`


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[Int64]


REQUEST_MODELS: tuple[type[BaseModel], ...] = (
    CompletionRequest,
    ChatCompletionRequest,
    TokenizeRequest,
    DetokenizeRequest,
)


def _param_path(loc: tuple) -> str | None:
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        else:
            parts.append(("." if parts else "") + str(item))
    return "".join(parts) or None


def parse_request(model: type[_Body], body: bytes) -> Any:
    """Validate a JSON body; ApiError(400) naming the first bad parameter."""
    try:
        parsed = model.model_validate_json(body)
    except pydantic.ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        if first["type"] == "json_invalid":
            raise bad_request(f"malformed JSON body: {first['msg']}") from None
        if first["type"] == "model_type" and not first["loc"]:
            raise bad_request("the request body must be a JSON object") from None
        param = _param_path(tuple(first["loc"]))
        message = first["msg"].removeprefix("Value error, ")
        raise bad_request(f"{param}: {message}" if param else message, param) from None
    refuse_unimplemented(parsed)
    return parsed


__all__ = [
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "DetokenizeRequest",
    "REQUEST_MODELS",
    "StreamOptions",
    "TokenizeRequest",
    "parse_request",
]

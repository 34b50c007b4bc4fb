"""Pydantic models of Anthropic's Messages API request bodies (POST /v1/messages, /count_tokens).

The fields of Anthropic's `MessageCreateParams` / `MessageCountTokensParams`
that Trillium acts on, with the types vLLM declares for them
(vllm/entrypoints/anthropic/protocol.py), but strict as protocol.py's OpenAI
models are: a field a model does not declare is a 400 naming it unless its
value asks for nothing (null, [] or {}, or an "off" value below;
request_fields.refuse_unimplemented), where vLLM's models drop it silently.

Bodies are parsed by protocol.parse_request (a 400 naming the first bad field).
Message `content` and `system` are a string or a list of content blocks;
the blocks are validated one by one by `parse_blocks` (anthropic_messages.py
calls it) so an error names the block (`messages[1].content[0].text`), not
a member of a pydantic union.

    block          allowed in           fields
    text           system, user, asst.  text (cache_control accepted)
    tool_use       assistant            id, name, input
    tool_result    user                 tool_use_id, content (str | text blocks), is_error
    thinking       assistant            thinking, signature (opaque, not checked)

`cache_control` is accepted wherever Anthropic allows it: Trillium's prefix
cache keeps every prompt's blocks anyway (on by default), so a breakpoint
asks for nothing more.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field

from trillium.data_plane.errors import bad_request
from trillium.data_plane.request_fields import refuse_unimplemented

PositiveInt64 = Annotated[int, Field(ge=1, le=2**63 - 1)]
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]


class _Body(BaseModel):
    # WHY extra="allow": undeclared fields are kept aside so refuse_unimplemented names them.
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)
    off_values: ClassVar[dict[str, tuple[Any, ...]]] = {}


class TextBlock(_Body):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None


class ToolUseBlock(_Body):
    type: Literal["tool_use"]
    id: Annotated[str, Field(min_length=1)]
    name: Annotated[str, Field(min_length=1)]
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolResultBlock(_Body):
    type: Literal["tool_result"]
    tool_use_id: Annotated[str, Field(min_length=1)]
    content: Any = None  # str or a list of text blocks (parse_blocks)
    is_error: bool | None = None
    cache_control: dict[str, Any] | None = None


class ThinkingBlock(_Body):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


BLOCK_TYPES: dict[str, type[_Body]] = {
    "text": TextBlock, "tool_use": ToolUseBlock, "tool_result": ToolResultBlock, "thinking": ThinkingBlock,
}


class AnthropicMessage(_Body):
    role: Literal["user", "assistant"]
    content: Any  # str or a list of content blocks (parse_blocks)


class AnthropicTool(_Body):
    """A client tool; Anthropic's server tools (web search, bash, ...) are not served."""

    off_values: ClassVar[dict[str, tuple[Any, ...]]] = {"strict": (False,), "defer_loading": (False,)}

    name: Annotated[str, Field(min_length=1)]
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None


class ToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(_Body):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Int64 | None = None
    display: Literal["summarized"] | None = None  # "omitted" (redacted thinking) is not implemented


class JsonOutputFormat(_Body):
    type: Literal["json_schema"]
    schema_: Annotated[dict[str, Any], Field(alias="schema")]


class OutputConfig(_Body):
    """Anthropic's structured output (`format`) and `effort` (passed to the template as reasoning_effort)."""

    format: JsonOutputFormat | None = None
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None


class Metadata(_Body):
    user_id: str | None = None  # informational, as OpenAI's `user`


class CountTokensRequest(_Body):
    """POST /v1/messages/count_tokens: what the prompt is made of."""

    model: Annotated[str, Field(min_length=1)]
    messages: Annotated[list[AnthropicMessage], Field(min_length=1)]
    system: Any = None  # str or a list of text blocks
    tools: list[AnthropicTool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages. `max_tokens` is required, as Anthropic (and vLLM) require it."""

    # WHY both: "standard_only" asks for Anthropic's standard capacity, the only one there is.
    off_values: ClassVar[dict[str, tuple[Any, ...]]] = {"service_tier": ("auto", "standard_only")}

    max_tokens: PositiveInt64
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    metadata: Metadata | None = None


def _param_path(loc: tuple) -> str:
    parts: list[str] = []
    for item in loc:
        parts.append(f"[{item}]" if isinstance(item, int) else ("." if parts else "") + str(item))
    return "".join(parts)


def _first_error(exc: pydantic.ValidationError, prefix: str) -> tuple[str, str]:
    first = exc.errors(include_url=False)[0]
    loc = _param_path(tuple(first["loc"]))
    return (f"{prefix}.{loc}" if loc else prefix), first["msg"].removeprefix("Value error, ")


def parse_blocks(value: Any, param: str, allowed: tuple[str, ...]) -> list[_Body]:
    """`content` (or `system`): a string is one text block; else each block validated."""
    if isinstance(value, str):
        return [TextBlock(type="text", text=value)]
    if not isinstance(value, list):
        raise bad_request(f"{param}: must be a string or a list of content blocks", param)
    blocks = []
    for i, item in enumerate(value):
        where = f"{param}[{i}]"
        kind = item.get("type") if isinstance(item, dict) else None
        if kind not in allowed:
            shown = ", ".join(allowed)
            raise bad_request(f"{where}.type: a block of type {kind!r} is not supported here (one of {shown})",
                              f"{where}.type")
        try:
            block = BLOCK_TYPES[kind].model_validate(item)
        except pydantic.ValidationError as exc:
            field, message = _first_error(exc, where)
            raise bad_request(f"{field}: {message}", field) from None
        refuse_unimplemented(block, where)
        blocks.append(block)
    return blocks


__all__ = ["AnthropicMessage", "AnthropicTool", "CountTokensRequest", "MessagesRequest", "OutputConfig", "TextBlock",
           "ThinkingBlock", "ThinkingConfig", "ToolChoice", "ToolResultBlock", "ToolUseBlock", "parse_blocks"]

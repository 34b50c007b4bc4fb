"""Anthropic's Messages API on the chat path: request -> ChatCompletionRequest, reply -> Anthropic's.

Pure functions (no I/O). The Messages route (routes/messages.py) turns a
parsed `MessagesRequest` into the same internal `ChatCompletionRequest` the
chat route serves, then reads each reply with the chat path's `ChoiceReply`
and writes it back in Anthropic's shape, as vLLM does
(vllm/entrypoints/anthropic/serving.py `_convert_anthropic_to_openai_request`,
`messages_full_converter`):

    Anthropic                          chat request / template message
    system (str | text blocks)         a leading {"role": "system"} message (texts joined)
    user text blocks                   {"role": "user", "content": texts joined}
    user tool_result blocks            {"role": "tool", "tool_call_id", "content"} each, before the
                                       user's text ("Error: " first when is_error is true)
    assistant text / thinking          {"role": "assistant", "content", "reasoning_content"}
    assistant tool_use blocks          its "tool_calls": [{"id", "type": "function",
                                       "function": {"name", "arguments": JSON of input}}]
    last message from the assistant    a prefill: rendered open and continued
                                       (continue_final_message), as Anthropic continues it
    tools [{name, description,         [{"type": "function", "function": {"name", "description",
      input_schema}]                      "parameters": input_schema}}]
    tool_choice auto / any / tool N    "auto" / "required" / {"type": "function", "function": {"name": N}}
      / none; disable_parallel_         / "none"; parallel_tool_calls false
      tool_use true
    max_tokens, stop_sequences,        max_tokens, stop, temperature, top_p, top_k
      temperature, top_p, top_k
    thinking enabled                   chat_template_kwargs.enable_thinking true (needs --reasoning-parser;
                                       budget_tokens checked as Anthropic does, >= 1024 and < max_tokens,
                                       is the chat request's thinking_token_budget)
    thinking disabled                  enable_thinking false, and no thinking blocks in the reply
    thinking adaptive / absent         the template's default (a reasoning model's thinking comes back)
    output_config.format json_schema   response_format json_schema (the chat path's grammar; it waits for
                                       the end of the thinking)
    output_config.effort               reasoning_effort (passed to the chat template)

Reply: a `thinking` block (with an opaque `signature`), a `text` block, then
one `tool_use` block per call; stop_reason end_turn (EOS or a stop token),
stop_sequence (with the string), max_tokens (model_context_window_exceeded
when the context, not max_tokens, ended it), tool_use, or null for a reply
aborted by the server. `usage.input_tokens` counts the whole prompt (vLLM's
prompt_tokens).

Errors on these routes use Anthropic's shape,
`{"type": "error", "error": {"type": <Anthropic's type for the status>, "message"}}`.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from quart import Response

from trillium.data_plane.anthropic_protocol import (
    CountTokensRequest,
    MessagesRequest,
    TextBlock,
    ThinkingBlock,
    ThinkingConfig,
    ToolChoice,
    ToolResultBlock,
    ToolUseBlock,
    parse_blocks,
)
from trillium.data_plane.chat_options import ChatOptions
from trillium.data_plane.errors import ApiError, bad_request
from trillium.data_plane.protocol import ChatCompletionRequest
from trillium.data_plane.structured_fields import from_response_format

MESSAGES_PATH = "/v1/messages"
# Anthropic's error types by HTTP status (its API reference, "Errors"); 503 is Trillium's
# overloaded / not-serving status (Anthropic's own overload status is 529).
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                503: "overloaded_error", 529: "overloaded_error"}
_MIN_BUDGET_TOKENS = 1024  # Anthropic's minimum thinking budget
_USER_BLOCKS = ("text", "tool_result")
_ASSISTANT_BLOCKS = ("text", "tool_use", "thinking")


def error_body(error: ApiError) -> dict:
    kind = _ERROR_TYPES.get(error.status) or ("api_error" if error.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def error_response(error: ApiError) -> Response:
    response = Response(json.dumps(error_body(error), ensure_ascii=False), status=error.status,
                        mimetype="application/json")
    for name, value in error.headers.items():
        response.headers[name] = value
    return response


def message_id(request_id: str) -> str:
    """Anthropic's `msg_` id for the HTTP request `request_id` (rollout_fields.RequestIds.base)."""
    return f"msg_{request_id}"


def chat_request(req: CountTokensRequest, options: ChatOptions) -> ChatCompletionRequest:
    """The chat request that serves `req` (a MessagesRequest, or a count_tokens body)."""
    messages = _system_messages(req.system) + _conversation(req.messages)
    fields: dict[str, Any] = {"model": req.model, "messages": messages}
    max_tokens = getattr(req, "max_tokens", None)
    fields.update(_thinking_fields(req.thinking, options, max_tokens))
    if req.messages[-1].role == "assistant":
        fields.update(continue_final_message=True, add_generation_prompt=False)
    if req.tools:
        fields["tools"] = [_tool(t) for t in req.tools]
    if req.tool_choice is not None:
        fields.update(_tool_choice(req.tool_choice))
    if req.output_config is not None:
        fields.update(_output_config(req.output_config))
    if isinstance(req, MessagesRequest):
        fields.update(max_tokens=max_tokens, stop=req.stop_sequences, temperature=req.temperature,
                      top_p=req.top_p, top_k=req.top_k, stream=bool(req.stream))
    return ChatCompletionRequest.model_validate(fields)


def _system_messages(system: Any) -> list[dict]:
    if system is None:
        return []
    blocks = parse_blocks(system, "system", ("text",))
    return [{"role": "system", "content": "".join(b.text for b in blocks)}]


def _conversation(messages) -> list[dict]:
    out: list[dict] = []
    for i, message in enumerate(messages):
        param = f"messages[{i}].content"
        allowed = _USER_BLOCKS if message.role == "user" else _ASSISTANT_BLOCKS
        blocks = parse_blocks(message.content, param, allowed)
        if message.role == "user":
            out.extend(_tool_results(blocks, param))
            texts = [b.text for b in blocks if isinstance(b, TextBlock)]
            if texts or not any(isinstance(b, ToolResultBlock) for b in blocks):
                out.append({"role": "user", "content": "".join(texts)})
        else:
            out.append(_assistant(blocks))
    return out


def _tool_results(blocks, param: str) -> list[dict]:
    results = []
    for j, block in enumerate(blocks):
        if not isinstance(block, ToolResultBlock):
            continue
        content = block.content
        if content is None:
            text = ""
        else:
            text = "".join(b.text for b in parse_blocks(content, f"{param}[{j}].content", ("text",)))
        if block.is_error:
            text = "Error: " + text
        results.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": text})
    return results


def _assistant(blocks) -> dict:
    message: dict[str, Any] = {"role": "assistant",
                               "content": "".join(b.text for b in blocks if isinstance(b, TextBlock))}
    thinking = [b.thinking for b in blocks if isinstance(b, ThinkingBlock)]
    if thinking:
        message["reasoning_content"] = "".join(thinking)
    calls = [{"id": b.id, "type": "function",
              "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}}
             for b in blocks if isinstance(b, ToolUseBlock)]
    if calls:
        message["tool_calls"] = calls
    return message


def _tool(tool) -> dict:
    function: dict[str, Any] = {"name": tool.name, "parameters": tool.input_schema}
    if tool.description is not None:
        function["description"] = tool.description
    return {"type": "function", "function": function}


def _tool_choice(choice: ToolChoice) -> dict:
    if choice.type != "tool" and choice.name is not None:
        raise bad_request('tool_choice.name: only with tool_choice.type "tool"', "tool_choice.name")
    if choice.type == "tool":
        if not choice.name:
            raise bad_request('tool_choice.name: required with tool_choice.type "tool"', "tool_choice.name")
        fields: dict[str, Any] = {"tool_choice": {"type": "function", "function": {"name": choice.name}}}
    else:
        fields = {"tool_choice": {"auto": "auto", "any": "required", "none": "none"}[choice.type]}
    if choice.disable_parallel_tool_use:
        fields["parallel_tool_calls"] = False
    return fields


def _output_config(config) -> dict:
    fields: dict[str, Any] = {}
    if config.format is not None:
        response_format = {"type": "json_schema", "json_schema": {"name": "output", "schema": config.format.schema_}}
        try:  # WHY here: a schema the grammar cannot take is a 400 naming the Anthropic field
            from_response_format(response_format)
        except ApiError as exc:
            param = "output_config.format.schema"
            raise bad_request(exc.message.replace("response_format.json_schema.schema", param), param) from None
        fields["response_format"] = response_format
    if config.effort is not None:
        fields["reasoning_effort"] = config.effort
    return fields


def _thinking_fields(thinking: ThinkingConfig | None, options: ChatOptions, max_tokens: int | None) -> dict:
    if thinking is None or thinking.type == "adaptive":
        if thinking is not None and thinking.budget_tokens is not None:
            raise bad_request('thinking.budget_tokens: only with thinking.type "enabled"', "thinking.budget_tokens")
        return {}
    if thinking.type == "disabled":
        if thinking.budget_tokens is not None:
            raise bad_request('thinking.budget_tokens: only with thinking.type "enabled"', "thinking.budget_tokens")
        return {"chat_template_kwargs": {"enable_thinking": False}, "include_reasoning": False}
    if options.reasoning_parser is None:
        raise bad_request("thinking: this server does not split a reasoning model's thinking (it needs "
                          "--reasoning-parser)", "thinking")
    budget = thinking.budget_tokens
    if budget is None or budget < _MIN_BUDGET_TOKENS:
        raise bad_request(f"thinking.budget_tokens: required with thinking.type \"enabled\", at least "
                          f"{_MIN_BUDGET_TOKENS}", "thinking.budget_tokens")
    if max_tokens is not None and budget >= max_tokens:
        raise bad_request(f"thinking.budget_tokens: must be less than max_tokens ({max_tokens})",
                          "thinking.budget_tokens")
    return {"chat_template_kwargs": {"enable_thinking": True}, "thinking_token_budget": budget}


def content_blocks(message: dict) -> list[dict]:
    """Anthropic's content of a whole reply, from `ChoiceReply.message()`'s fields."""
    blocks: list[dict] = []
    if message.get("reasoning_content"):
        blocks.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": new_signature()})
    text = message.get("content")
    calls = []
    for call in message.get("tool_calls") or ():
        arguments = call["function"]["arguments"]
        try:
            tool_input = json.loads(arguments)
        except ValueError:
            tool_input = None
        if not isinstance(tool_input, dict):  # WHY: a call cut short by max_tokens is not a tool_use
            text = (text or "") + arguments
            continue
        calls.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": tool_input})
    if text:
        blocks.append({"type": "text", "text": text})
    return blocks + calls


def new_signature() -> str:
    """A thinking block's `signature`: opaque to clients, never checked when sent back."""
    return uuid.uuid4().hex


def stop_reason(finish_reason: str | None, engine_stop: int | str | None, called_tools: bool,
                num_tokens: int, max_tokens: int | None) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) of a finished reply."""
    if finish_reason == "length":
        if max_tokens is not None and num_tokens < max_tokens:
            return "model_context_window_exceeded", None
        return "max_tokens", None
    if finish_reason != "stop":
        return None, None  # aborted by the server (abort_requests, pause)
    if called_tools:
        return "tool_use", None
    if isinstance(engine_stop, str):
        return "stop_sequence", engine_stop
    return "end_turn", None


def usage(input_tokens: int, output_tokens: int) -> dict:
    return {"input_tokens": input_tokens, "output_tokens": output_tokens}


__all__ = ["MESSAGES_PATH", "chat_request", "content_blocks", "error_body", "error_response", "message_id",
           "new_signature", "stop_reason", "usage"]

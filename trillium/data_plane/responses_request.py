"""POST /v1/responses bodies -> the chat request the chat route would run.

The Responses API (OpenAI's; vLLM's vllm/entrypoints/openai/responses/
protocol.py `ResponsesRequest` and utils.py `construct_input_messages`) is
served by turning each body into a `ChatCompletionRequest`, so the same
template, sampling, tool and reasoning code answers both APIs:

    instructions                  a leading system message (not carried over
                                  to a response chained after this one)
    input: str                    one user message
    input: [items]                messages (input_text / output_text parts),
                                  function_call (an assistant tool call,
                                  merged into the assistant turn before it),
                                  function_call_output (a tool message),
                                  reasoning (the assistant turn's thinking)
    tools [{type: function, name, description, parameters, strict}]
                                  chat's [{type: function, function: {...}}]
    tool_choice {type: function, name}   chat's {type: function, function: {name}}
    text.format                   chat's response_format (text / json_object /
                                  json_schema {name, schema, description, strict})
    reasoning.effort              chat's reasoning_effort (to the template)
    max_output_tokens             max_completion_tokens

Everything else a body may carry is refused by name (request_fields.py):
built-in tools (web_search, file_search, ...), `include`, `prompt`,
`conversation`, `truncation: "auto"`, reasoning summaries. Pure: no I/O.
"""

from __future__ import annotations

import copy
import json
from typing import Annotated, Any, ClassVar

import pydantic
from pydantic import BaseModel, ConfigDict, Field

from trillium.data_plane.errors import bad_request
from trillium.data_plane.protocol import ChatCompletionRequest, Int64
from trillium.data_plane.request_fields import COMMON_OFF_VALUES

_MESSAGE_ROLES = ("user", "system", "developer", "assistant")
# The keys each input item may carry (OpenAI's ResponseInputItemParam; output items sent back as input
# carry their id / status too). Any other key is a 400 naming it.
_ITEM_KEYS = {
    "message": {"type", "role", "content", "id", "status", "phase"},
    "function_call": {"type", "call_id", "name", "arguments", "id", "status"},
    "function_call_output": {"type", "call_id", "output", "id", "status"},
    "reasoning": {"type", "id", "summary", "content", "encrypted_content", "status"},
}
_PART_KEYS = {"input_text": {"type", "text"}, "output_text": {"type", "text", "annotations", "logprobs"}}
_TOOL_KEYS = {"type", "name", "description", "parameters", "strict"}
_FORMAT_KEYS = {"text": {"type"}, "json_object": {"type"},
                "json_schema": {"type", "name", "schema", "description", "strict"}}


class ResponsesRequest(BaseModel):
    """POST /v1/responses (OpenAI's fields, then vLLM's extras)."""

    # WHY extra="allow": undeclared fields are kept aside so refuse_unimplemented names them.
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)
    off_values: ClassVar[dict[str, tuple[Any, ...]]] = {
        **COMMON_OFF_VALUES,
        "truncation": ("disabled",),
        "top_logprobs": (0,),
        "stream_options": ({"include_obfuscation": False},),
    }

    model: str | None = None
    input: Annotated[Any, Field()]  # str | list of items, checked by `conversation`
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    max_output_tokens: Annotated[int, Field(ge=1, le=2**63 - 1)] | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = False
    store: bool | None = None  # None: OpenAI's default, true (when the server keeps responses)
    background: bool | None = False
    previous_response_id: str | None = None
    # Informational: echoed in the response, never acted on.
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    # vLLM's extras (vllm/entrypoints/openai/responses/protocol.py)
    top_k: Int64 | None = None
    seed: Int64 | None = None
    stop: Any = None  # str | list[str], checked by the chat request
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    priority: Int64 | None = None
    cache_salt: str | None = None
    structured_outputs: dict[str, Any] | None = None


def _text_of_parts(content: Any, where: str, kinds: tuple[str, ...]) -> str:
    """The text of a message's content: a string or a list of text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}: must be a string or a list of content parts", where)
    texts = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in kinds:
            raise bad_request(f"{at}.type: only {' / '.join(kinds)} content is supported, got {json.dumps(kind)}",
                              f"{at}.type")
        _check_keys(part, _PART_KEYS[kind], at)
        if not isinstance(part.get("text"), str):
            raise bad_request(f"{at}.text: must be a string", f"{at}.text")
        texts.append(part["text"])
    return "".join(texts)


def _check_keys(obj: dict, allowed: set[str], where: str) -> None:
    for key in obj:
        if key not in allowed:
            raise bad_request(f"{where}.{key}: unknown or unsupported field", f"{where}.{key}")


def _string(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise bad_request(f"{where}.{key}: required, a string", f"{where}.{key}")
    return value


def _last_assistant(messages: list[dict]) -> dict | None:
    return messages[-1] if messages and messages[-1]["role"] == "assistant" else None


def _add_item(messages: list[dict], item: Any, where: str, *, history: bool) -> None:
    """Append one item's chat message (or merge it into the assistant turn before it, as vLLM's
    `_construct_message_from_response_item` does). `history`: a stored response's output,
    whose reasoning is dropped (vLLM: "We skip the reasoning output")."""
    if not isinstance(item, dict):
        raise bad_request(f"{where}: must be an object", where)
    kind = item.get("type", "message" if "role" in item else None)
    if kind not in _ITEM_KEYS:
        raise bad_request(f"{where}.type: unsupported input item type {json.dumps(kind)} (supported: "
                          f"{', '.join(_ITEM_KEYS)})", f"{where}.type")
    _check_keys(item, _ITEM_KEYS[kind], where)
    previous = _last_assistant(messages)
    if kind == "message":
        role = item.get("role")
        if role not in _MESSAGE_ROLES:
            raise bad_request(f"{where}.role: must be one of {', '.join(_MESSAGE_ROLES)}", f"{where}.role")
        kinds = ("output_text", "input_text") if role == "assistant" else ("input_text",)
        text = _text_of_parts(item.get("content"), f"{where}.content", kinds)
        if previous is not None and role == "assistant" and previous.get("content") is None:
            previous["content"] = text
        else:
            messages.append({"role": role, "content": text})
    elif kind == "function_call":
        call = {"id": _string(item, "call_id", where), "type": "function",
                "function": {"name": _string(item, "name", where), "arguments": _string(item, "arguments", where)}}
        if previous is not None:
            previous.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        output = _text_of_parts(item.get("output"), f"{where}.output", ("input_text",))
        messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", where), "content": output})
    elif not history:
        _add_reasoning(messages, item, where)


def _add_reasoning(messages: list[dict], item: dict, where: str) -> None:
    if item.get("encrypted_content") is not None:
        raise bad_request(f"{where}.encrypted_content: encrypted reasoning is not supported",
                          f"{where}.encrypted_content")
    texts = item.get("content") or item.get("summary") or []
    if not isinstance(texts, list) or not all(isinstance(t, dict) and isinstance(t.get("text"), str) for t in texts):
        raise bad_request(f"{where}.content: must be a list of {{type, text}} parts", f"{where}.content")
    text = "".join(t["text"] for t in texts)
    # Both names: Qwen3-style templates read `reasoning_content`, vLLM writes `reasoning`.
    messages.append({"role": "assistant", "content": None, "reasoning_content": text, "reasoning": text})


def conversation(req: ResponsesRequest, history: list[dict] | None, previous_output: list[dict] | None
                 ) -> list[dict]:
    """The chat messages of this turn without the instructions: a stored conversation (`history`)
    and the output it got, then this request's input."""
    messages = copy.deepcopy(history or [])  # WHY deep: merging a call must not change the stored turn
    for i, item in enumerate(previous_output or ()):
        _add_item(messages, item, f"previous_response.output[{i}]", history=True)
    if isinstance(req.input, str):
        messages.append({"role": "user", "content": req.input})
    elif isinstance(req.input, list) and req.input:
        for i, item in enumerate(req.input):
            _add_item(messages, item, f"input[{i}]", history=False)
    else:
        raise bad_request("input: must be a string or a non-empty list of input items", "input")
    return messages


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses' flat function tools as chat's; any other tool type is a 400 naming it."""
    if tools is None:
        return None
    converted = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        kind = tool.get("type")
        if kind != "function":
            raise bad_request(f"{where}.type: only function tools are supported; built-in tool "
                              f"{json.dumps(kind)} is not", f"{where}.type")
        _check_keys(tool, _TOOL_KEYS, where)
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise bad_request(f"{where}.name: every function tool needs a name", f"{where}.name")
        converted.append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}})
    return converted


def chat_tool_choice(tool_choice: Any) -> Any:
    if tool_choice is None or isinstance(tool_choice, str):
        return tool_choice  # "none" / "auto" / "required" (anything else: the chat request's 400)
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function" and set(tool_choice) <= {"type",
                                                                                                     "name"}:
        return {"type": "function", "function": {"name": tool_choice.get("name")}}
    raise bad_request('tool_choice: must be "none", "auto", "required" or {"type": "function", "name": ...} '
                      "(built-in and allowed_tools choices are not supported)", "tool_choice")


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """text.format as chat's response_format."""
    if text is None:
        return None
    _check_keys(text, {"format", "verbosity"}, "text")
    if text.get("verbosity") not in (None, "medium"):
        raise bad_request('text.verbosity: only "medium" is supported', "text.verbosity")
    spec = text.get("format")
    if spec is None:
        return None
    kind = spec.get("type") if isinstance(spec, dict) else None
    if kind not in _FORMAT_KEYS:
        raise bad_request(f"text.format.type: must be one of {', '.join(_FORMAT_KEYS)}; got {json.dumps(kind)}",
                          "text.format.type")
    _check_keys(spec, _FORMAT_KEYS[kind], "text.format")
    if kind != "json_schema":
        return {"type": kind}
    return {"type": "json_schema", "json_schema": {k: v for k, v in spec.items() if k != "type"}}


def reasoning_effort(reasoning: dict[str, Any] | None) -> str | None:
    if reasoning is None:
        return None
    _check_keys(reasoning, {"effort", "summary", "generate_summary"}, "reasoning")
    for key in ("summary", "generate_summary"):
        if reasoning.get(key) is not None:
            raise bad_request(f"reasoning.{key}: reasoning summaries are not supported (the reasoning "
                              "itself is returned as reasoning_text)", f"reasoning.{key}")
    effort = reasoning.get("effort")
    if effort is not None and not isinstance(effort, str):
        raise bad_request("reasoning.effort: must be a string", "reasoning.effort")
    return effort


_PASSED_ON = ("model", "temperature", "top_p", "top_k", "seed", "stop", "repetition_penalty", "ignore_eos",
              "skip_special_tokens", "include_stop_str_in_output", "priority", "cache_salt", "structured_outputs",
              "parallel_tool_calls", "stream")


def chat_request(req: ResponsesRequest, messages: list[dict]) -> ChatCompletionRequest:
    """The chat request of a Responses body (`messages`: `conversation`'s, instructions prepended here)."""
    if req.instructions:
        messages = [{"role": "system", "content": req.instructions}, *messages]
    body: dict[str, Any] = {name: getattr(req, name) for name in _PASSED_ON if getattr(req, name) is not None}
    body.update(messages=messages, tools=chat_tools(req.tools), tool_choice=chat_tool_choice(req.tool_choice),
                response_format=response_format(req.text), reasoning_effort=reasoning_effort(req.reasoning),
                max_completion_tokens=req.max_output_tokens)
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except pydantic.ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        loc = [str(p) for p in first["loc"]]
        param = "input" if loc and loc[0] == "messages" else (loc[0] if loc else None)
        raise bad_request(f"{param}: {first['msg'].removeprefix('Value error, ')}", param) from None


__all__ = ["ResponsesRequest", "chat_request", "chat_tools", "conversation", "response_format"]

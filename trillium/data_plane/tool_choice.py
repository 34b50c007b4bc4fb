"""`tools`, `tool_choice` and `parallel_tool_calls` of a chat request -> a `ToolPlan`.

    tool_choice       the template gets   the reply is read by      a grammar
    "none"            tools               nothing (plain content)   no
    "auto" (default   tools               --tool-call-parser        no
      with tools)
    "required"        tools               forced.RequiredToolCalls  a JSON array of calls
    {"type": "function", "function": {"name": N}}
                      tools               forced.NamedToolCall(N)   N's parameters

As vLLM (vllm/entrypoints/openai/chat_completion/protocol.py and
serving.py): "auto" without --enable-auto-tool-choice is a 400, a
tool_choice other than "none" needs `tools`, a named function must be one of
them. `parallel_tool_calls: false` keeps the first call only (and for
"required" the grammar allows one).
"""

from __future__ import annotations

from typing import Any

import attrs

from trillium.data_plane.chat_options import ChatOptions
from trillium.data_plane.errors import bad_request
from trillium.data_plane.tool_parsers import ToolParser, tool_parser
from trillium.data_plane.tool_parsers.forced import NamedToolCall, RequiredToolCalls, named_schema, required_schema


@attrs.frozen
class ToolPlan:
    tools: list[dict[str, Any]] | None = None  # for the chat template
    parser: ToolParser | None = None  # None: no tool calls are read from the reply
    schema: dict[str, Any] | None = None  # the reply's JSON schema (required / named)
    max_calls: int | None = None


def plan_tools(tools: list[dict[str, Any]] | None, tool_choice: Any, parallel_tool_calls: bool | None,
               options: ChatOptions) -> ToolPlan:
    tools = _check_tools(tools)
    choice, name = _check_choice(tool_choice, tools)
    parallel = parallel_tool_calls is not False
    max_calls = None if parallel else 1
    if choice == "none":
        return ToolPlan(tools)
    if choice == "auto":
        if not options.enable_auto_tool_choice or options.tool_call_parser is None:
            raise bad_request('tool_choice: "auto" tool choice requires --enable-auto-tool-choice and '
                              "--tool-call-parser to be set", "tool_choice")
        return ToolPlan(tools, tool_parser(options.tool_call_parser), None, max_calls)
    if choice == "required":
        try:
            schema = required_schema(tools, parallel)
        except ValueError as exc:
            raise bad_request(str(exc), "tools") from None
        return ToolPlan(tools, RequiredToolCalls(), schema, max_calls)
    tool = next(t for t in tools if t["function"]["name"] == name)
    return ToolPlan(tools, NamedToolCall(name), named_schema(tool), None)


def _check_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if tool.get("type") != "function":
            raise bad_request(f'{where}.type: only "function" tools are supported', f"{where}.type")
        function = tool.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise bad_request(f"{where}.function.name: every tool needs a function name", f"{where}.function")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise bad_request(f"{where}.function.parameters: must be a JSON schema object",
                              f"{where}.function.parameters")
    return tools


def _check_choice(tool_choice: Any, tools: list[dict[str, Any]] | None) -> tuple[str, str | None]:
    """("none" | "auto" | "required" | "named", the named function)."""
    if tool_choice is None:
        return ("auto" if tools else "none"), None
    if tool_choice in ("none", "auto", "required"):
        if tool_choice != "none" and not tools:
            raise bad_request("tool_choice: when using `tool_choice`, `tools` must be set", "tool_choice")
        return tool_choice, None
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if (not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not isinstance(function, dict)
            or not isinstance(function.get("name"), str)):
        raise bad_request('tool_choice: must be "none", "auto", "required" or '
                          '{"type": "function", "function": {"name": ...}}', "tool_choice")
    name = function["name"]
    if not tools or all(t["function"]["name"] != name for t in tools):
        raise bad_request(f"tool_choice: no tool named {name!r} in tools", "tool_choice")
    return "named", name


__all__ = ["ToolPlan", "plan_tools"]

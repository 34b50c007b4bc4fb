"""The output formats of `tool_choice` "required" and a named function, which a grammar enforces.

vLLM constrains these replies to plain JSON whatever the model's own tool
format (vllm/tool_parsers/utils.py `_get_json_schema_from_tools`, used by
vllm/entrypoints/openai/chat_completion/protocol.py): "required" to an
array of `{"name": <one of the tools>, "parameters": <its schema>}` (at
least one; Trillium adds `maxItems: 1` when parallel_tool_calls is false),
a named function to that function's parameters alone. These two parsers
read those replies back into calls, streamed or whole.
"""

from __future__ import annotations

from typing import Any

from trillium.data_plane.tool_parsers.json_calls import call_array
from trillium.data_plane.tool_parsers.json_text import skip_ws
from trillium.data_plane.tool_parsers.protocol import ScannedCall, ToolScan, openai_call_id, valid_calls


def required_schema(tools: list[dict[str, Any]], parallel_tool_calls: bool) -> dict[str, Any]:
    """vLLM's schema for tool_choice "required" (the tools' `$defs` hoisted to the top)."""
    items = []
    defs: dict[str, Any] = {}
    for tool in tools:
        function = tool["function"]
        params = dict(function.get("parameters") or {"type": "object", "properties": {}})
        for name, schema in params.pop("$defs", {}).items():
            if name in defs and defs[name] != schema:
                raise ValueError(f"tools: two tools define $defs {name!r} differently")
            defs[name] = schema
        items.append({"properties": {"name": {"type": "string", "enum": [function["name"]]}, "parameters": params},
                      "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def named_schema(tool: dict[str, Any]) -> dict[str, Any]:
    """vLLM's schema for a named tool_choice: the function's parameters."""
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


class RequiredToolCalls:
    """`[{"name": ..., "parameters": {...}}, ...]`; the complete calls of a cut reply are kept."""

    name = "required"
    keeps_special_tokens = False

    def new_call_id(self) -> str:
        return openai_call_id()

    def scan(self, text: str, final: bool = False) -> ToolScan:
        start = skip_ws(text, 0)
        if start >= len(text) or text[start] != "[":
            return ToolScan(text if final else "")
        try:
            calls, _ = call_array(text, start, ("parameters",))
        except ValueError:
            return ToolScan(text if final else "")
        if final:
            calls = [c for c in calls if valid_calls([c])]
            return ToolScan("" if calls else text, tuple(calls))
        return ToolScan("", tuple(calls))


class NamedToolCall:
    """The whole reply is the arguments of `function_name` (vLLM streams it as it comes)."""

    keeps_special_tokens = False

    def __init__(self, function_name: str) -> None:
        self.name = function_name
        self._function_name = function_name

    def new_call_id(self) -> str:
        return openai_call_id()

    def scan(self, text: str, final: bool = False) -> ToolScan:
        arguments = text.strip() if final else text.lstrip()
        return ToolScan("", (ScannedCall(self._function_name, arguments, final),))


__all__ = ["NamedToolCall", "RequiredToolCalls", "named_schema", "required_schema"]

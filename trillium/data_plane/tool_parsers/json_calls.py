"""Tool calls written as JSON objects `{"name": ..., "arguments": {...}}`, one or an array.

Shared by the hermes, llama3_json and mistral parsers and by the
grammar-forced `required` format (forced.py). The arguments are the value's
own text, so a stream sends exactly what the model wrote and the pieces join
into the final `arguments` (vLLM's hermes parser extracts the same span by
brace matching, vllm/tool_parsers/hermes_tool_parser.py `_extract_tool_args`).
"""

from __future__ import annotations

import json

from trillium.data_plane.tool_parsers.json_text import object_members, skip_ws
from trillium.data_plane.tool_parsers.protocol import ScannedCall


def call_object(text: str, start: int, args_keys: tuple[str, ...]) -> tuple[ScannedCall, int | None]:
    """The call whose object opens at text[start] == '{', and the object's end (None while open)."""
    members, end = object_members(text, start)
    name = None
    arguments = ""
    args_complete = False
    for member in members:
        if member.key == "name" and member.end is not None:
            value = json.loads(text[member.start:member.end])
            name = value if isinstance(value, str) else None
        elif member.key in args_keys:
            raw = text[member.start:member.end] if member.end is not None else text[member.start:]
            if raw.startswith('"'):
                # Arguments sent as a JSON string holding JSON: usable once the string is whole.
                raw = json.loads(raw) if member.end is not None else ""
            arguments = raw
            args_complete = member.end is not None
    complete = end is not None and name is not None and args_complete
    return ScannedCall(name, arguments, complete), end


def call_array(text: str, start: int, args_keys: tuple[str, ...]) -> tuple[list[ScannedCall], int | None]:
    """The calls of the array opening at text[start] == '[', and the array's end (None while open)."""
    calls: list[ScannedCall] = []
    i = skip_ws(text, start + 1)
    while i < len(text):
        c = text[i]
        if c == "]":
            return calls, i + 1
        if c == ",":
            i = skip_ws(text, i + 1)
            continue
        if c != "{":
            raise ValueError(f"expected a call object at {i}")
        call, end = call_object(text, i, args_keys)
        calls.append(call)
        if end is None:
            return calls, None
        i = skip_ws(text, end)
    return calls, None


__all__ = ["call_array", "call_object"]

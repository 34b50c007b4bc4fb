"""llama3_json: Llama 3.1 / 3.2 JSON tool calls, optionally after <|python_tag|>.

    {"name": "get_weather", "parameters": {"city": "Paris"}}
    <|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {}}

`parameters` or `arguments`; several calls separated by `;` or newlines. As
in vLLM's vllm/tool_parsers/llama_tool_parser.py: while streaming, a reply is
read as calls when it starts with `{` or the python tag; the whole reply's
calls are its JSON objects that have a name and arguments, wherever they are
(other text and JSON is skipped); with calls the content is null, without any
the reply is all content.
"""

from __future__ import annotations

import json

from trillium.data_plane.tool_parsers.json_calls import call_object
from trillium.data_plane.tool_parsers.json_text import skip_ws
from trillium.data_plane.tool_parsers.protocol import ScannedCall, ToolScan, final_scan, openai_call_id

PYTHON_TAG = "<|python_tag|>"
_ARGS_KEYS = ("parameters", "arguments")


class Llama3JsonToolParser:
    name = "llama3_json"
    keeps_special_tokens = True  # <|python_tag|> is special

    def new_call_id(self) -> str:
        return openai_call_id()

    def scan(self, text: str, final: bool = False) -> ToolScan:
        if final:
            return _final_anywhere(text)
        body = skip_ws(text, 0)
        if text.startswith(PYTHON_TAG, body):
            body = skip_ws(text, body + len(PYTHON_TAG))
        elif PYTHON_TAG.startswith(text[body:]):
            return ToolScan("")  # may become the tag
        elif not text.startswith("{", body):
            return ToolScan(text)
        calls: list[ScannedCall] = []
        try:
            i = body
            while i < len(text) and text[i] == "{":
                call, end = call_object(text, i, _ARGS_KEYS)
                calls.append(call)
                if end is None:
                    break
                i = skip_ws(text, end)
                if text.startswith(";", i):
                    i = skip_ws(text, i + 1)
        except ValueError:
            pass  # NOTE: what is not a call is left to the final scan
        return ToolScan("", tuple(calls))


def _final_anywhere(text: str) -> ToolScan:
    """The JSON objects in the text that are calls (the text between and after them, and
    objects that are not calls, are skipped); all of it is content when there are none."""
    decoder = json.JSONDecoder()
    calls: list[ScannedCall] = []
    i = text.find("{")
    while i >= 0:
        try:
            obj, end = decoder.raw_decode(text, i)
        except ValueError:
            i = text.find("{", i + 1)
            continue
        args = next((obj[k] for k in _ARGS_KEYS if isinstance(obj, dict) and k in obj), None)
        if isinstance(obj, dict) and isinstance(obj.get("name"), str) and args is not None:
            calls.append(ScannedCall(obj["name"], json.dumps(args, ensure_ascii=False), True))
            i = text.find("{", end)
        else:
            i = text.find("{", i + 1)
    return final_scan(text, "", calls)

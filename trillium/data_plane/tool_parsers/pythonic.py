"""pythonic: a Python list of calls, as Llama 3.2 / Llama 4 write them.

    [get_weather(city='San Francisco', metric='celsius'), get_time()]

Arguments are Python literals, turned into a JSON object once the call's
closing parenthesis is written (so a stream sends each call's arguments in
one piece). A reply is calls only when all of it is such a list (optionally
inside <|python_start|> ... <|python_end|>); otherwise it is content, and
with calls the content is null (vLLM's vllm/tool_parsers/pythonic_tool_parser.py).
"""

from __future__ import annotations

import ast
import json
import re

from trillium.data_plane.tool_parsers.json_text import skip_ws
from trillium.data_plane.tool_parsers.protocol import ScannedCall, ToolScan, final_scan, openai_call_id

_START, _END = "<|python_start|>", "<|python_end|>"
_NAME = re.compile(r"[A-Za-z_][\w.]*")
_OPEN = "([{"
_CLOSE = {")": "(", "]": "[", "}": "{"}


class PythonicToolParser:
    name = "pythonic"
    keeps_special_tokens = True  # Llama 4's <|python_start|> is special

    def new_call_id(self) -> str:
        return openai_call_id()

    def scan(self, text: str, final: bool = False) -> ToolScan:
        body = text.strip() if final else text.lstrip()
        if body.startswith(_START):
            body = body[len(_START):].lstrip()
        elif _START.startswith(body) and body and not final:
            return ToolScan("")
        if final and body.endswith(_END):
            body = body[:-len(_END)].rstrip()
        if not body.startswith("["):
            return ToolScan(text if final or body else "")
        try:
            calls, end = _calls(body)
        except (ValueError, SyntaxError):
            return ToolScan(text) if final else ToolScan("", ())
        if final:
            if end != len(body):
                return ToolScan(text)
            return final_scan(text, "", calls)
        return ToolScan("", tuple(calls))


def _calls(body: str) -> tuple[list[ScannedCall], int | None]:
    calls: list[ScannedCall] = []
    i = skip_ws(body, 1)
    while i < len(body):
        if body[i] == "]":
            return calls, i + 1
        if body[i] == ",":
            i = skip_ws(body, i + 1)
            continue
        match = _NAME.match(body, i)
        if match is None:
            raise ValueError(f"expected a call at {i}")
        paren = match.end()
        if paren >= len(body):
            return calls, None  # the name may still grow
        if body[paren] != "(":
            raise ValueError(f"expected '(' at {paren}")
        close = _matching_paren(body, paren)
        if close is None:
            calls.append(ScannedCall(match.group(), "", False))
            return calls, None
        calls.append(ScannedCall(match.group(), _arguments(body[i:close]), True))
        i = skip_ws(body, close)
    return calls, None


def _matching_paren(text: str, start: int) -> int | None:
    """End (exclusive) of the bracketed Python expression opening at text[start]."""
    stack: list[str] = []
    i = start
    while i < len(text):
        c = text[i]
        if c in "'\"":
            i = _python_string_end(text, i)
            if i is None:
                return None
            continue
        if c in _OPEN:
            stack.append(c)
        elif c in _CLOSE:
            if not stack or stack.pop() != _CLOSE[c]:
                raise ValueError(f"unbalanced {c!r} at {i}")
            if not stack:
                return i + 1
        i += 1
    return None


def _python_string_end(text: str, start: int) -> int | None:
    quote = text[start]
    i = start + 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
            continue
        if text[i] == quote:
            return i + 1
        i += 1
    return None


def _arguments(call_text: str) -> str:
    """`f(a=1, b='x')` -> '{"a": 1, "b": "x"}'; positional arguments are an error."""
    node = ast.parse(call_text, mode="eval").body
    if not isinstance(node, ast.Call) or node.args:
        raise ValueError("a tool call takes keyword arguments only")
    args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
    if None in args:
        raise ValueError("**kwargs in a tool call")
    return json.dumps(args, ensure_ascii=False)

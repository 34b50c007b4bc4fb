"""What every tool-call parser returns, and the one method it implements.

A parser reads the text a model wrote (after any reasoning) and says which
part is content and which tool calls it holds:

    scan(text, final=False) -> ToolScan   while streaming: the content safe to
                                          send so far (never a partial tag)
                                          and each call as far as it is written
    scan(text, final=True)  -> ToolScan   the answer: content, and only the
                                          calls that are complete and valid;
                                          text that fails to parse is content

`ScannedCall.arguments` is the JSON text of the call's arguments as the model
wrote it (a prefix while incomplete, so a stream can send the growth), or for
formats that are not JSON (pythonic) the JSON encoding once the call is
complete. The parser holds no state: `tool_stream.ToolCallStream` diffs
successive scans, as vLLM's hermes parser re-parses the whole text each delta
(vllm/tool_parsers/hermes_tool_parser.py).
"""

from __future__ import annotations

import json
import uuid
from typing import Protocol

import attrs


@attrs.frozen
class ScannedCall:
    name: str | None  # None until the whole name is written
    arguments: str  # JSON text (a prefix while not complete)
    complete: bool


@attrs.frozen
class ToolScan:
    content: str
    calls: tuple[ScannedCall, ...] = ()


class ToolParser(Protocol):
    name: str
    # WHY: some formats' markers are special tokens ([TOOL_CALLS], <|python_tag|>)
    # that skip_special_tokens would strip before the parser sees them (vLLM's
    # adjust_request sets skip_special_tokens false for these parsers too).
    keeps_special_tokens: bool

    def scan(self, text: str, final: bool = False) -> ToolScan: ...

    def new_call_id(self) -> str: ...


def openai_call_id() -> str:
    """`call_` + 24 hex digits, the shape of OpenAI's tool call ids."""
    return "call_" + uuid.uuid4().hex[:24]


def valid_calls(calls: list[ScannedCall]) -> bool:
    """Every call complete, named, with arguments that are one JSON value."""
    if not calls:
        return False
    for call in calls:
        if not call.complete or not call.name:
            return False
        try:
            json.loads(call.arguments)
        except ValueError:
            return False
    return True


def final_scan(text: str, content: str, calls: list[ScannedCall]) -> ToolScan:
    """The final answer of a scan: the calls if all are valid, else all of the text as content
    (vLLM's parsers return the model output as content when extraction fails)."""
    if valid_calls(calls):
        return ToolScan(content, tuple(calls))
    return ToolScan(text)


__all__ = ["ScannedCall", "ToolParser", "ToolScan", "final_scan", "openai_call_id", "valid_calls"]

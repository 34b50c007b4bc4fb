"""mistral: Mistral tool calls after the [TOOL_CALLS] token, both of its formats.

    tokenizers before v11:  Sure.[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1}}]
    v11 and later:          [TOOL_CALLS]add[ARGS]{"a": 1}[TOOL_CALLS]mul{"b": 2}

Content is the text before [TOOL_CALLS]; ids are 9 letters and digits, as
Mistral's validator requires (vLLM's vllm/tool_parsers/mistral_tool_parser.py
`MistralToolCall.generate_random_id`, `extract_tool_calls`).
"""

from __future__ import annotations

import random
import string

from trillium.data_plane.tool_parsers.json_calls import call_array
from trillium.data_plane.tool_parsers.json_text import partial_tag_overlap, skip_ws, value_end
from trillium.data_plane.tool_parsers.protocol import ScannedCall, ToolScan, final_scan

BOT = "[TOOL_CALLS]"
ARGS = "[ARGS]"
_ALPHANUMERIC = string.ascii_letters + string.digits


class MistralToolParser:
    name = "mistral"
    keeps_special_tokens = True  # [TOOL_CALLS] is a special token

    def new_call_id(self) -> str:
        return "".join(random.choices(_ALPHANUMERIC, k=9))

    def scan(self, text: str, final: bool = False) -> ToolScan:
        first = text.find(BOT)
        if first < 0:
            return ToolScan(text if final else text[:len(text) - partial_tag_overlap(text, BOT)])
        content = text[:first]
        body = skip_ws(text, first + len(BOT))
        try:
            if text.startswith("[", body) and not text.startswith(ARGS, body):
                calls, _ = call_array(text, body, ("arguments",))
            else:
                calls = _named_calls(text, first)
        except ValueError:
            calls = None
        if final:
            return final_scan(text, content, calls or [])
        return ToolScan(content, tuple(calls or ()))


def _named_calls(text: str, first: int) -> list[ScannedCall]:
    """v11+: `[TOOL_CALLS]name[ARGS]{json}` repeated; the name is whole once its `{` is written."""
    calls = []
    for segment_start in _segments(text, first):
        brace = text.find("{", segment_start)
        next_bot = text.find(BOT, segment_start)
        if brace < 0 or (0 <= next_bot < brace):
            break
        name = text[segment_start:brace].replace(ARGS, "").strip()
        end = value_end(text, brace)
        arguments = text[brace:end] if end is not None else text[brace:]
        calls.append(ScannedCall(name or None, arguments, end is not None and bool(name)))
        if end is None:
            break
    return calls


def _segments(text: str, first: int):
    pos = first
    while pos >= 0:
        yield pos + len(BOT)
        pos = text.find(BOT, pos + len(BOT))

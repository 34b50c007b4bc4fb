"""hermes: Hermes 2 Pro / Qwen2.5 / Qwen3 tool calls, JSON between <tool_call> tags.

    Let me check.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Content is the text before the first <tool_call> (vLLM's
vllm/tool_parsers/hermes_tool_parser.py: the same tags, the same content
rule; the whole text is content when a call fails to parse).
"""

from __future__ import annotations

from trillium.data_plane.tool_parsers.json_calls import call_object
from trillium.data_plane.tool_parsers.json_text import partial_tag_overlap, skip_ws
from trillium.data_plane.tool_parsers.protocol import ScannedCall, ToolScan, final_scan, openai_call_id

START = "<tool_call>"
END = "</tool_call>"


class HermesToolParser:
    name = "hermes"
    keeps_special_tokens = True  # <tool_call> is a special token in some tokenizers

    def new_call_id(self) -> str:
        return openai_call_id()

    def scan(self, text: str, final: bool = False) -> ToolScan:
        first = text.find(START)
        if first < 0:
            return ToolScan(text if final else text[:len(text) - partial_tag_overlap(text, START)])
        calls: list[ScannedCall] = []
        pos = first
        try:
            while (tag := text.find(START, pos)) >= 0:
                body = skip_ws(text, tag + len(START))
                if body >= len(text):
                    break
                if text[body] != "{":
                    raise ValueError("a <tool_call> that does not hold a JSON object")
                call, end = call_object(text, body, ("arguments",))
                calls.append(call)
                if end is None:
                    break
                pos = end
        except ValueError:
            if final:
                return ToolScan(text)
        if final:
            return final_scan(text, text[:first], calls)
        return ToolScan(text[:first], tuple(calls))

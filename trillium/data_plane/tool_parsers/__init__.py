"""Tool-call parsers: a model's reply -> content and `tool_calls`, one module per format.

Chosen at start-up with vLLM's flags `--enable-auto-tool-choice
--tool-call-parser NAME` and used for tool_choice "auto"; tool_choice
"required" and a named function use the grammar-enforced formats of
forced.py instead. Each parser implements `protocol.ToolParser.scan`;
tool_stream.py turns scans into OpenAI's message fields and stream deltas.
"""

from __future__ import annotations

from trillium.data_plane.tool_parsers.hermes import HermesToolParser
from trillium.data_plane.tool_parsers.llama3_json import Llama3JsonToolParser
from trillium.data_plane.tool_parsers.mistral import MistralToolParser
from trillium.data_plane.tool_parsers.protocol import ScannedCall, ToolParser, ToolScan
from trillium.data_plane.tool_parsers.pythonic import PythonicToolParser

TOOL_PARSERS: dict[str, type] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "pythonic": PythonicToolParser,
}


def tool_parser(name: str) -> ToolParser:
    return TOOL_PARSERS[name]()


__all__ = ["TOOL_PARSERS", "ScannedCall", "ToolParser", "ToolScan", "tool_parser"]

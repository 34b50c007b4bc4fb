"""A reply's tool calls as OpenAI sends them: whole in `message.tool_calls`, or streamed.

`ToolCallStream.feed(delta)` re-scans the text so far with the request's
parser (tool_parsers/) and returns what is new since the last scan:

    content   text that is surely not part of a call
    deltas    OpenAI's `delta.tool_calls` entries: a call's first entry has
              its `index`, `id`, `type` and `function.name` (arguments "");
              later ones `{"index", "function": {"arguments": <piece>}}`

`finish()` scans the complete reply and sends what the final scan adds.
`message_fields(parser, text)` is the non-streamed answer: content (null
when there are calls) and the `tool_calls` list. With `max_calls` 1
(parallel_tool_calls false) calls after the first are dropped.
"""

from __future__ import annotations

from typing import Any

from trillium.data_plane.tool_parsers.protocol import ToolParser, ToolScan


class ToolCallStream:
    def __init__(self, parser: ToolParser, max_calls: int | None = None) -> None:
        self._parser = parser
        self._max_calls = max_calls
        self._text = ""
        self._sent_content = 0
        self._sent_args: list[str] = []  # per call started, the arguments sent

    @property
    def num_calls(self) -> int:
        return len(self._sent_args)

    def feed(self, delta: str) -> tuple[str, list[dict[str, Any]]]:
        self._text += delta
        return self._diff(self._parser.scan(self._text, final=False))

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        scan = self._parser.scan(self._text, final=True)
        if self._sent_args and not scan.calls:
            return "", []  # WHY: calls already went out; their text is not content after all
        return self._diff(scan)

    def _diff(self, scan: ToolScan) -> tuple[str, list[dict[str, Any]]]:
        content = ""
        if len(scan.content) > self._sent_content and not self._sent_args:
            content = scan.content[self._sent_content:]
            self._sent_content = len(scan.content)
        deltas: list[dict[str, Any]] = []
        calls = scan.calls if self._max_calls is None else scan.calls[:self._max_calls]
        for index, call in enumerate(calls):
            if index == len(self._sent_args):
                if call.name is None:
                    break
                deltas.append({"index": index, "id": self._parser.new_call_id(), "type": "function",
                               "function": {"name": call.name, "arguments": ""}})
                self._sent_args.append("")
            sent = self._sent_args[index]
            if len(call.arguments) > len(sent) and call.arguments.startswith(sent):
                deltas.append({"index": index, "function": {"arguments": call.arguments[len(sent):]}})
                self._sent_args[index] = call.arguments
        return content, deltas


def message_fields(parser: ToolParser, text: str, max_calls: int | None = None) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a whole reply."""
    scan = parser.scan(text, final=True)
    calls = scan.calls if max_calls is None else scan.calls[:max_calls]
    tool_calls = [{"id": parser.new_call_id(), "type": "function",
                   "function": {"name": call.name, "arguments": call.arguments}} for call in calls]
    if tool_calls:
        return (scan.content or None), tool_calls
    return scan.content, []


__all__ = ["ToolCallStream", "message_fields"]

"""A streamed Messages reply as Anthropic's server-sent events.

Every event is named and typed (`event: <type>\\ndata: {"type": <type>, ...}`),
in Anthropic's order:

    message_start          the message with empty content and the prompt's usage
    ping
    content_block_start    a thinking, text or tool_use block opens at the next index
    content_block_delta    thinking_delta | text_delta | input_json_delta (a tool_use's input, as JSON text)
    content_block_stop     (a thinking block gets its signature_delta first)
    ...                    one block at a time: a new kind of piece closes the open block
    message_delta          stop_reason, stop_sequence, usage (output_tokens)
    message_stop

`BlockEvents.feed(fields)` takes one delta's fields as the chat path's
`ChoiceReply.feed` gives them (`reasoning_content`, `content`, OpenAI
`tool_calls` delta entries) and returns the events to send; `close()` ends
the open block. A tool call's first entry (it has an `id`) opens its
tool_use block; its argument pieces go to that block's index, as vLLM's
message_stream_converter does (vllm/entrypoints/anthropic/serving.py). No
`data: [DONE]`: Anthropic's stream ends with message_stop. An error after
the headers went out is an `error` event with Anthropic's error body.
"""

from __future__ import annotations

import json
from typing import Any

from trillium.data_plane.anthropic_messages import new_signature


def sse(kind: str, data: dict[str, Any]) -> bytes:
    body = json.dumps({"type": kind, **data}, ensure_ascii=False, separators=(",", ":"))
    return f"event: {kind}\ndata: {body}\n\n".encode()


class BlockEvents:
    def __init__(self) -> None:
        self._num_blocks = 0
        self._open: str | None = None  # the open block's type
        self._call_blocks: dict[int, int] = {}  # a tool call's index -> its block's index

    def feed(self, fields: dict[str, Any]) -> list[bytes]:
        events: list[bytes] = []
        reasoning = fields.get("reasoning_content")
        if reasoning:
            events += self._piece("thinking", {"type": "thinking", "thinking": ""},
                                  {"type": "thinking_delta", "thinking": reasoning})
        content = fields.get("content")
        if content:
            events += self._piece("text", {"type": "text", "text": ""}, {"type": "text_delta", "text": content})
        for entry in fields.get("tool_calls") or ():
            function = entry.get("function") or {}
            if "id" in entry:
                events += self.close()
                block = {"type": "tool_use", "id": entry["id"], "name": function.get("name"), "input": {}}
                events.append(self._start("tool_use", block))
                self._call_blocks[entry["index"]] = self._num_blocks - 1
            arguments = function.get("arguments")
            if arguments and entry["index"] in self._call_blocks:
                delta = {"type": "input_json_delta", "partial_json": arguments}
                events.append(sse("content_block_delta", {"index": self._call_blocks[entry["index"]],
                                                          "delta": delta}))
        return events

    def close(self) -> list[bytes]:
        """End the open block, if any."""
        if self._open is None:
            return []
        index = self._num_blocks - 1
        events = []
        if self._open == "thinking":
            delta = {"type": "signature_delta", "signature": new_signature()}
            events.append(sse("content_block_delta", {"index": index, "delta": delta}))
        events.append(sse("content_block_stop", {"index": index}))
        self._open = None
        return events

    def _piece(self, kind: str, block: dict, delta: dict) -> list[bytes]:
        events = []
        if self._open != kind:
            events += self.close()
            events.append(self._start(kind, block))
        events.append(sse("content_block_delta", {"index": self._num_blocks - 1, "delta": delta}))
        return events

    def _start(self, kind: str, block: dict) -> bytes:
        self._open = kind
        self._num_blocks += 1
        return sse("content_block_start", {"index": self._num_blocks - 1, "content_block": block})


__all__ = ["BlockEvents", "sse"]

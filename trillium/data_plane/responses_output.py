"""A chat reply as a Responses API `Response`: output items, whole or as the typed event stream.

Output items (OpenAI's openai/types/responses; vLLM's vllm/entrypoints/
openai/responses/utils.py `build_response_output_items`), in this order:

    {"type": "reasoning", "id": "rs_..", "summary": [], "content": [{"type": "reasoning_text", "text"}]}
                                   the thinking, with a --reasoning-parser
    {"type": "message", "id": "msg_..", "role": "assistant", "status",
     "content": [{"type": "output_text", "text", "annotations": [], "logprobs": []}]}
                                   the answer, when it is not empty
    {"type": "function_call", "id": "fc_..", "call_id", "name", "arguments", "status"}
                                   one per tool call the reply makes

Status: "completed"; "incomplete" with incomplete_details.reason
"max_output_tokens" when the reply ran out of tokens; "cancelled" /
"failed" for a background response cancelled or failed.

`ResponseEvents` turns a `ChoiceReply`'s streamed fields into the typed SSE
events (`event: <type>` + `data: {..., "sequence_number": n}`; no [DONE]):
response.created, response.in_progress; per item response.output_item.added,
(text items) response.content_part.added, response.output_text.delta /
response.reasoning_text.delta ..., the matching .done, response.content_part.done,
(calls) response.function_call_arguments.delta ... .done; then
response.output_item.done; last response.completed (response.incomplete,
response.failed for those statuses) carrying the whole response, whose
items are the streamed ones (same ids), as the openai SDK's stream checks.
"""

from __future__ import annotations

import copy
import time
import uuid
from typing import Any

from trillium.data_plane.streaming import dumps

_TERMINAL_EVENTS = {"completed": "response.completed", "incomplete": "response.incomplete"}


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def echo_fields(req, response_id: str, model: str, params, store: bool, effort: str | None) -> dict[str, Any]:
    """The Response object's fields that repeat the request (`params`: the engine's SamplingParams)."""
    return {
        "id": response_id, "object": "response", "created_at": int(time.time()), "model": model,
        "status": "in_progress", "error": None, "incomplete_details": None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": effort, "summary": None},
        "store": store, "background": bool(req.background),
        "temperature": params.temperature, "top_p": params.top_p,
        "text": {"format": (req.text or {}).get("format") or {"type": "text"}},
        "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
        "tools": req.tools or [], "truncation": "disabled", "user": req.user, "metadata": req.metadata or {},
        "output": [], "usage": None,
    }


def status_of(finish_reason: str | None) -> tuple[str, dict | None]:
    """(status, incomplete_details) of a reply that finished for `finish_reason`."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if finish_reason == "abort":
        return "cancelled", None
    return "completed", None


def usage(num_input: int, num_cached: int, num_output: int, num_reasoning: int) -> dict[str, Any]:
    return {"input_tokens": num_input, "input_tokens_details": {"cached_tokens": num_cached},
            "output_tokens": num_output, "output_tokens_details": {"reasoning_tokens": num_reasoning},
            "total_tokens": num_input + num_output}


def finished(base: dict, status: str, incomplete: dict | None, output: list[dict], counts: dict | None,
             error: dict | None = None) -> dict[str, Any]:
    return {**base, "status": status, "incomplete_details": incomplete, "output": output, "usage": counts,
            "error": error}


def _message_item(text: str, status: str, ident: str | None = None) -> dict[str, Any]:
    return {"id": ident or item_id("msg"), "type": "message", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _reasoning_item(text: str, status: str, ident: str | None = None) -> dict[str, Any]:
    return {"id": ident or item_id("rs"), "type": "reasoning", "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def output_items(message: dict[str, Any], status: str) -> list[dict[str, Any]]:
    """The items of a whole reply (`message`: `ChoiceReply.message()`'s fields)."""
    items = []
    if message.get("reasoning_content"):
        items.append(_reasoning_item(message["reasoning_content"], "completed"))
    if message.get("content"):
        items.append(_message_item(message["content"], status))
    for call in message.get("tool_calls") or ():
        items.append({"id": item_id("fc"), "type": "function_call", "call_id": call["id"],
                      "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                      "status": "completed"})
    return items


class ResponseEvents:
    """The event stream of one response; `output` holds its items as streamed."""

    def __init__(self, base: dict[str, Any]) -> None:
        self.base = base
        self.output: list[dict[str, Any]] = []
        self._sequence = 0
        self._open: dict[str, Any] | None = None  # the reasoning / message item receiving text
        self._text: list[str] = []  # that item's text so far
        self._calls: dict[int, dict[str, Any]] = {}  # the chat delta's tool call index -> its item

    def event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + dumps(data).encode() + b"\n\n"

    def start(self) -> list[bytes]:
        return [self.event("response.created", response=self.base),
                self.event("response.in_progress", response=self.base)]

    def feed(self, fields: dict[str, Any]) -> list[bytes]:
        """Events for one streamed delta's fields (chat's reasoning_content, content, tool_calls)."""
        events: list[bytes] = []
        if fields.get("reasoning_content"):
            events += self._add_text("reasoning", fields["reasoning_content"])
        if fields.get("content"):
            events += self._add_text("message", fields["content"])
        for entry in fields.get("tool_calls") or ():
            events += self._add_call(entry)
        return events

    def finish(self, status: str, incomplete: dict | None, counts: dict | None) -> tuple[list[bytes], dict]:
        """The closing events and the final Response object."""
        events = self._close_text("incomplete" if status == "incomplete" else "completed")
        for index in sorted(self._calls):
            item = self._calls[index]
            item["status"] = "completed"
            position = self.output.index(item)
            events.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                     output_index=position, name=item["name"], arguments=item["arguments"]))
            events.append(self.event("response.output_item.done", output_index=position, item=item))
        response = finished(self.base, status, incomplete, self.output, counts)
        events.append(self.event(_TERMINAL_EVENTS.get(status, "response.failed"), response=response))
        return events, response

    def _add_text(self, kind: str, piece: str) -> list[bytes]:
        events: list[bytes] = []
        if self._open is None or self._open["type"] != kind:
            events += self._close_text("completed")
            item = _reasoning_item("", "in_progress") if kind == "reasoning" else _message_item("", "in_progress")
            events += self._open_item(item)
            part = copy.deepcopy(item["content"][0])
            events.append(self.event("response.content_part.added", item_id=item["id"],
                                     output_index=len(self.output) - 1, content_index=0, part=part))
            self._open, self._text = item, []
        self._text.append(piece)
        position = len(self.output) - 1
        if kind == "message":
            events.append(self.event("response.output_text.delta", item_id=self._open["id"], output_index=position,
                                     content_index=0, delta=piece, logprobs=[]))
        else:
            events.append(self.event("response.reasoning_text.delta", item_id=self._open["id"],
                                     output_index=position, content_index=0, delta=piece))
        return events

    def _close_text(self, status: str) -> list[bytes]:
        item, self._open = self._open, None
        if item is None:
            return []
        text = "".join(self._text)
        position = self.output.index(item)
        item["status"] = status
        item["content"][0]["text"] = text
        done = "response.output_text.done" if item["type"] == "message" else "response.reasoning_text.done"
        extra = {"logprobs": []} if item["type"] == "message" else {}
        return [self.event(done, item_id=item["id"], output_index=position, content_index=0, text=text, **extra),
                self.event("response.content_part.done", item_id=item["id"], output_index=position,
                           content_index=0, part=item["content"][0]),
                self.event("response.output_item.done", output_index=position, item=item)]

    def _open_item(self, item: dict[str, Any]) -> list[bytes]:
        self.output.append(item)
        return [self.event("response.output_item.added", output_index=len(self.output) - 1,
                           item=copy.deepcopy(item))]

    def _add_call(self, entry: dict[str, Any]) -> list[bytes]:
        events: list[bytes] = []
        index = entry["index"]
        function = entry.get("function") or {}
        if index not in self._calls:
            events += self._close_text("completed")
            item = {"id": item_id("fc"), "type": "function_call", "call_id": entry["id"],
                    "name": function["name"], "arguments": "", "status": "in_progress"}
            self._calls[index] = item
            events += self._open_item(item)
        item = self._calls[index]
        piece = function.get("arguments") or ""
        if piece:
            item["arguments"] += piece
            events.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                     output_index=self.output.index(item), delta=piece))
        return events


__all__ = ["ResponseEvents", "echo_fields", "finished", "item_id", "output_items", "status_of", "usage"]

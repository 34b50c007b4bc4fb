"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API on the chat path.

The body (anthropic_protocol.py) becomes the chat route's own
`ChatCompletionRequest` (anthropic_messages.chat_request), which then takes
the chat route's steps: sampling params, the tool plan (a `tool` or `any`
tool_choice is the chat path's named / required grammar), the chat template,
the reply format (reasoning parser, tool parser) and admission. Each reply
is read by a `ChoiceReply` and written back as Anthropic's message
(`{"id": "msg_...", "type": "message", "role": "assistant", "content":
[blocks], "stop_reason", "stop_sequence", "usage"}`), or streamed as
Anthropic's events (anthropic_stream.py). count_tokens renders the same
prompt and answers `{"input_tokens": N}`, the `usage.input_tokens` the
same request to /v1/messages reports.

The query may carry `beta=true` (Anthropic's beta clients) and nothing else.
Errors on both routes are Anthropic's shape (app.py renders them by path;
a stream's later error is an `error` event). With --api-key both take the
key as `x-api-key` or `Authorization: Bearer`. The response carries
`X-Weight-Version` and `X-Request-Id`, as the chat route's does; the message id is
`msg_<X-Request-Id>` (a fresh id when the client sent none).
"""

from __future__ import annotations

import contextlib
import logging

import trio
from quart import Blueprint, request

from trillium.actors.client import EngineFailed
from trillium.data_plane.anthropic_messages import (
    chat_request,
    content_blocks,
    error_body,
    message_id,
    stop_reason,
    usage,
)
from trillium.data_plane.anthropic_protocol import CountTokensRequest, MessagesRequest
from trillium.data_plane.anthropic_stream import BlockEvents, sse
from trillium.data_plane.chat_reply import ChoiceReply, ReplyFormat
from trillium.data_plane.chat_turn import render_chat_prompt, start_chat_turn
from trillium.data_plane.errors import ApiError, bad_request, engine_failed, internal_error, rejection_error
from trillium.data_plane.generation import Generation
from trillium.data_plane.protocol import parse_request
from trillium.data_plane.rollout_fields import REQUEST_ID_HEADER, RequestIds
from trillium.data_plane.state import WEIGHT_VERSION_HEADER, AppState
from trillium.data_plane.streaming import json_response, sse_response
from trillium.data_plane.tool_choice import plan_tools

log = logging.getLogger(__name__)

# Engine / chat parameter names -> the Messages API's, for error params.
_RENAMES = {"prompt": "messages", "prompt_token_ids": "messages", "stop": "stop_sequences"}


class _Message:
    """One reply being built: its id, model, prompt size and reading of the text."""

    def __init__(self, message_id: str, model: str, num_prompt_tokens: int, reply: ReplyFormat,
                 max_tokens: int) -> None:
        self.id = message_id
        self.model = model
        self.num_prompt_tokens = num_prompt_tokens
        self.reply = ChoiceReply(reply)
        self.max_tokens = max_tokens

    def head(self) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                "stop_reason": None, "stop_sequence": None, "usage": usage(self.num_prompt_tokens, 0)}

    def ending(self, generation: Generation, called_tools: bool) -> dict:
        """stop_reason, stop_sequence and usage of the finished reply."""
        choice = generation.choices[0]
        reason, sequence = stop_reason(choice.finish_reason, choice.stop_reason, called_tools,
                                       choice.num_generated_tokens, self.max_tokens)
        return {"stop_reason": reason, "stop_sequence": sequence,
                "usage": usage(self.num_prompt_tokens, choice.num_generated_tokens)}


def blueprint(state: AppState) -> Blueprint:
    bp = Blueprint("messages", __name__)

    @bp.post("/v1/messages")
    async def create_message():
        _check_query()
        req = parse_request(MessagesRequest, await request.get_data())
        chat = chat_request(req, state.engine.chat)
        ids = RequestIds("msg", request.headers, None)
        turn = await start_chat_turn(state, chat, ids, _RENAMES, stream=bool(req.stream))
        generation = turn.generation
        message = _Message(message_id(ids.base), turn.model, len(turn.prompt_ids), turn.reply, req.max_tokens)
        if req.stream:
            response = sse_response(_guarded(_stream(state, generation, message)))
        else:
            response = await _respond(generation, message)
        response.headers[WEIGHT_VERSION_HEADER] = generation.weight_version
        response.headers[REQUEST_ID_HEADER] = ids.base
        return response

    @bp.post("/v1/messages/count_tokens")
    async def count_tokens():
        _check_query()
        req = parse_request(CountTokensRequest, await request.get_data())
        chat = chat_request(req, state.engine.chat)
        state.resolve_model(req.model)
        # WHY "none": counting needs the tools in the template, not a tool parser or grammar.
        tools = plan_tools(chat.tools, "none", None, state.engine.chat)
        _, prompt_ids = await render_chat_prompt(state, chat, tools)
        return json_response({"input_tokens": len(prompt_ids)})

    return bp


def _check_query() -> None:
    """`?beta=true` (the SDK's beta client, Claude Code) is accepted: a beta feature arrives as a body
    field, refused there unless implemented. Any other query parameter is a 400 naming it."""
    for name, value in request.args.items(multi=True):
        if not (name == "beta" and value == "true"):
            raise bad_request(f"{name}: unknown query parameter (only beta=true is accepted)", name)


async def _respond(generation: Generation, message: _Message):
    async with trio.open_nursery() as nursery:
        async with generation.feed(nursery) as feed:
            async for _, delta in feed:
                message.reply.record(delta.text, delta.new_token_ids)
    rejected = [c.rejection for c in generation.choices if c.rejection]
    if rejected:
        raise rejection_error(rejected[0])
    fields, called_tools = message.reply.message()
    return json_response({**message.head(), "content": content_blocks(fields),
                          **message.ending(generation, called_tools)})


async def _stream(state: AppState, generation: Generation, message: _Message):
    blocks = BlockEvents()
    # WHY inside the feed: a client that leaves at any yield must abort the engine request.
    async with generation.feed(state.nursery) as feed:
        yield sse("message_start", {"message": message.head()})
        yield sse("ping", {})
        async for choice, delta in feed:
            if choice.rejection:
                yield _error_event(rejection_error(choice.rejection))
                return
            fields = message.reply.feed_last(delta.text, delta.new_token_ids, delta.finished)
            for event in blocks.feed(fields):
                yield event
        if not generation.finished:
            yield _error_event(internal_error())
            return
    for event in blocks.close():
        yield event
    ending = message.ending(generation, message.reply.called_tools)
    yield sse("message_delta", {"delta": {"stop_reason": ending["stop_reason"],
                                          "stop_sequence": ending["stop_sequence"]}, "usage": ending["usage"]})
    yield sse("message_stop", {})


def _error_event(error: ApiError) -> bytes:
    return sse("error", {"error": error_body(error)["error"]})


async def _guarded(body):
    """Anthropic's `error` event for a failure after the headers went out (streaming._guarded's role)."""
    async with contextlib.aclosing(body) as events:
        try:
            async for item in events:
                yield item
        except EngineFailed as exc:
            yield _error_event(engine_failed(str(exc)))
        except Exception:
            log.exception("error while streaming a message")
            yield _error_event(internal_error())


"""OpenAI's Responses API: POST /v1/responses, GET / DELETE /v1/responses/{id}, POST .../cancel.

A body becomes the chat request the chat route would run
(responses_request.py) and goes through the same steps as
/v1/chat/completions (chat_turn.py, shared with routes/chat.py): chat template, sampling params, tool
plan, reasoning split, structured-output constraint, admission. Its reply
is read by a `ChoiceReply` and written as Response output items, whole or
as the typed event stream (responses_output.py); greedy, both APIs answer
a conversation with the same text.

Store (responses_store.py, --responses-store-size): with `store` (default
true while the store has room) the finished response is kept; GET returns
it, `previous_response_id` continues its conversation (its messages and
output; its reasoning is not carried, as vLLM's
vllm/entrypoints/openai/responses/utils.py `construct_input_messages`).
An unknown or evicted id is a 404 "Response with id '...' not found."

Background (`background: true`, needs store; vLLM's serving.py): the
response is returned at once with status "queued" and runs in the app's
nursery; GET reports its progress, POST .../cancel aborts it (status
"cancelled"). Cancelling a response that is not running in the background
is vLLM's 400 "Cannot cancel a synchronous response.". background with
stream, and GET with stream / starting_after, are 400s.
"""

from __future__ import annotations

import logging
import re

import trio
from quart import Blueprint, request

from trillium.actors.client import EngineFailed
from trillium.data_plane.chat_reply import ChoiceReply
from trillium.data_plane.chat_turn import start_chat_turn
from trillium.data_plane.errors import ApiError, bad_request, internal_error, rejection_error
from trillium.data_plane.protocol import ChatCompletionRequest, parse_request
from trillium.data_plane.responses_output import (
    ResponseEvents, echo_fields, finished, item_id, output_items, status_of, usage)
from trillium.data_plane.responses_request import ResponsesRequest, chat_request, conversation, reasoning_effort
from trillium.data_plane.responses_store import ResponseStore, StoredResponse
from trillium.data_plane.rollout_fields import REQUEST_ID_HEADER, RequestIds
from trillium.data_plane.state import WEIGHT_VERSION_HEADER, AppState
from trillium.data_plane.streaming import error_event, json_response, sse_response

log = logging.getLogger(__name__)

# Engine parameter names (check_prompt) and chat wire names (the chat steps' 400s) -> this API's.
_ENGINE_RENAMES = {"prompt": "input", "prompt_token_ids": "input", "max_tokens": "max_output_tokens",
                   "logprobs": "top_logprobs"}
_CHAT_RENAMES = (
    (re.compile(r"^messages\b.*"), "input"),
    (re.compile(r"^max_completion_tokens$"), "max_output_tokens"),
    (re.compile(r"^response_format\.json_schema\.schema$"), "text.format.schema"),
    (re.compile(r"^response_format.*"), "text.format"),
    (re.compile(r"^reasoning_effort$"), "reasoning.effort"),
    (re.compile(r"^(tools\[\d+\])\.function"), r"\1"),
)


def _renamed(error: ApiError) -> ApiError:
    """A chat step's 400 with the parameter named as this API names it."""
    old = error.param
    if old is None:
        return error
    for pattern, replacement in _CHAT_RENAMES:
        if pattern.match(old):
            error.param = pattern.sub(replacement, old)
            if error.message.startswith(old + ":"):
                error.message = error.param + error.message[len(old):]
            break
    return error


class _Turn:
    """One submitted response: its generation, reply reader and what its Response object echoes."""

    def __init__(self, generation, reply_format, prompt_ids: list[int], base: dict) -> None:
        self.generation = generation
        self.reply = ChoiceReply(reply_format)
        self.prompt_ids = prompt_ids
        self.base = base

    def usage(self) -> dict:
        choice = self.generation.choices[0]
        return usage(len(self.prompt_ids), choice.num_cached_tokens, choice.num_generated_tokens,
                     self.reply.reasoning_tokens)


async def _submit(state: AppState, req: ResponsesRequest, chat: ChatCompletionRequest, response_id: str,
                  ids: RequestIds, store: bool) -> _Turn:
    """The chat path's steps (chat_turn.py) for `chat`, and what the Response echoes."""
    turn = await start_chat_turn(state, chat, ids, _ENGINE_RENAMES, stream=bool(req.stream))
    base = echo_fields(req, response_id, turn.model, turn.params, store, reasoning_effort(req.reasoning))
    base["weight_version"] = turn.generation.weight_version  # as chat's bodies report it (routes/chat.py)
    return _Turn(turn.generation, turn.reply, turn.prompt_ids, base)


async def _collect(turn: _Turn) -> dict:
    """The whole Response of a non-streamed turn."""
    async with trio.open_nursery() as nursery:
        async with turn.generation.feed(nursery) as feed:
            async for _, delta in feed:
                turn.reply.record(delta.text, delta.new_token_ids)
    choice = turn.generation.choices[0]
    if choice.rejection:
        raise rejection_error(choice.rejection)
    message, _ = turn.reply.message()
    status, incomplete = status_of(choice.finish_reason)
    return finished(turn.base, status, incomplete, output_items(message, status), turn.usage())


async def _stream(state: AppState, turn: _Turn, store: ResponseStore | None, messages: list[dict]):
    events = ResponseEvents(turn.base)
    for event in events.start():
        yield event
    async with turn.generation.feed(state.nursery) as feed:
        async for choice, delta in feed:
            if choice.rejection:
                yield error_event(rejection_error(choice.rejection))
                return
            for event in events.feed(turn.reply.feed_last(delta.text, delta.new_token_ids, delta.finished)):
                yield event
    if not turn.generation.finished:
        yield error_event(internal_error())
        return
    status, incomplete = status_of(turn.generation.choices[0].finish_reason)
    closing, response = events.finish(status, incomplete, turn.usage())
    if store is not None:
        store.put(response["id"], StoredResponse(response, messages))
    for event in closing:
        yield event


async def _run_background(turn: _Turn, entry: StoredResponse, scope: trio.CancelScope) -> None:
    """A background response's run in the app's nursery; never raises (the app's nursery must live)."""
    with scope:
        if entry.response["status"] == "queued":  # WHY the check: it may have been cancelled before it ran
            entry.response = {**entry.response, "status": "in_progress"}
        try:
            result = await _collect(turn)
        except ApiError as exc:
            result = finished(turn.base, "failed", None, [], None, {"code": exc.code or exc.type,
                                                                     "message": exc.message})
        except EngineFailed as exc:
            result = finished(turn.base, "failed", None, [], None, {"code": "engine_failed", "message": str(exc)})
        except Exception:
            log.exception("background response %s failed", turn.base["id"])
            result = finished(turn.base, "failed", None, [], None, {"code": "server_error",
                                                                     "message": "The server had an internal error."})
        if entry.response["status"] != "cancelled":
            entry.response = result
    entry.cancel = None
    # WHY: a run cancelled before it read its generation never entered `feed`, whose exit aborts it.
    await turn.generation.abort_unfinished()


def _not_found(response_id: str, param: str | None = None) -> ApiError:
    return ApiError(404, f"Response with id '{response_id}' not found.", param=param)


def _store_flag(req: ResponsesRequest, store: ResponseStore) -> bool:
    if req.store and not store.enabled:
        raise bad_request("store: this server keeps no responses (--responses-store-size 0)", "store")
    keep = store.enabled if req.store is None else req.store
    if req.background and not keep:
        raise bad_request("background: can only be used when `store` is true", "background")
    if req.background and req.stream:
        raise bad_request("background: streaming a background response is not supported", "background")
    return keep


def _history(req: ResponsesRequest, store: ResponseStore) -> tuple[list[dict] | None, list[dict] | None]:
    """The stored conversation and output `previous_response_id` continues."""
    if req.previous_response_id is None:
        return None, None
    entry = store.get(req.previous_response_id)
    if entry is None:
        raise _not_found(req.previous_response_id, "previous_response_id")
    if entry.running:
        raise bad_request(f"previous_response_id: response '{req.previous_response_id}' is still "
                          f"{entry.response['status']}", "previous_response_id")
    return entry.messages, entry.response["output"]


def _check_retrieve_query() -> None:
    for name, value in request.args.items():
        if not (name == "stream" and value == "false"):
            raise bad_request(f"{name}: query parameter is not supported", name)


def blueprint(state: AppState) -> Blueprint:
    bp = Blueprint("responses", __name__)
    store = ResponseStore(state.engine.responses_store_size)

    @bp.post("/v1/responses")
    async def create_response():
        req = parse_request(ResponsesRequest, await request.get_data())
        keep = _store_flag(req, store)
        history, previous_output = _history(req, store)
        messages = conversation(req, history, previous_output)
        response_id = item_id("resp")
        ids = RequestIds("resp", request.headers, None)
        try:
            turn = await _submit(state, req, chat_request(req, messages), response_id, ids, keep)
        except ApiError as exc:
            raise _renamed(exc) from None
        if req.background:
            scope = trio.CancelScope()
            entry = StoredResponse({**turn.base, "status": "queued"}, messages, scope)
            store.put(response_id, entry)
            state.nursery.start_soon(_run_background, turn, entry, scope)
            response = json_response(entry.response)
        elif req.stream:
            response = sse_response(_stream(state, turn, store if keep else None, messages))
        else:
            body = await _collect(turn)
            if keep:
                store.put(response_id, StoredResponse(body, messages))
            response = json_response(body)
        response.headers[WEIGHT_VERSION_HEADER] = turn.generation.weight_version
        response.headers[REQUEST_ID_HEADER] = ids.base
        return response

    @bp.get("/v1/responses/<response_id>")
    async def retrieve_response(response_id: str):
        _check_retrieve_query()
        entry = store.get(response_id)
        if entry is None:
            raise _not_found(response_id)
        return json_response(entry.response)

    @bp.delete("/v1/responses/<response_id>")
    async def delete_response(response_id: str):
        if not store.delete(response_id):
            raise _not_found(response_id)
        return json_response({"id": response_id, "object": "response.deleted", "deleted": True})

    @bp.post("/v1/responses/<response_id>/cancel")
    async def cancel_response(response_id: str):
        entry = store.get(response_id)
        if entry is None:
            raise _not_found(response_id)
        if entry.cancel is None or not entry.running:
            raise bad_request("Cannot cancel a synchronous response.")
        entry.response = {**entry.response, "status": "cancelled"}
        entry.cancel.cancel()
        return json_response(entry.response)

    return bp

"""POST /v1/chat/completions: the model's chat template over `messages`, OpenAI's format.

The conversation is rendered with the tokenizer's chat template
(`add_generation_prompt` true unless the client says otherwise) and
encoded without extra special tokens (the template supplies them). Without
max_tokens / max_completion_tokens a reply may run to the end of the
context. Streamed replies start each choice with a `{"role": "assistant"}`
delta, send content deltas, end each choice with a chunk carrying its
finish_reason, then (with stream_options.include_usage) a usage chunk and
`[DONE]`.

The request-start steps (template, sampling params, tools, constraint,
truncation, bad_words, admission) are chat_turn.py's, shared with
/v1/responses and /v1/messages; this route keeps the chat wire format.

Every response reports the weight version current when it was admitted:
`weight_version` in the body (in each chunk when streamed) and the
`X-Weight-Version` header.

vLLM's rollout fields (rollout_fields.py; vllm/entrypoints/openai/
chat_completion/serving.py): `continue_final_message` renders the last
message open for the model to continue (the reply's role is then that
message's); `return_token_ids` adds `prompt_token_ids` to the response (to
the first chunks when streamed) and `token_ids` to each choice (chunk);
`prompt_logprobs` adds the prompt's logprobs to the response;
`return_tokens_as_token_ids` writes logprob tokens as "token_id:N";
`usage.prompt_tokens_details.cached_tokens` counts prefix-cache hits.

Tools, tool_choice and reasoning (tool_choice.py, chat_reply.py): the
request's tools go to the template; each choice's text runs through a
`ChoiceReply` that splits off the thinking (--reasoning-parser) and reads
tool calls (--tool-call-parser, or the grammar-forced formats of "required"
and a named function), giving `reasoning_content` / `reasoning`,
`tool_calls` and finish_reason "tool_calls", streamed as their own deltas.
"""

from __future__ import annotations

import time

import trio
from quart import Blueprint, request

from trillium.data_plane.chat_reply import ChoiceReply, ReplyFormat, finish_reason
from trillium.data_plane.chat_turn import start_chat_turn
from trillium.data_plane.errors import internal_error, rejection_error
from trillium.data_plane.generation import Choice, Generation
from trillium.data_plane.logprobs import chat_logprobs
from trillium.data_plane.protocol import ChatCompletionRequest, parse_request
from trillium.data_plane.rollout_fields import REQUEST_ID_HEADER, RequestIds, logprob_token_text, prompt_logprobs_json
from trillium.data_plane.sampling import chat_renames
from trillium.data_plane.state import WEIGHT_VERSION_HEADER, AppState
from trillium.data_plane.streaming import DONE, ChunkEvents, error_event, event, json_response, sse_response, usage


class _Chat:
    """One response being built: ids, the prompt, each choice's text and logprobs."""

    def __init__(self, state: AppState, req: ChatCompletionRequest, ids: RequestIds, model: str,
                 prompt_ids: list[int], role: str, reply: ReplyFormat) -> None:
        self.id = ids.response_id
        self.created = int(time.time())
        self.model = model
        self.prompt_ids = prompt_ids
        self.role = role  # of the reply: "assistant", or the continued message's
        self.include_usage = req.include_usage
        self.num_top = (req.top_logprobs or 0) if req.logprobs else None
        self.return_token_ids = bool(req.return_token_ids)
        self.num_prompt_top = req.prompt_logprobs
        self._text = state.tokenizer.token_text
        self._token_text = logprob_token_text(state.tokenizer.token_text, req.return_tokens_as_token_ids)
        self._bytes_text = state.tokenizer.token_text if req.return_tokens_as_token_ids else None
        self.weight_version: str | None = None  # set at admission
        self.texts: dict[int, list[str]] = {}
        self.token_ids: dict[int, list[int]] = {}
        self.logprobs: dict[int, list[dict]] = {}
        self.prompt_logprobs = None  # the engine's PromptLogprobs (first choice's first delta)
        self.reply = reply
        self.replies: dict[int, ChoiceReply] = {}

    def choice_reply(self, index: int) -> ChoiceReply:
        if index not in self.replies:
            self.replies[index] = ChoiceReply(self.reply)
        return self.replies[index]

    def add(self, choice: Choice, delta) -> list[dict] | None:
        """Record a delta; returns its logprob entries (None when not asked for)."""
        self.texts.setdefault(choice.index, []).append(delta.text)
        self.token_ids.setdefault(choice.index, []).extend(delta.new_token_ids)
        if choice.index == 0 and delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if self.num_top is None:
            return None
        entries = chat_logprobs(delta.logprobs, self._token_text, self.num_top, self._bytes_text)
        self.logprobs.setdefault(choice.index, []).extend(entries)
        return entries

    def header(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None, "weight_version": self.weight_version}

    def usage(self, generation: Generation) -> dict:
        cached = next((c.num_cached_tokens for c in generation.choices if c.index == 0), 0)
        counts = usage(len(self.prompt_ids), sum(c.num_generated_tokens for c in generation.choices), cached)
        if self.reply.reports_reasoning:
            reasoning = sum(r.reasoning_tokens for r in self.replies.values())
            counts["completion_tokens_details"] = {"reasoning_tokens": reasoning}
        return counts

    def response_extras(self) -> dict:
        """vLLM's response-level extras of a non-streamed reply (null unless asked for)."""
        prompt_logprobs = None
        if self.num_prompt_top is not None:
            prompt_logprobs = prompt_logprobs_json(self.prompt_ids, self.prompt_logprobs, self.num_prompt_top,
                                                   self._text)
        return {"prompt_logprobs": prompt_logprobs,
                "prompt_token_ids": self.prompt_ids if self.return_token_ids else None}


def blueprint(state: AppState) -> Blueprint:
    bp = Blueprint("chat", __name__)

    @bp.post("/v1/chat/completions")
    async def create_chat_completion():
        req = parse_request(ChatCompletionRequest, await request.get_data())
        ids = RequestIds("chatcmpl", request.headers, req.request_id)
        turn = await start_chat_turn(state, req, ids, chat_renames(req), stream=bool(req.stream))
        # vLLM's get_chat_request_role: without a generation prompt the reply continues the last message.
        role = state.engine.response_role if turn.add_generation_prompt else req.messages[-1].role
        chat = _Chat(state, req, ids, turn.model, turn.prompt_ids, role, turn.reply)
        generation = turn.generation
        chat.weight_version = generation.weight_version
        if req.stream:
            response = sse_response(_stream(state, generation, chat))
        else:
            response = await _respond(generation, chat)
        response.headers[WEIGHT_VERSION_HEADER] = generation.weight_version
        response.headers[REQUEST_ID_HEADER] = ids.base
        return response

    return bp


async def _respond(generation: Generation, chat: _Chat):
    async with trio.open_nursery() as nursery:
        async with generation.feed(nursery) as feed:
            async for choice, delta in feed:
                chat.add(choice, delta)
                chat.choice_reply(choice.index).record(delta.text, delta.new_token_ids)
    rejected = [c.rejection for c in generation.choices if c.rejection]
    if rejected:
        raise rejection_error(rejected[0])
    choices = []
    for choice in sorted(generation.choices, key=lambda c: c.index):
        message, called_tools = chat.choice_reply(choice.index).message()
        choices.append({
            "index": choice.index,
            "message": {"role": chat.role, **message},
            "logprobs": {"content": chat.logprobs.get(choice.index, [])} if chat.num_top is not None else None,
            "finish_reason": finish_reason(choice.finish_reason, called_tools),
            "stop_reason": choice.stop_reason,
            "token_ids": chat.token_ids.get(choice.index, []) if chat.return_token_ids else None,
        })
    return json_response({**chat.header("chat.completion"), "choices": choices, "usage": chat.usage(generation),
                          **chat.response_extras()})


async def _stream(state: AppState, generation: Generation, chat: _Chat):
    header = chat.header("chat.completion.chunk")
    extra = {"usage": None} if chat.include_usage else {}
    chunk = ChunkEvents(header, extra)
    async with generation.feed(state.nursery) as feed:
        # vLLM sends the prompt's token ids with these first chunks, one per choice.
        prompt_ids = {"prompt_token_ids": chat.prompt_ids} if chat.return_token_ids else {}
        for choice in sorted(generation.choices, key=lambda c: c.index):
            first = {"index": choice.index, "delta": {"role": chat.role, "content": ""},
                     "logprobs": None, "finish_reason": None}
            yield event({**header, "choices": [first], **extra, **prompt_ids})
        async for choice, delta in feed:
            if choice.rejection:
                yield error_event(rejection_error(choice.rejection))
                yield DONE
                return
            entries = chat.add(choice, delta)
            reply = chat.choice_reply(choice.index)
            fields = reply.feed_last(delta.text, delta.new_token_ids, delta.finished)
            # vLLM: with return_token_ids every token id goes out, text or not.
            token_ids = list(delta.new_token_ids) if chat.return_token_ids else None
            if not fields and not delta.finished and not entries and not token_ids:
                continue
            item = {
                "index": choice.index,
                "delta": fields,
                "logprobs": {"content": entries} if entries is not None else None,
                "finish_reason": finish_reason(choice.finish_reason, reply.called_tools) if delta.finished else None,
            }
            if delta.finished:
                item["stop_reason"] = choice.stop_reason
            if token_ids is not None:
                item["token_ids"] = token_ids
            yield chunk(item)
        if not generation.finished:
            yield error_event(internal_error())
        elif chat.include_usage:
            yield event({**header, "choices": [], "usage": chat.usage(generation)})
    yield DONE


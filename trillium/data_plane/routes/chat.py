"""POST /v1/chat/completions: the model's chat template over `messages`, OpenAI's format.

The conversation is rendered with the tokenizer's chat template
(`add_generation_prompt` true unless the client says otherwise) and
encoded without extra special tokens (the template supplies them). Without
max_tokens / max_completion_tokens a reply may run to the end of the
context. Streamed replies start each choice with a `{"role": "assistant"}`
delta, send content deltas, end each choice with a chunk carrying its
finish_reason, then (with stream_options.include_usage) a usage chunk and
`[DONE]`.

Every response reports the weight version current when it was admitted:
`weight_version` in the body (in each chunk when streamed) and the
`X-Weight-Version` header.
"""

from __future__ import annotations

import time

import trio
from quart import Blueprint, request

from trillium.data_plane.errors import bad_request, internal_error
from trillium.data_plane.generation import Choice, Generation
from trillium.data_plane.logprobs import chat_logprobs
from trillium.data_plane.protocol import ChatCompletionRequest, parse_request
from trillium.data_plane.sampling import chat_params, chat_renames, check_prompt
from trillium.data_plane.state import WEIGHT_VERSION_HEADER, AppState, new_id
from trillium.data_plane.streaming import DONE, ChunkEvents, error_event, event, json_response, sse_response, usage
from trillium.observability.tracing import sample_request


class _Chat:
    """One response being built: ids, the prompt, each choice's text and logprobs."""

    def __init__(self, state: AppState, req: ChatCompletionRequest, model: str, prompt_ids: list[int]) -> None:
        self.id = new_id("chatcmpl")
        self.created = int(time.time())
        self.model = model
        self.prompt_ids = prompt_ids
        self.include_usage = req.include_usage
        self.num_top = (req.top_logprobs or 0) if req.logprobs else None
        self._token_text = state.tokenizer.token_text
        self.weight_version: str | None = None  # set at admission
        self.texts: dict[int, list[str]] = {}
        self.logprobs: dict[int, list[dict]] = {}

    def add(self, choice: Choice, delta) -> list[dict] | None:
        """Record a delta; returns its logprob entries (None when not asked for)."""
        self.texts.setdefault(choice.index, []).append(delta.text)
        if self.num_top is None:
            return None
        entries = chat_logprobs(delta.logprobs, self._token_text, self.num_top)
        self.logprobs.setdefault(choice.index, []).extend(entries)
        return entries

    def header(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None, "weight_version": self.weight_version}

    def usage(self, generation: Generation) -> dict:
        return usage(len(self.prompt_ids), sum(c.num_generated_tokens for c in generation.choices))


def blueprint(state: AppState) -> Blueprint:
    bp = Blueprint("chat", __name__)

    @bp.post("/v1/chat/completions")
    async def create_chat_completion():
        req = parse_request(ChatCompletionRequest, await request.get_data())
        model = state.resolve_model(req.model)
        trace = sample_request(state.engine.tracing, request.headers, model)  # None unless traced
        params = chat_params(req)
        prompt_ids = await state.tokenizer.encode_chat(
            [m.to_template() for m in req.messages],
            add_generation_prompt=req.add_generation_prompt is not False,
            template_kwargs=req.chat_template_kwargs,
        )
        engine = state.engine
        checked = check_prompt(prompt_ids, params, vocab_size=engine.vocab_size,
                               max_model_len=engine.max_model_len, renames=chat_renames(req))
        chat = _Chat(state, req, model, prompt_ids)
        generation = state.admit()
        chat.weight_version = generation.weight_version
        await generation.submit(chat.id, [prompt_ids], [checked], engine.resolved_eos_token_ids,
                                priority=req.priority or 0, trace=trace, lora_id=state.lora_id(model))
        if req.stream:
            response = sse_response(_stream(state, generation, chat))
        else:
            response = await _respond(generation, chat)
        response.headers[WEIGHT_VERSION_HEADER] = generation.weight_version
        return response

    return bp


async def _respond(generation: Generation, chat: _Chat):
    async with trio.open_nursery() as nursery:
        async with generation.feed(nursery) as feed:
            async for choice, delta in feed:
                chat.add(choice, delta)
    rejected = [c.rejection for c in generation.choices if c.rejection]
    if rejected:
        raise bad_request(rejected[0])
    choices = []
    for choice in sorted(generation.choices, key=lambda c: c.index):
        choices.append({
            "index": choice.index,
            "message": {"role": "assistant", "content": "".join(chat.texts.get(choice.index, []))},
            "logprobs": {"content": chat.logprobs.get(choice.index, [])} if chat.num_top is not None else None,
            "finish_reason": choice.finish_reason,
            "stop_reason": choice.stop_reason,
        })
    return json_response({**chat.header("chat.completion"), "choices": choices, "usage": chat.usage(generation)})


async def _stream(state: AppState, generation: Generation, chat: _Chat):
    header = chat.header("chat.completion.chunk")
    extra = {"usage": None} if chat.include_usage else {}
    chunk = ChunkEvents(header, extra)
    async with generation.feed(state.nursery) as feed:
        for choice in sorted(generation.choices, key=lambda c: c.index):
            first = {"index": choice.index, "delta": {"role": "assistant", "content": ""},
                     "logprobs": None, "finish_reason": None}
            yield event({**header, "choices": [first], **extra})
        async for choice, delta in feed:
            if choice.rejection:
                yield error_event(bad_request(choice.rejection))
                yield DONE
                return
            entries = chat.add(choice, delta)
            if not delta.text and not delta.finished and not entries:
                continue
            item = {
                "index": choice.index,
                "delta": {"content": delta.text} if delta.text else {},
                "logprobs": {"content": entries} if entries is not None else None,
                "finish_reason": choice.finish_reason if delta.finished else None,
            }
            if delta.finished:
                item["stop_reason"] = choice.stop_reason
            yield chunk(item)
        if not generation.finished:
            yield error_event(internal_error())
        elif chat.include_usage:
            yield event({**header, "choices": [], "usage": chat.usage(generation)})
    yield DONE

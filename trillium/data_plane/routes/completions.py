"""POST /v1/completions: OpenAI's legacy completions, vLLM's extras.

`prompt` is a string, a list of strings, a token-id list or a list of
token-id lists; each prompt is one engine request with `n` choices, numbered
`prompt_index * n + i`. `echo` prepends the prompt (and, with `logprobs`,
its token logprobs, the first one null). Non-streamed responses list the
choices in index order; streamed ones send each choice's text as it comes,
then (with stream_options.include_usage) a usage chunk, then `[DONE]`.

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
from trillium.data_plane.logprobs import CompletionLogprobs
from trillium.data_plane.protocol import CompletionRequest, parse_request
from trillium.data_plane.sampling import COMPLETION_RENAMES, check_prompt, completion_params
from trillium.data_plane.state import WEIGHT_VERSION_HEADER, AppState, new_id
from trillium.data_plane.streaming import (
    DONE,
    ChunkEvents,
    error_event,
    event,
    json_response,
    sse_response,
    usage,
)
from trillium.observability.tracing import sample_request


class _Output:
    """What one choice has produced so far, in wire terms."""

    def __init__(self, echo_text: str | None, logprobs: CompletionLogprobs | None) -> None:
        self._echo_text = echo_text
        self.logprobs = logprobs
        self.text_parts: list[str] = []
        self._started = False

    def add(self, delta, prompt_ids: list[int]) -> str:
        """Append a delta; returns its text (with the echoed prompt first, once)."""
        text = delta.text
        if not self._started:
            self._started = True
            if self._echo_text is not None:
                text = self._echo_text + text
                if self.logprobs is not None:
                    self.logprobs.add_prompt(prompt_ids, delta.prompt_logprobs)
        if self.logprobs is not None:
            self.logprobs.add(delta.logprobs)
        self.text_parts.append(text)
        return text


class _Completion:
    """One response being built: ids, prompts, each choice's output."""

    def __init__(self, state: AppState, req: CompletionRequest, model: str, prompts, echo_texts) -> None:
        self.id = new_id("cmpl")
        self.created = int(time.time())
        self.model = model
        self.prompts = prompts  # token ids per prompt
        self.include_usage = req.include_usage
        self._echo_texts = echo_texts  # per prompt, or None without echo
        self._num_top = req.logprobs
        self._token_text = state.tokenizer.token_text
        self._outputs: dict[int, _Output] = {}
        self.weight_version: str | None = None  # set at admission

    def output(self, choice: Choice) -> _Output:
        output = self._outputs.get(choice.index)
        if output is None:
            logprobs = None if self._num_top is None else CompletionLogprobs(self._token_text, self._num_top)
            echo_text = None if self._echo_texts is None else self._echo_texts[choice.prompt_index]
            output = self._outputs[choice.index] = _Output(echo_text, logprobs)
        return output

    def header(self) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "system_fingerprint": None, "weight_version": self.weight_version}

    def usage(self, generation: Generation) -> dict:
        return usage(sum(len(p) for p in self.prompts), sum(c.num_generated_tokens for c in generation.choices))


def blueprint(state: AppState) -> Blueprint:
    bp = Blueprint("completions", __name__)

    @bp.post("/v1/completions")
    async def create_completion():
        req = parse_request(CompletionRequest, await request.get_data())
        model = state.resolve_model(req.model)
        trace = sample_request(state.engine.tracing, request.headers, model)  # None unless traced
        params = completion_params(req)
        prompts = [p if isinstance(p, list) else await state.tokenizer.encode(p) for p in req.prompt]
        engine = state.engine
        checked = [
            check_prompt(ids, params, vocab_size=engine.vocab_size, max_model_len=engine.max_model_len,
                         renames=COMPLETION_RENAMES)
            for ids in prompts
        ]
        echo_texts = [
            p if isinstance(p, str) else await state.tokenizer.decode(ids, params.skip_special_tokens)
            for p, ids in zip(req.prompt, prompts)
        ] if req.echo else None
        completion = _Completion(state, req, model, prompts, echo_texts)
        generation = state.admit()
        completion.weight_version = generation.weight_version
        await generation.submit(completion.id, prompts, checked, engine.resolved_eos_token_ids,
                                priority=req.priority or 0, trace=trace, lora_id=state.lora_id(model))
        if req.stream:
            response = sse_response(_stream(state, generation, completion))
        else:
            response = await _respond(generation, completion)
        response.headers[WEIGHT_VERSION_HEADER] = generation.weight_version
        return response

    return bp


async def _respond(generation: Generation, completion: _Completion):
    async with trio.open_nursery() as nursery:
        async with generation.feed(nursery) as feed:
            async for choice, delta in feed:
                completion.output(choice).add(delta, completion.prompts[choice.prompt_index])
    rejected = [c.rejection for c in generation.choices if c.rejection]
    if rejected:
        raise bad_request(rejected[0])
    choices = []
    for choice in sorted(generation.choices, key=lambda c: c.index):
        output = completion.output(choice)
        choices.append({
            "index": choice.index,
            "text": "".join(output.text_parts),
            "logprobs": output.logprobs.to_json() if output.logprobs is not None else None,
            "finish_reason": choice.finish_reason,
            "stop_reason": choice.stop_reason,
        })
    return json_response({**completion.header(), "choices": choices, "usage": completion.usage(generation)})


async def _stream(state: AppState, generation: Generation, completion: _Completion):
    extra = {"usage": None} if completion.include_usage else {}
    chunk = ChunkEvents(completion.header(), extra)
    async with generation.feed(state.nursery) as feed:
        async for choice, delta in feed:
            if choice.rejection:
                yield error_event(bad_request(choice.rejection))
                yield DONE
                return
            output = completion.output(choice)
            text = output.add(delta, completion.prompts[choice.prompt_index])
            if not text and not delta.finished and not delta.new_token_ids:
                continue
            item = {
                "index": choice.index,
                "text": text,
                "logprobs": output.logprobs.take() if output.logprobs is not None else None,
                "finish_reason": choice.finish_reason if delta.finished else None,
                "stop_reason": choice.stop_reason if delta.finished else None,
            }
            yield chunk(item)
        if not generation.finished:
            yield error_event(internal_error())
        elif completion.include_usage:
            yield event({**completion.header(), "choices": [], "usage": completion.usage(generation)})
    yield DONE

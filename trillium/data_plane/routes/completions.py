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

vLLM's rollout fields (rollout_fields.py; vllm/entrypoints/openai/completion/
serving.py): `return_token_ids` adds `prompt_token_ids` and `token_ids` to
each choice (streamed: the prompt's on a choice's first chunk, each chunk's
new ids on it); `prompt_logprobs` adds the prompt's logprobs to each choice;
`return_tokens_as_token_ids` writes logprob tokens as "token_id:N";
`usage.prompt_tokens_details.cached_tokens` counts prefix-cache hits.
"""

from __future__ import annotations

import time

import attrs
import trio
from quart import Blueprint, request

from trillium.data_plane.errors import internal_error, rejection_error
from trillium.data_plane.generation import Choice, Generation
from trillium.data_plane.logprobs import CompletionLogprobs
from trillium.data_plane.protocol import CompletionRequest, parse_request
from trillium.data_plane.rollout_fields import (
    REQUEST_ID_HEADER,
    RequestIds,
    bad_words_token_ids,
    logprob_token_text,
    prompt_logprobs_json,
    truncate_prompt,
)
from trillium.data_plane.sampling import check_priority, check_prompt, completion_params, completion_renames
from trillium.data_plane.state import WEIGHT_VERSION_HEADER, AppState
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
        self.token_ids: list[int] = []
        self.prompt_logprobs = None  # the engine's PromptLogprobs, with the first delta
        self.sent_prompt_ids = False  # streamed: prompt_token_ids went out with a chunk
        self._started = False

    def add(self, delta, prompt_ids: list[int]) -> str:
        """Append a delta; returns its text (with the echoed prompt first, once)."""
        text = delta.text
        self.token_ids.extend(delta.new_token_ids)
        if not self._started:
            self._started = True
            self.prompt_logprobs = delta.prompt_logprobs
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

    def __init__(self, state: AppState, req: CompletionRequest, ids: RequestIds, model: str, prompts,
                 echo_texts, num_prompt_top: int | None) -> None:
        self.id = ids.response_id
        self.created = int(time.time())
        self.model = model
        self.prompts = prompts  # token ids per prompt
        self.include_usage = req.include_usage
        self.return_token_ids = bool(req.return_token_ids)
        self.num_prompt_top = num_prompt_top  # prompt_logprobs asked of the engine, None: none
        self._n = req.n
        self._echo_texts = echo_texts  # per prompt, or None without echo
        self._num_top = req.logprobs
        self._text = state.tokenizer.token_text
        self._token_text = logprob_token_text(state.tokenizer.token_text, req.return_tokens_as_token_ids)
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
        # Each prompt counts once (its first choice), as in prompt_tokens.
        cached = sum(c.num_cached_tokens for c in generation.choices if c.index == c.prompt_index * self._n)
        return usage(sum(len(p) for p in self.prompts), sum(c.num_generated_tokens for c in generation.choices),
                     cached)

    def choice_extras(self, choice: Choice) -> dict:
        """vLLM's per-choice extras of a non-streamed response (null unless asked for)."""
        output = self.output(choice)
        prompt_ids = self.prompts[choice.prompt_index]
        prompt_logprobs = None
        if self.num_prompt_top is not None:
            prompt_logprobs = prompt_logprobs_json(prompt_ids, output.prompt_logprobs, self.num_prompt_top,
                                                   self._text)
        return {
            "prompt_logprobs": prompt_logprobs,
            "prompt_token_ids": prompt_ids if self.return_token_ids else None,
            "token_ids": output.token_ids if self.return_token_ids else None,
        }

    def stream_extras(self, choice: Choice, output: _Output, delta) -> dict:
        """return_token_ids in a streamed chunk: the prompt's ids once, then each chunk's new ids."""
        if not self.return_token_ids:
            return {}
        prompt_ids = None
        if not output.sent_prompt_ids:
            output.sent_prompt_ids = True
            prompt_ids = self.prompts[choice.prompt_index]
        return {"prompt_token_ids": prompt_ids, "token_ids": list(delta.new_token_ids)}


def blueprint(state: AppState) -> Blueprint:
    bp = Blueprint("completions", __name__)

    @bp.post("/v1/completions")
    async def create_completion():
        req = parse_request(CompletionRequest, await request.get_data())
        model = state.resolve_model(req.model)
        ids = RequestIds("cmpl", request.headers, req.request_id)
        trace = sample_request(state.engine.tracing, request.headers, model)  # None unless traced
        params = completion_params(req, state.engine.defaults, state.engine.max_logprobs)
        engine = state.engine
        if req.priority:
            check_priority(req.priority, engine.client.config.engine.scheduling_policy)
        state.limits.check_num_prompts(len(req.prompt))
        encoded = await _encode_prompts(state, req)
        prompts = [truncate_prompt(p, req.truncate_prompt_tokens, req.truncation_side, engine.max_model_len)
                   for p in encoded]
        words = await bad_words_token_ids(req.bad_words, state.tokenizer.encode_plain)
        if words:
            params = attrs.evolve(params, bad_words_token_ids=words)
        checked = [
            check_prompt(p, params, vocab_size=engine.vocab_size, max_model_len=engine.max_model_len,
                         renames=completion_renames(req), default_max_tokens=engine.defaults.default_max_tokens)
            for p in prompts
        ]
        echo_texts = await _echo_texts(state, req.prompt, encoded, prompts, params) if req.echo else None
        completion = _Completion(state, req, ids, model, prompts, echo_texts, params.prompt_logprobs)
        generation = state.admit(checked)
        completion.weight_version = generation.weight_version
        await generation.submit(ids.engine_id, prompts, checked, engine.resolved_eos_token_ids,
                                priority=req.priority or 0, trace=trace, lora_id=state.lora_id(model),
                                cache_salt=req.cache_salt, final_only=not req.stream)
        if req.stream:
            response = sse_response(_stream(state, generation, completion))
        else:
            response = await _respond(generation, completion)
        response.headers[WEIGHT_VERSION_HEADER] = generation.weight_version
        response.headers[REQUEST_ID_HEADER] = ids.base
        return response

    return bp


async def _encode_prompts(state: AppState, req: CompletionRequest) -> list[list[int]]:
    add_special = req.add_special_tokens is not False  # vLLM's default for completions: true
    return [p if isinstance(p, list) else await state.tokenizer.encode(p, add_special) for p in req.prompt]


async def _echo_texts(state: AppState, sent, encoded, prompts, params) -> list[str]:
    """The echoed prompts: as sent, or decoded from the ids (token prompts, truncated ones)."""
    texts = []
    for p, whole_ids, token_ids in zip(sent, encoded, prompts):
        whole = isinstance(p, str) and len(whole_ids) == len(token_ids)
        texts.append(p if whole else await state.tokenizer.decode(token_ids, params.skip_special_tokens))
    return texts


async def _respond(generation: Generation, completion: _Completion):
    async with trio.open_nursery() as nursery:
        async with generation.feed(nursery) as feed:
            async for choice, delta in feed:
                completion.output(choice).add(delta, completion.prompts[choice.prompt_index])
    rejected = [c.rejection for c in generation.choices if c.rejection]
    if rejected:
        raise rejection_error(rejected[0])
    choices = []
    for choice in sorted(generation.choices, key=lambda c: c.index):
        output = completion.output(choice)
        choices.append({
            "index": choice.index,
            "text": "".join(output.text_parts),
            "logprobs": output.logprobs.to_json() if output.logprobs is not None else None,
            "finish_reason": choice.finish_reason,
            "stop_reason": choice.stop_reason,
            **completion.choice_extras(choice),
        })
    return json_response({**completion.header(), "choices": choices, "usage": completion.usage(generation)})


async def _stream(state: AppState, generation: Generation, completion: _Completion):
    extra = {"usage": None} if completion.include_usage else {}
    chunk = ChunkEvents(completion.header(), extra)
    async with generation.feed(state.nursery) as feed:
        async for choice, delta in feed:
            if choice.rejection:
                yield error_event(rejection_error(choice.rejection))
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
                **completion.stream_extras(choice, output, delta),
            }
            yield chunk(item)
        if not generation.finished:
            yield error_event(internal_error())
        elif completion.include_usage:
            yield event({**completion.header(), "choices": [], "usage": completion.usage(generation)})
    yield DONE

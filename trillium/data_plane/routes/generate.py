"""POST (or PUT) /generate: SGLang's native generation API, on the same engine path as /v1/completions.

Body: see `generate_request.py` (SGLang's GenerateReqInput). Each prompt is one
engine request with `n` samples; the response lists them prompt by prompt,
sample by sample (entry `prompt_index * n + i`), as SGLang's tokenizer manager
orders them. One prompt with n == 1 answers one object, anything else a list:

    {"text": str, "output_ids": [int],
     "meta_info": {"id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens",
                   "weight_version", "e2e_latency",
                   with return_logprob: "input_token_logprobs", "output_token_logprobs"
                   ([logprob, token_id, text-or-null] each), and with top_logprobs_num > 0
                   "input_top_logprobs", "output_top_logprobs" (a list of those per position)}}

finish_reason is SGLang's: {"type": "stop", "matched": token id | stop string},
{"type": "length", "length": max_new_tokens} or {"type": "abort", "message": ...};
null until the sample finished. `output_ids` include the EOS / stop token
(as SGLang's); `text` leaves the stop string / stop token out unless
no_stop_trim. `input_token_logprobs` covers the prompt from
`logprob_start_len` (default: its last token), the first entry's logprob null.

Streamed (`stream: true`), each event is SSE `data: {...}` carrying the
*cumulative* text, output_ids and logprob lists of one sample (SGLang's
default, non-incremental streaming), with `"index"` when the response is a
list; the stream ends with `data: [DONE]`. meta_info.id is the engine
request id: the prompt's `rid` (n > 1: `<rid>-<i>` per sample).

The weight version current at admission is reported in meta_info and in the
`X-Weight-Version` header. With --api-key, /generate needs the key (app.py).
"""

from __future__ import annotations

import time

import trio
from quart import Blueprint, request

from trillium.data_plane.errors import ApiError, bad_request, internal_error, rejection_error
from trillium.data_plane.generate_request import GenerateRequest, PromptSpec, check_generate_prompt, parse_generate
from trillium.data_plane.generation import Choice, Generation
from trillium.data_plane.logprobs import MIN_LOGPROB
from trillium.data_plane.state import WEIGHT_VERSION_HEADER, AppState
from trillium.data_plane.streaming import DONE, error_event, event, json_response, sse_response
from trillium.observability.tracing import sample_request


class _Sample:
    """What one sample has produced so far, and its SGLang output dict."""

    def __init__(self, spec: PromptSpec, prompt_ids: list[int], max_tokens: int, token_text) -> None:
        self.spec = spec
        self.prompt_ids = prompt_ids
        self.max_tokens = max_tokens
        self._token_text = token_text  # None: logprob entries carry no text
        self.text = ""
        self.output_ids: list[int] = []
        self.output_logprobs: list[list] = []
        self.output_top: list[list | None] = []
        self.input_logprobs: list[list] = []
        self.input_top: list[list | None] = []
        self.cached_tokens = 0
        self._started = False

    def _entry(self, logprob: float | None, token_id: int) -> list:
        text = self._token_text(token_id) if self._token_text is not None else None
        return [None if logprob is None else max(logprob, MIN_LOGPROB), token_id, text]

    def _top(self, entry) -> list:
        num = self.spec.top_logprobs_num
        return [self._entry(lp, tid) for tid, lp in zip(entry.top_token_ids[:num], entry.top_logprobs[:num])]

    def add(self, delta) -> None:
        if not self._started:
            self._started = True
            self._add_prompt(delta.prompt_logprobs)
        self.text += delta.text
        self.output_ids.extend(delta.new_token_ids)
        self.cached_tokens = max(self.cached_tokens, delta.num_cached_tokens)
        if self.spec.return_logprob:
            for entry in delta.logprobs:
                self.output_logprobs.append(self._entry(entry.logprob, entry.token_id))
                if self.spec.top_logprobs_num:
                    self.output_top.append(self._top(entry))

    def _add_prompt(self, prompt_logprobs) -> None:
        """SGLang's input logprobs: positions logprob_start_len.. of the prompt, the first without one."""
        if not self.spec.return_logprob:
            return
        ids = self.prompt_ids
        start = self.spec.logprob_start_len if self.spec.logprob_start_len >= 0 else len(ids) - 1
        by_position = {} if prompt_logprobs is None else {
            prompt_logprobs.start + k: e for k, e in enumerate(prompt_logprobs.entries)
        }
        self.input_logprobs.append(self._entry(None, ids[start]))
        self.input_top.append(None)
        for position in range(start + 1, len(ids)):
            entry = by_position.get(position)
            self.input_logprobs.append(self._entry(None if entry is None else entry.logprob, ids[position]))
            if self.spec.top_logprobs_num:
                self.input_top.append(None if entry is None else self._top(entry))

    def finish_reason(self, choice: Choice) -> dict:
        if choice.finish_reason == "length":
            return {"type": "length", "length": self.max_tokens}
        if choice.finish_reason == "abort":
            reason = {"type": "abort", "message": choice.stop_reason if isinstance(choice.stop_reason, str)
                      else "the request was aborted"}
            if choice.rejection:
                reason["status_code"] = rejection_error(choice.rejection).status
            return reason
        matched = choice.stop_reason
        if matched is None and self.output_ids:
            matched = self.output_ids[-1]  # EOS: the token that matched (SGLang reports it)
        return {"type": "stop", "matched": matched}

    def to_json(self, choice: Choice, weight_version: str, received_s: float, finished: bool) -> dict:
        meta: dict = {
            "id": choice.stream.request_id,
            "finish_reason": self.finish_reason(choice) if finished else None,
            "prompt_tokens": len(self.prompt_ids),
            "weight_version": weight_version,
        }
        if self.spec.return_logprob:
            # NOTE: the lists themselves, not copies: a streamed item is encoded at once.
            meta["input_token_logprobs"] = self.input_logprobs
            meta["output_token_logprobs"] = self.output_logprobs
            if self.spec.top_logprobs_num:
                meta["input_top_logprobs"] = self.input_top
                meta["output_top_logprobs"] = self.output_top
        meta["completion_tokens"] = len(self.output_ids)
        meta["cached_tokens"] = self.cached_tokens
        if finished:
            meta["e2e_latency"] = time.monotonic() - received_s
        return {"text": self.text, "output_ids": self.output_ids, "meta_info": meta}


class _Response:
    """The samples of one /generate call, by choice index."""

    def __init__(self, state: AppState, req: GenerateRequest, prompts: list[list[int]], checked,
                 received_s: float) -> None:
        self.req = req
        self.received_s = received_s
        self.weight_version = "0"  # set at admission
        token_text = state.tokenizer.token_text if req.return_text_in_logprobs else None
        self._samples: dict[int, _Sample] = {}
        for prompt_index, (spec, ids, params) in enumerate(zip(req.prompts, prompts, checked)):
            for i in range(req.n):
                self._samples[prompt_index * req.n + i] = _Sample(spec, ids, params.max_tokens, token_text)

    def sample(self, choice: Choice) -> _Sample:
        return self._samples[choice.index]

    def item(self, choice: Choice, finished: bool) -> dict:
        return self.sample(choice).to_json(choice, self.weight_version, self.received_s, finished)


def _lora_id(state: AppState, name: str | None) -> int:
    if name is None:
        return 0
    try:
        return state.lora_id(name)
    except ApiError as exc:
        if exc.status != 404:
            raise
        raise bad_request(f"lora_path: no LoRA adapter named {name!r} is loaded", "lora_path") from None


def blueprint(state: AppState) -> Blueprint:
    bp = Blueprint("generate", __name__)

    @bp.route("/generate", methods=["POST", "PUT"])  # SGLang's http_server takes both
    async def generate():
        received_s = time.monotonic()
        req = parse_generate(await request.get_data())
        engine = state.engine
        lora_ids = [_lora_id(state, spec.lora_path) for spec in req.prompts]
        state.limits.check_num_prompts(len(req.prompts), req.prompt_field)
        prompts = [spec.token_ids if spec.token_ids is not None
                   else await state.tokenizer.encode(spec.text, param=req.prompt_field) for spec in req.prompts]
        checked = [
            check_generate_prompt(ids, spec, prompt_field=req.prompt_field, vocab_size=engine.vocab_size,
                                  max_model_len=engine.max_model_len, defaults=engine.defaults,
                                  max_logprobs=engine.max_logprobs)
            for ids, spec in zip(prompts, req.prompts)
        ]
        trace = sample_request(engine.tracing, request.headers, req.prompts[0].lora_path or engine.model_name)
        response = _Response(state, req, prompts, checked, received_s)
        generation = state.admit(checked, "sampling_params.")
        response.weight_version = generation.weight_version
        try:
            await generation.submit(req.prompts[0].rid, prompts, checked, engine.resolved_eos_token_ids,
                                    trace=trace, lora_id=lora_ids, request_ids=[s.rid for s in req.prompts],
                                    final_only=not req.stream)
        except ValueError as exc:  # EngineClient.submit: a rid still in flight
            raise bad_request(f"rid: {exc}", "rid") from None
        if req.stream:
            reply = sse_response(_stream(state, generation, response))
        else:
            reply = await _respond(generation, response)
        reply.headers[WEIGHT_VERSION_HEADER] = generation.weight_version
        return reply

    return bp


async def _respond(generation: Generation, response: _Response):
    async with trio.open_nursery() as nursery:
        async with generation.feed(nursery) as feed:
            async for choice, delta in feed:
                response.sample(choice).add(delta)
    rejected = [c.rejection for c in generation.choices if c.rejection]
    if rejected:
        raise rejection_error(rejected[0])
    items = [response.item(c, True) for c in sorted(generation.choices, key=lambda c: c.index)]
    return json_response(items[0] if response.req.is_single else items)


async def _stream(state: AppState, generation: Generation, response: _Response):
    indexed = not response.req.is_single
    async with generation.feed(state.nursery) as feed:
        async for choice, delta in feed:
            response.sample(choice).add(delta)
            if not delta.text and not delta.finished and not delta.new_token_ids:
                continue
            item = response.item(choice, delta.finished)
            if indexed:
                item["index"] = choice.index
            yield event(item)
        if not generation.finished:
            yield error_event(internal_error())
    yield DONE

"""TRL vllm-serve's generation routes: GET /health/ and POST /generate/ (trailing slashes: TRL's paths).

TRL's `VLLMClient` (huggingface/trl, trl/generation/vllm_client.py) speaks only to
TRL's own server (trl/scripts/vllm_serve.py). These are its two generation routes,
on the same engine path as /v1/completions (admission, submission, abort on
disconnect: generation.py); its weight-sync routes are the control plane's
(control_plane/routes/trl.py).

    GET /health/   -> {"status": "ok"}, 503 when an engine actor is down (served by routes/health.py,
                      the same probe as /health)
    POST /generate/ (body: trl_request.py)
        -> {"prompt_ids": [[int]] (one per prompt, as tokenized),
            "completion_ids": [[int]] (n per prompt, prompt by prompt),
            "logprobs": [[[float]]], "logprob_token_ids": [[[int]]]  ([sequence][token][k],
                most probable first; both null when the body's logprobs is null)}
        Text prompts are tokenized with the tokenizer's special tokens (BOS),
        as vLLM's LLM.generate does. completion_ids include the EOS token
        that ended a sequence (vLLM's token_ids do). The weight version
        current at admission is in the X-Weight-Version header. With
        --api-key, /generate/ needs the key (app.py).
"""

from __future__ import annotations

import uuid

import trio
from quart import Blueprint, request

from trillium.data_plane.errors import rejection_error
from trillium.data_plane.protocol import parse_request
from trillium.data_plane.sampling import check_prompt
from trillium.data_plane.state import WEIGHT_VERSION_HEADER, AppState
from trillium.data_plane.streaming import json_response
from trillium.data_plane.trl_request import TrlGenerateRequest, logprob_row, sampling_params
from trillium.observability.tracing import sample_request


def blueprint(state: AppState) -> Blueprint:
    bp = Blueprint("trl", __name__)

    @bp.post("/generate/")
    async def generate():
        req = parse_request(TrlGenerateRequest, await request.get_data())
        params = sampling_params(req)
        engine = state.engine
        state.limits.check_num_prompts(len(req.prompts), "prompts")  # before any tokenizing
        prompts = [list(p) for p in req.prompts] if req.token_prompts else [
            await state.tokenizer.encode(text) for text in req.prompts]
        checked = [check_prompt(ids, params, vocab_size=engine.vocab_size, max_model_len=engine.max_model_len,
                                renames={"prompt_token_ids": "prompts", "prompt": "prompts"})
                   for ids in prompts]
        trace = sample_request(engine.tracing, request.headers, engine.model_name)
        generation = state.admit(checked)
        await generation.submit(f"trl-{uuid.uuid4().hex}", prompts, checked, engine.resolved_eos_token_ids,
                                trace=trace, final_only=True)  # TRL's reply lists whole completions
        num_sequences = len(prompts) * params.n
        completion_ids: list[list[int]] = [[] for _ in range(num_sequences)]
        rows: list[list[tuple[list[float], list[int]]]] = [[] for _ in range(num_sequences)]
        async with trio.open_nursery() as nursery:
            async with generation.feed(nursery) as feed:
                async for choice, delta in feed:
                    completion_ids[choice.index].extend(delta.new_token_ids)
                    if params.logprobs is not None:
                        rows[choice.index].extend(logprob_row(e, params.logprobs) for e in delta.logprobs)
        rejected = [c.rejection for c in generation.choices if c.rejection]
        if rejected:
            raise rejection_error(rejected[0])
        with_logprobs = params.logprobs is not None
        reply = json_response({
            "prompt_ids": prompts,
            "completion_ids": completion_ids,
            "logprobs": [[lp for lp, _ in seq] for seq in rows] if with_logprobs else None,
            "logprob_token_ids": [[ids for _, ids in seq] for seq in rows] if with_logprobs else None,
        })
        reply.headers[WEIGHT_VERSION_HEADER] = generation.weight_version
        return reply

    return bp

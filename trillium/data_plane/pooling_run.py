"""Run a pooling HTTP request's prompts through the engine and collect their vectors.

    model = pooling_model(state, task)                    400 unless the server pools for `task`
    ids = await tokenize_inputs(state, inputs, ...)       texts / token ids -> checked token-id prompts
    ids = await request_prompts(state, req)               a body's `input` or chat `messages`, truncated
    raws = await run_pooling(state, prompts, priority, task)   one raw float32 output per prompt, in order

Each prompt is one engine request (`trillium/pooling/offline.pooling_params`:
max_tokens=1, the request's pooling task), admitted like a generation (`AppState.admit(pooling=True)`:
--max-queued-requests, 503 while not serving) and read through
`Generation.feed`, which aborts the unfinished ones if the client leaves.
The finishing delta of each carries its `pooled` array.
"""

from __future__ import annotations

import numpy as np

from trillium.data_plane.chat_reply import template_arguments
from trillium.data_plane.errors import bad_request, internal_error, rejection_error
from trillium.data_plane.pooling_protocol import pooling_inputs
from trillium.data_plane.rollout_fields import truncate_prompt
from trillium.data_plane.tool_choice import ToolPlan
from trillium.data_plane.sampling import check_priority, check_prompt
from trillium.data_plane.state import AppState, new_id, wrong_runner
from trillium.pooling.offline import engine_output, pooling_params
from trillium.pooling.outputs import PoolingModel

_RENAMES = {"prompt": "input", "prompt_token_ids": "input", "max_tokens": "input"}


def pooling_model(state: AppState, *tasks: str, per_token: bool = False) -> PoolingModel:
    """The served pooling model; 400 on a generative server or one that pools for another task,
    and, unless `per_token` (/pooling), on a token-pooling one (ALL / STEP: a row per token)."""
    model = state.engine.pooling
    if model is None:
        raise wrong_runner(True)
    if model.is_token_pooling and not per_token:
        raise bad_request(f"this model pools per token (--pooler-config pooling_type {model.pooler.pooling_type}): "
                          "use /pooling", "model")
    if tasks and model.task not in tasks:
        route = {"embed": "/v1/embeddings", "classify": "/classify"}[model.task]
        raise bad_request(f"this model's pooling task is {model.task!r} (--convert): use {route}, /pooling, "
                          "/score or /rerank", "model")
    return model


async def tokenize_inputs(state: AppState, inputs, *, add_special_tokens: bool = True,
                          param: str = "input", truncate: tuple[int | None, str | None] = (None, None)
                          ) -> list[list[int]]:
    """Token ids of each text (or token-id list, checked), each truncated as `truncate`
    (truncate_prompt_tokens, truncation_side) says and fitting the context;
    400 past --max-prompts-per-request inputs."""
    state.limits.check_num_prompts(len(inputs), param)
    prompts = []
    for item in inputs:
        if isinstance(item, str):
            ids = await state.tokenizer.encode(item, add_special_tokens=add_special_tokens, param=param)
        else:
            ids = list(item)
        ids = truncate_prompt(ids, *truncate, state.engine.max_model_len)
        state.limits.check_num_tokens(ids, state.engine.max_model_len, param)
        prompts.append(ids)
    return prompts


async def request_prompts(state: AppState, req) -> list[list[int]]:
    """The prompts of an /v1/embeddings, /pooling or /classify body: its `input`, or its chat
    `messages` rendered with the chat template (one prompt), truncated as the body says."""
    truncate = (req.truncate_prompt_tokens, req.truncation_side)
    if req.messages is None:
        add_special_tokens = req.add_special_tokens is not False
        return await tokenize_inputs(state, pooling_inputs(req.input), add_special_tokens=add_special_tokens,
                                     truncate=truncate)
    _, ids = await state.tokenizer.render_chat(
        [m.to_template() for m in req.messages], add_generation_prompt=req.add_generation_prompt,
        add_special_tokens=bool(req.add_special_tokens), template_kwargs=req.chat_template_kwargs,
        continue_final_message=req.continue_final_message,
        template_arguments=template_arguments(req, state.engine.chat, ToolPlan()),
    )
    ids = truncate_prompt(ids, *truncate, state.engine.max_model_len)
    state.limits.check_num_tokens(ids, state.engine.max_model_len, "messages")
    return [ids]


async def run_pooling(state: AppState, prompts: list[list[int]], priority: int = 0,
                      task: str | None = None) -> list[np.ndarray]:
    """The engine's raw output of each prompt pooled for `task` (None: the model's task), in order."""
    if priority:
        check_priority(priority, state.engine.client.config.engine.scheduling_policy)
    task = task or state.engine.pooling.task
    params = [pooling_params(task)] * len(prompts)
    for ids in prompts:
        if not ids:
            raise bad_request("input: an input encodes to no tokens", "input")
        check_prompt(ids, params[0], vocab_size=state.engine.vocab_size,
                     max_model_len=state.engine.max_model_len, renames=_RENAMES)
    generation = state.admit(params, pooling=True)
    await generation.submit(new_id("pool"), prompts, params, (), priority=priority)
    outputs: list[np.ndarray | None] = [None] * len(prompts)
    async with generation.feed(state.nursery) as events:
        async for choice, delta in events:
            if delta.pooled is not None:
                outputs[choice.prompt_index] = delta.pooled
            elif delta.finished:
                if choice.rejection is not None:
                    raise rejection_error(choice.rejection)
                raise internal_error()
    return [engine_output(raw, task) for raw in outputs]  # type: ignore[arg-type]


def usage(prompts: list[list[int]]) -> dict:
    num = sum(len(p) for p in prompts)
    return {"prompt_tokens": num, "total_tokens": num, "completion_tokens": 0, "prompt_tokens_details": None}

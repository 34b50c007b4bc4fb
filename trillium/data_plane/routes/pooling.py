"""POST /v1/embeddings, /pooling and /classify: one vector per input, vLLM's shapes.

    /v1/embeddings  {"input", "encoding_format": "float" | "base64", "dimensions",
                     "normalize" | "use_activation", "add_special_tokens"}
                    -> {"object": "list", "data": [{"object": "embedding", "index", "embedding"}],
                        "model", "usage"}                     (embedding models)
    /classify       {"input", "use_activation"} -> {"data": [{"index", "label", "probs",
                     "num_classes"}], ...}                   (classifiers, reward models)
    /pooling        {"input", "encoding_format", "dimensions", "use_activation", "task"}
                    -> {"data": [{"object": "pooling", "index", "data"}], ...}   (either;
                    `task`: the model's (embed / classify) or its per-token one (token_embed /
                    token_classify: `data` a list of rows, one per token; STEP: the
                    step_tag_id rows), null: the model's default (per token under ALL / STEP);
                    another task is a 400 naming it)
    each also takes chat `messages` for `input`, and truncate_prompt_tokens
    (pooling_protocol.py)

Shapes from vllm/entrypoints/pooling/{embed,classify,pooling}/protocol.py
and OpenAI's embeddings API (base64: the float32 little-endian bytes).
`dimensions` cuts a Matryoshka embedding (400 unless the model's config.json
says it was trained for it, as vLLM). Each input is one engine request
(data_plane/pooling_run.py); on a generative model these routes answer 400.
"""

from __future__ import annotations

import base64
import time

import numpy as np
from quart import Blueprint, request

from trillium.data_plane.errors import bad_request
from trillium.data_plane.pooling_protocol import ClassificationRequest, EmbeddingRequest, PoolingRequest
from trillium.data_plane.pooling_run import pooling_model, request_prompts, run_pooling, usage
from trillium.data_plane.protocol import parse_request
from trillium.data_plane.state import AppState, new_id
from trillium.data_plane.streaming import json_response


def encode_vector(vector: np.ndarray, encoding_format: str):
    """float: a list (of lists, per token, under token pooling); base64: the float32
    little-endian bytes, rows one after another."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return np.asarray(vector, dtype=np.float64).tolist()  # WHY float64: the exact float32 values, as floats


def _envelope(kind: str, model: str, data: list, prompts: list[list[int]]) -> dict:
    return {"id": new_id(kind), "object": "list", "created": int(time.time()), "model": model,
            "data": data, "usage": usage(prompts)}


async def _embedded(state: AppState, req: EmbeddingRequest, model_name: str, tasks: tuple[str, ...]):
    model = pooling_model(state, *tasks, per_token=not tasks)
    task = getattr(req, "task", None) or (tasks[0] if tasks else model.pooler.default_task)
    try:
        model.check_task(task)
    except ValueError as exc:
        raise bad_request(str(exc), "task") from None
    if model.task == "embed":
        try:
            model.check_dimensions(req.dimensions, model_name)
        except ValueError as exc:
            raise bad_request(str(exc), "dimensions") from None
    elif req.dimensions is not None:
        raise bad_request("dimensions: only embedding models have a size to cut", "dimensions")
    prompts = await request_prompts(state, req)
    raws = await run_pooling(state, prompts, req.priority, task)
    vectors = [model.output(raw, dimensions=req.dimensions, use_activation=req.wants_activation()) for raw in raws]
    return prompts, vectors


def blueprint(state: AppState) -> Blueprint:
    bp = Blueprint("pooling", __name__)

    @bp.post("/v1/embeddings")
    async def embeddings():
        req = parse_request(EmbeddingRequest, await request.get_data())
        model_name = state.resolve_model(req.model)
        prompts, vectors = await _embedded(state, req, model_name, ("embed",))
        data = [{"object": "embedding", "index": i, "embedding": encode_vector(v, req.encoding_format)}
                for i, v in enumerate(vectors)]
        return json_response(_envelope("embd", model_name, data, prompts))

    @bp.post("/pooling")
    async def pooling():
        req = parse_request(PoolingRequest, await request.get_data())
        model_name = state.resolve_model(req.model)
        prompts, vectors = await _embedded(state, req, model_name, ())
        data = [{"object": "pooling", "index": i, "data": encode_vector(v, req.encoding_format)}
                for i, v in enumerate(vectors)]
        return json_response(_envelope("pool", model_name, data, prompts))

    @bp.post("/classify")
    async def classify():
        req = parse_request(ClassificationRequest, await request.get_data())
        model_name = state.resolve_model(req.model)
        model = pooling_model(state, "classify")
        prompts = await request_prompts(state, req)
        raws = await run_pooling(state, prompts, req.priority)
        data = []
        for i, raw in enumerate(raws):
            probs = model.classification(raw, req.wants_activation())
            data.append({"index": i, "label": model.labels[int(np.argmax(probs))],
                         "probs": [float(p) for p in probs], "num_classes": len(probs)})
        return json_response(_envelope("classify", model_name, data, prompts))

    return bp

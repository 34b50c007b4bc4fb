"""POST /score (/v1/score) and /rerank (/v1/rerank, /v2/rerank): text-pair relevance, vLLM's shapes.

    /score   {"text_1": str | [str], "text_2": str | [str]}  (1 x N, or N x N element-wise)
             -> {"object": "list", "data": [{"index", "object": "score", "score"}], "model", "usage"}
    /rerank  {"query", "documents": [str], "top_n": 0, "return_documents": true}
             -> {"id", "model", "usage": {"total_tokens"}, "results": [{"index", "document":
                 {"text"}, "relevance_score"}]}   best first, the first top_n (0: all)

Shapes from vllm/entrypoints/pooling/score/protocol.py (rerank is Jina's /
Cohere's API; `return_documents` false leaves `document` out, as theirs do).
A classifier with one label is a cross-encoder: each pair is one prompt
(the tokenizer's pair template) and its score the sigmoid of the label
(`use_activation` false: the raw logit). An embedding model scores the
cosine of the two texts' embeddings, each text embedded once.
`truncate_prompt_tokens` cuts each prompt (a pair's, or each text's).
"""

from __future__ import annotations

import time

from quart import Blueprint, request

from trillium.data_plane.errors import bad_request
from trillium.data_plane.pooling_protocol import RerankRequest, ScoreRequest
from trillium.data_plane.pooling_run import pooling_model, run_pooling, tokenize_inputs
from trillium.data_plane.protocol import parse_request
from trillium.data_plane.rollout_fields import truncate_prompt
from trillium.data_plane.state import AppState, new_id
from trillium.data_plane.streaming import json_response
from trillium.pooling.offline import pair_list
from trillium.pooling.outputs import cosine


async def pair_scores(state: AppState, pairs: list[tuple[str, str]], use_activation: bool | None,
                      param: str, priority: int = 0, truncate: tuple[int | None, str | None] = (None, None)
                      ) -> tuple[list[float], int]:
    """(score of each pair, prompt tokens used); 400 past --max-prompts-per-request pairs.
    `truncate` (truncate_prompt_tokens, truncation_side) applies to each prompt."""
    model = pooling_model(state)
    state.limits.check_num_prompts(len(pairs), param)
    if model.task == "embed":
        texts = list(dict.fromkeys(text for pair in pairs for text in pair))
        prompts = await tokenize_inputs(state, texts, param=param, truncate=truncate)
        vectors = dict(zip(texts, await run_pooling(state, prompts, priority)))
        return [cosine(vectors[a], vectors[b]) for a, b in pairs], sum(len(p) for p in prompts)
    if len(model.labels) != 1:
        raise bad_request(f"this classifier has {len(model.labels)} labels; scoring text pairs needs a "
                          "cross-encoder (one label)", "model")
    prompts = [truncate_prompt(await state.tokenizer.encode_pair(a, b, param), *truncate, state.engine.max_model_len)
               for a, b in pairs]
    raws = await run_pooling(state, prompts, priority)
    return [float(model.classification(raw, use_activation)[0]) for raw in raws], sum(len(p) for p in prompts)


def blueprint(state: AppState) -> Blueprint:
    bp = Blueprint("scores", __name__)

    async def score():
        req = parse_request(ScoreRequest, await request.get_data())
        model_name = state.resolve_model(req.model)
        try:
            pairs = pair_list(req.text_1, req.text_2)
        except ValueError as exc:
            raise bad_request(str(exc).removeprefix("score: "), "text_1") from None
        scores, num_tokens = await pair_scores(state, pairs, req.wants_activation(), "text_1", req.priority,
                                               (req.truncate_prompt_tokens, req.truncation_side))
        return json_response({
            "id": new_id("score"), "object": "list", "created": int(time.time()), "model": model_name,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens, "completion_tokens": 0},
        })

    async def rerank():
        req = parse_request(RerankRequest, await request.get_data())
        model_name = state.resolve_model(req.model)
        pairs = [(req.query, document) for document in req.documents]
        scores, num_tokens = await pair_scores(state, pairs, req.wants_activation(), "documents", req.priority,
                                               (req.truncate_prompt_tokens, req.truncation_side))
        order = sorted(range(len(scores)), key=lambda i: -scores[i])
        if req.top_n:
            order = order[: req.top_n]
        results = []
        for i in order:
            result = {"index": i, "relevance_score": scores[i]}
            if req.return_documents:
                result["document"] = {"text": req.documents[i]}
            results.append(result)
        return json_response({"id": new_id("rerank"), "model": model_name,
                              "usage": {"total_tokens": num_tokens}, "results": results})

    for path in ("/score", "/v1/score"):
        bp.add_url_rule(path, f"score{path.replace('/', '_')}", score, methods=["POST"])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        bp.add_url_rule(path, f"rerank{path.replace('/', '_')}", rerank, methods=["POST"])
    return bp

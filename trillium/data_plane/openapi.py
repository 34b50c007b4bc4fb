"""The OpenAPI 3 document of the data plane, served at GET /openapi.json.

Request schemas come from the pydantic models in `protocol.py` (and
`responses_request.py`); responses are described by name and, for errors,
by OpenAI's error shape. Built once per app: the routes do not change while
it runs.
"""

from __future__ import annotations

from pydantic.json_schema import models_json_schema

from trillium.data_plane.pooling_protocol import (
    ClassificationRequest,
    EmbeddingRequest,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
)
from trillium.data_plane.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    REQUEST_MODELS,
    TokenizeRequest,
)
from trillium.data_plane.responses_request import ResponsesRequest

_REF = "#/components/schemas/{model}"
_POOLING_MODELS = (EmbeddingRequest, PoolingRequest, ClassificationRequest, ScoreRequest, RerankRequest)
_ERROR_SCHEMA = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "integer", "null"]},
            },
            "required": ["message", "type", "param", "code"],
        }
    },
    "required": ["error"],
}
_ERRORS = {
    "400": "invalid request (bad parameter, prompt too long, malformed JSON)",
    "401": "missing or wrong API key (when the server has one)",
    "404": "unknown model",
    "503": "overloaded, unhealthy, or the engine sleeping / paused / loading weights (Retry-After)",
}


def _ref(name: str) -> dict:
    return {"$ref": _REF.format(model=name)}


def _operation(summary: str, body: type | None = None, response: str = "JSON", streams: bool = False) -> dict:
    op: dict = {"summary": summary, "responses": {"200": {"description": response}}}
    if streams:
        op["responses"]["200"]["content"] = {"application/json": {}, "text/event-stream": {}}
    if body is not None:
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": _ref(body.__name__)}}}
        for status, text in _ERRORS.items():
            op["responses"][status] = {
                "description": text,
                "content": {"application/json": {"schema": _ref("ErrorResponse")}},
            }
    return op


def build_document(version: str) -> dict:
    models = (*REQUEST_MODELS, ResponsesRequest, *_POOLING_MODELS)
    _, definitions = models_json_schema([(m, "validation") for m in models], ref_template=_REF)
    schemas = dict(definitions.get("$defs", {}))
    schemas["ErrorResponse"] = _ERROR_SCHEMA
    paths = {
        "/v1/models": {"get": _operation("List the served models", response="model list")},
        "/v1/models/{model}": {"get": _operation("Describe one served model", response="model")},
        "/v1/completions": {"post": _operation("Text completion", CompletionRequest, "completion", True)},
        "/v1/chat/completions": {
            "post": _operation("Chat completion", ChatCompletionRequest, "chat completion", True)
        },
        "/v1/responses": {"post": _operation("OpenAI Responses API (routes/responses.py; also GET / DELETE "
                                             "/v1/responses/{id}, POST /v1/responses/{id}/cancel)",
                                             ResponsesRequest, "response", True)},
        "/generate": {"post": _operation("SGLang's native generation (text or input_ids, sampling_params)",
                                         response="SGLang output (a list for a batch or n > 1)", streams=True)},
        "/generate/": {"post": _operation("TRL vllm-serve's generation (prompts, n, sampling fields)",
                                          response="prompt_ids, completion_ids, logprobs, logprob_token_ids")},
        "/health/": {"get": _operation("TRL vllm-serve's health check")},
        "/v1/messages": {"post": _operation("Anthropic's Messages API (errors in Anthropic's shape)",
                                            response="message", streams=True)},
        "/v1/messages/count_tokens": {"post": _operation("Anthropic's token count of a Messages request",
                                                         response="input_tokens")},
        "/tokenize": {"post": _operation("Tokenize a prompt or a conversation", TokenizeRequest, "tokens")},
        "/detokenize": {"post": _operation("Decode token ids", DetokenizeRequest, "text")},
        "/health": {"get": _operation("200 when the engine is healthy, 503 otherwise")},
        "/version": {"get": _operation("Server version")},
        "/metrics": {"get": _operation("Prometheus metrics", response="text exposition format")},
        "/openapi.json": {"get": _operation("This document")},
        # Pooling models only (--runner pooling; routes/pooling.py, routes/scores.py).
        "/v1/embeddings": {"post": _operation("Embeddings (pooling models)", EmbeddingRequest, "embeddings")},
        "/pooling": {"post": _operation("Raw pooled outputs (pooling models)", PoolingRequest, "pooled outputs")},
        "/classify": {"post": _operation("Classification scores (classifiers, reward models)",
                                         ClassificationRequest, "class probabilities")},
        "/score": {"post": _operation("Text-pair scores (cross-encoder or embedding cosine)", ScoreRequest,
                                      "scores")},
        "/rerank": {"post": _operation("Rerank documents for a query (Jina / Cohere shape)", RerankRequest,
                                       "ranked results")},
    }
    paths["/v1/models/{model}"]["get"]["parameters"] = [
        {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}
    ]
    return {
        "openapi": "3.1.0",
        "info": {"title": "Trillium data plane (OpenAI-compatible)", "version": version},
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }

"""Request bodies of the pooling routes (routes/pooling.py, routes/scores.py), vLLM's names.

Mirrors vllm/entrypoints/pooling/{embed,classify,pooling,score}/protocol.py:
`input` is a string, a list of strings, a token-id list or a list of
token-id lists (OpenAI's embeddings input); `use_activation` (and its older
names `normalize` for embeddings, `activation` / `softmax` for scores) picks
normalization / softmax per request, null meaning the server's default.
Rerank also takes Jina / Cohere's `return_documents`. As everywhere on the
data plane, strict types and no silently ignored field: an undeclared one
(`truncate_prompt_tokens`, `messages`, ...) is a 400 unless null.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from trillium.data_plane.errors import bad_request
from trillium.data_plane.protocol import Int64, _Body


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def pooling_inputs(value: Any, param: str = "input") -> list[str | list[int]]:
    """OpenAI's embeddings `input` as a list of texts or token-id lists; 400 naming `param`."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and _is_ids(value):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, str) or (_is_ids(v) and v) for v in value):
        return list(value)
    raise bad_request(f"{param}: must be a non-empty string, list of strings, token-id list or list of "
                      "token-id lists", param)


class _PoolingBody(_Body):
    model: str | None = None
    user: str | None = None  # informational (request_fields.INFORMATIONAL_FIELDS)
    priority: Int64 = 0
    use_activation: bool | None = None

    def wants_activation(self) -> bool | None:
        return self.use_activation


class EmbeddingRequest(_PoolingBody):
    input: Any
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Int64 | None = None
    add_special_tokens: bool = True
    normalize: bool | None = None  # vLLM's older name of use_activation

    def wants_activation(self) -> bool | None:
        return self.use_activation if self.use_activation is not None else self.normalize


class PoolingRequest(EmbeddingRequest):
    """vLLM's /pooling: the model's own task's output, raw when use_activation is false."""


class ClassificationRequest(_PoolingBody):
    input: Any
    add_special_tokens: bool = True


class _ScoreBody(_PoolingBody):
    activation_: bool | None = Field(default=None, alias="activation")  # vLLM's deprecated names
    softmax: bool | None = None

    def wants_activation(self) -> bool | None:
        for value in (self.use_activation, self.activation_, self.softmax):
            if value is not None:
                return value
        return None


class ScoreRequest(_ScoreBody):
    text_1: str | list[str]
    text_2: str | list[str]


class RerankRequest(_ScoreBody):
    query: str
    documents: list[str]
    top_n: Int64 = 0  # 0: every document
    return_documents: bool = True  # Jina / Cohere; vLLM always returns them

    @field_validator("top_n")
    @classmethod
    def _top_n(cls, value: int) -> int:
        if value < 0:
            raise ValueError("must be >= 0 (0: every document)")
        return value

    @field_validator("documents")
    @classmethod
    def _documents(cls, value: list[str]) -> list[str]:
        if not value:
            raise ValueError("must list at least one document")
        return value


__all__ = ["ClassificationRequest", "EmbeddingRequest", "PoolingRequest", "RerankRequest", "ScoreRequest",
           "pooling_inputs"]

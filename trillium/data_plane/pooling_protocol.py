"""Request bodies of the pooling routes (routes/pooling.py, routes/scores.py), vLLM's names.

Mirrors vllm/entrypoints/pooling/{embed,classify,pooling,score}/protocol.py:
`input` is a string, a list of strings, a token-id list or a list of
token-id lists (OpenAI's embeddings input); `use_activation` (and its older
names `normalize` for embeddings, `activation` / `softmax` for scores) picks
normalization / softmax per request, null meaning the server's default.
Rerank also takes Jina / Cohere's `return_documents`. Every body takes
`truncate_prompt_tokens` (-1: the context; k: keep the last k tokens, or
the first k with `truncation_side` "right"; vllm/entrypoints/pooling/base/
protocol.py PoolingBasicRequestMixin, vllm/entrypoints/renderer.py).
/v1/embeddings, /pooling and /classify take chat `messages` instead of
`input` (ChatRequestMixin: rendered with the chat template;
`add_generation_prompt` and `continue_final_message` false and
`add_special_tokens` false by default, `chat_template_kwargs`,
`chat_template`). As everywhere on the data plane, strict types and no
silently ignored field: an undeclared one is a 400 unless null.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from trillium.data_plane.errors import bad_request
from trillium.data_plane.protocol import ChatMessage, Int64, _Body


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
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=2**63 - 1)] | None = None
    truncation_side: Literal["left", "right"] | None = None

    def wants_activation(self) -> bool | None:
        return self.use_activation


class _InputOrMessages(_PoolingBody):
    """`input` (completion-style) or chat `messages`, exactly one (vLLM's two request kinds)."""

    input: Any = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: true for `input`, false for `messages` (vLLM)
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_kind(self):
        if (self.input is None) == (self.messages is None):
            raise bad_request("give exactly one of input and messages", "input")
        if self.messages is None:
            for key in ("add_generation_prompt", "continue_final_message", "chat_template", "chat_template_kwargs"):
                if key in self.model_fields_set and getattr(self, key) not in (None, False):
                    raise bad_request(f"{key}: only with messages", key)
        elif not self.messages:
            raise bad_request("messages: must not be empty", "messages")
        if self.add_generation_prompt and self.continue_final_message:
            raise bad_request("Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                              "continue_final_message")
        return self


class EmbeddingRequest(_InputOrMessages):
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Int64 | None = None
    normalize: bool | None = None  # vLLM's older name of use_activation

    def wants_activation(self) -> bool | None:
        return self.use_activation if self.use_activation is not None else self.normalize


class PoolingRequest(EmbeddingRequest):
    """vLLM's /pooling: the output of `task` (vllm/entrypoints/pooling/pooling/protocol.py;
    null: the model's default task), raw when use_activation is false."""

    task: str | None = None  # embed | classify | token_embed | token_classify (vllm/tasks.py)


class ClassificationRequest(_InputOrMessages):
    pass


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

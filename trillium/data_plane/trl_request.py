"""TRL vllm-serve's `/generate/` body -> engine requests, and the response's logprob rows (pure, no I/O).

The body is TRL's `GenerateRequest` (huggingface/trl, trl/scripts/vllm_serve.py), what
`VLLMClient.generate` sends (trl/generation/vllm_client.py), with its defaults:

    prompts                  a non-empty list of strings or of token-id lists
    images                   null, or one null per prompt (multimodal prompts are a 400)
    n: 1, repetition_penalty: 1.0, temperature: 1.0, top_p: 1.0, top_k: -1, min_p: 0.0,
    max_tokens: 16
    logprobs: 0              top-N per token besides the sampled one; null: no logprobs
    structured_outputs_regex null (a regex is a 400: not implemented)
    generation_kwargs: {}    more vLLM SamplingParams fields, overriding the ones above

TRL's server passes generation_kwargs straight to vLLM's SamplingParams; here
they are the fields Trillium's SamplingParams has under vLLM's names
(`TrlGenerationKwargs`), and any other is a 400 naming `generation_kwargs.<key>`
(data_plane/request_fields.py: no field silently ignored).

`sampling_params(req)` builds the engine's SamplingParams; `logprob_row(entry, n)`
is one token's row of the response as vLLM's LLM.generate + TRL's
`extract_logprobs` shape it: the sampled token and the top-n, sorted by rank
(most probable first), n entries when the sampled token is among the top n,
else n + 1.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from trillium.actors.protocol.execute import TokenLogprobs
from trillium.data_plane.errors import bad_request
from trillium.data_plane.logprobs import MIN_LOGPROB
from trillium.data_plane.protocol import MAX_N, Int64
from trillium.sampling_params import SamplingParams

_TOKEN_LISTS = Annotated[list[Annotated[list[Int64], Field(min_length=1)]], Field(min_length=1)]
_TEXTS = Annotated[list[str], Field(min_length=1)]
# generation_kwargs fields that vLLM (and Trillium) let be null, meaning: unbounded / unseeded / none.
_NULLABLE = ("max_tokens", "seed", "logprobs", "logit_bias", "allowed_token_ids")


class _TrlBody(BaseModel):
    # WHY extra="allow": undeclared fields are kept aside so refuse_unimplemented names them (400).
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)


class TrlGenerationKwargs(_TrlBody):
    """vLLM SamplingParams fields Trillium implements, by vLLM's names (null: see _NULLABLE)."""

    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    min_p: float | None = None
    seed: Int64 | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    max_tokens: Int64 | None = None
    min_tokens: Int64 | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Int64] | None = None
    ignore_eos: bool | None = None
    logprobs: Int64 | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    allowed_token_ids: list[Int64] | None = None
    logit_bias: dict[str, float] | None = None


class TrlGenerateRequest(_TrlBody):
    prompts: _TOKEN_LISTS | _TEXTS
    images: list[list[str] | None] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: Int64 = -1
    min_p: float = 0.0
    max_tokens: Int64 = 16
    logprobs: Int64 | None = 0
    structured_outputs_regex: str | None = None
    generation_kwargs: TrlGenerationKwargs = Field(default_factory=TrlGenerationKwargs)

    @field_validator("images")
    @classmethod
    def _no_images(cls, value: Any) -> Any:
        if value is not None and any(entry is not None for entry in value):
            raise ValueError("multimodal prompts are not supported (give null or one null per prompt)")
        return value

    @property
    def token_prompts(self) -> bool:
        return isinstance(self.prompts[0], list)


def sampling_params(req: TrlGenerateRequest) -> SamplingParams:
    """TRL's top-level fields, then generation_kwargs over them (TRL's dict.update)."""
    if req.structured_outputs_regex is not None:
        raise bad_request("structured_outputs_regex: structured outputs are not implemented",
                          "structured_outputs_regex")
    if req.images is not None and len(req.images) != len(req.prompts):
        raise bad_request(f"images: one entry per prompt ({len(req.prompts)}), got {len(req.images)}", "images")
    kwargs: dict[str, Any] = {
        "n": req.n, "repetition_penalty": req.repetition_penalty, "temperature": req.temperature,
        "top_p": req.top_p, "top_k": req.top_k, "min_p": req.min_p, "max_tokens": req.max_tokens,
        "logprobs": req.logprobs,
    }
    extra = req.generation_kwargs
    for name in extra.model_fields_set:
        value = getattr(extra, name)
        if value is None and name not in _NULLABLE:
            raise bad_request(f"generation_kwargs.{name}: must not be null", f"generation_kwargs.{name}")
        kwargs[name] = value
    if isinstance(kwargs.get("stop"), str):
        kwargs["stop"] = (kwargs["stop"],)
    for name in ("stop_token_ids", "allowed_token_ids"):
        if kwargs.get(name) is not None:
            kwargs[name] = tuple(kwargs[name])
    if kwargs.get("logit_bias") is not None:
        try:
            kwargs["logit_bias"] = {int(k): v for k, v in kwargs["logit_bias"].items()}
        except ValueError:
            raise bad_request("generation_kwargs.logit_bias: keys must be token ids",
                              "generation_kwargs.logit_bias") from None
    return SamplingParams(**kwargs)


def logprob_row(entry: TokenLogprobs, num_top: int) -> tuple[list[float], list[int]]:
    """(logprobs, token ids) of one generated token, most probable first (module docstring)."""
    ids = list(entry.top_token_ids[:num_top])
    logprobs = [max(lp, MIN_LOGPROB) for lp in entry.top_logprobs[:num_top]]
    if entry.token_id not in ids:  # its rank is past the top n: it comes last
        ids.append(entry.token_id)
        logprobs.append(max(entry.logprob, MIN_LOGPROB))
    return logprobs, ids


__all__ = ["TrlGenerateRequest", "TrlGenerationKwargs", "logprob_row", "sampling_params"]

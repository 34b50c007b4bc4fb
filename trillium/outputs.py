"""Result objects of the offline API, shaped like vLLM's.

    RequestOutput.outputs[i].text / .token_ids / .logprobs / .finish_reason

`logprobs` is a list (one entry per generated token) of dicts mapping token
id -> `Logprob(logprob, rank, decoded_token)`, holding the sampled token and
the top-N, as vLLM returns them.
"""

from __future__ import annotations

import attrs


@attrs.frozen
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@attrs.define
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = attrs.field(factory=list)
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@attrs.define
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0
    finished: bool = False

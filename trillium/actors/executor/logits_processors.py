"""Per-request logits processors: the constraints a request brings to the sampler.

Role: each processor is built once, when the request reaches the executor
(`build_logits_processors(params, ...)`, from its `SamplingParams`), lives in
the request's `SamplingState`, and is applied by the sampler at its one seam
(`sampler.process_logits`) to that request's row of the step's logits, in
place, before logit_bias, min_tokens and the penalties, as vLLM v1's
`Sampler.forward` orders them (allowed_token_ids, then bad_words).

    AllowedTokenIds   every id outside the set -> -inf       (a [V] mask, on the device)
    BadWords          for each banned sequence w1..wk: when the last k-1
                      generated tokens are w1..wk-1, wk -> -inf

State: `AllowedTokenIds` owns its mask; `BadWords` only its sequences (it
reads the generated tokens the sampler passes in). No processor depends on
other rows, so a request's tokens never depend on its batch.

NOTE: bad words are matched against generated tokens only, never the
prompt (vLLM's `apply_bad_words` passes the output token ids), so a banned
word may be completed across the prompt/output boundary, as in vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from trillium.sampling_params import SamplingParams


class LogitsProcessor(Protocol):
    """One request's constraint on its own row of logits."""

    def apply(self, logits: torch.Tensor, output_token_ids: Sequence[int]) -> None:
        """Change `logits` [V] (float32, in place) given the tokens generated so far."""


class AllowedTokenIds:
    """vLLM's allowed_token_ids: only the listed ids can be sampled."""

    def __init__(self, token_ids: Sequence[int], vocab_size: int, device: torch.device) -> None:
        self.disallowed = torch.ones(vocab_size, dtype=torch.bool, device=device)
        self.disallowed[torch.as_tensor(list(token_ids), dtype=torch.long).to(device)] = False

    def apply(self, logits: torch.Tensor, output_token_ids: Sequence[int]) -> None:
        logits.masked_fill_(self.disallowed, float("-inf"))


class BadWords:
    """vLLM's bad_words, as token sequences: a sequence is never completed.

    A one-token word is banned at every step; a longer one only where the
    generated tokens end with all of it but its last token."""

    def __init__(self, words: Sequence[Sequence[int]]) -> None:
        self.words = [tuple(int(t) for t in word) for word in words]

    def banned_token_ids(self, output_token_ids: Sequence[int]) -> list[int]:
        banned = []
        num_output = len(output_token_ids)
        for word in self.words:
            prefix_len = len(word) - 1
            if prefix_len > num_output:
                continue
            if prefix_len == 0 or tuple(output_token_ids[num_output - prefix_len:]) == word[:-1]:
                banned.append(word[-1])
        return banned

    def apply(self, logits: torch.Tensor, output_token_ids: Sequence[int]) -> None:
        banned = self.banned_token_ids(output_token_ids)
        if banned:
            logits[torch.as_tensor(banned, dtype=torch.long).to(logits.device)] = float("-inf")


def build_logits_processors(
    params: SamplingParams, vocab_size: int, device: torch.device
) -> tuple[LogitsProcessor, ...]:
    """The processors `params` asks for, in the order the sampler applies them."""
    processors: list[LogitsProcessor] = []
    if params.allowed_token_ids is not None:
        processors.append(AllowedTokenIds(params.allowed_token_ids, vocab_size, device))
    if params.bad_words_token_ids:
        processors.append(BadWords(params.bad_words_token_ids))
    return tuple(processors)


__all__ = ["AllowedTokenIds", "BadWords", "LogitsProcessor", "build_logits_processors"]

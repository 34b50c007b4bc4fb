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
    ThinkingBudget    vLLM's thinking_token_budget: after that many tokens
                      inside <think>..., every id but the next token of the
                      end-of-thinking sequence -> -inf, until it is written

State: `AllowedTokenIds` owns its mask; `BadWords` only its sequences (it
reads the generated tokens the sampler passes in); `ThinkingBudget` where the
open thinking began, kept up to date from the tokens it is shown. No
processor depends on other rows, so a request's tokens never depend on its
batch.

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


class ThinkingBudget:
    """vLLM's `thinking_token_budget` (its ThinkingTokenBudgetLogitsProcessor,
    vllm/v1/sample/logits_processor/builtin.py): at most `budget` tokens after
    the last unclosed start-of-thinking sequence, then the end-of-thinking
    sequence is forced one token at a time; a start in the prompt (templates
    that open `<think>` for the model) counts the prompt's thinking tokens too.

    State is a function of the tokens shown: `_tokens` is the prompt and the
    output read so far, `_think_from` where the open thinking's content starts
    in it (None when not thinking). Shown fewer tokens than it has read (a
    sequence rolled back), it reads them again from the start.
    """

    def __init__(self, budget: int, start_ids: Sequence[int], end_ids: Sequence[int],
                 prompt_token_ids: Sequence[int]) -> None:
        self.budget = budget
        self.start = [int(t) for t in start_ids]
        self.end = [int(t) for t in end_ids]
        self.prompt = [int(t) for t in prompt_token_ids]
        self._reset()

    def _reset(self) -> None:
        self._tokens: list[int] = []
        self._think_from: int | None = None
        self._read(self.prompt)

    def _read(self, new_tokens: Sequence[int]) -> None:
        for token in new_tokens:
            self._tokens.append(int(token))
            if self._think_from is None:
                if self._tokens[-len(self.start):] == self.start:
                    self._think_from = len(self._tokens)
            elif self._tokens[-len(self.end):] == self.end:
                self._think_from = None

    def forced_token(self, output_token_ids: Sequence[int]) -> int | None:
        """The token the next position must be, or None when sampling is free."""
        read = len(self._tokens) - len(self.prompt)
        if len(output_token_ids) < read:
            self._reset()
            read = 0
        self._read(output_token_ids[read:])
        if self._think_from is None:
            return None
        written = len(self._tokens) - self._think_from
        if written < self.budget:
            return None
        # The budget is spent: the end sequence is written after `budget`
        # thinking tokens; the forced tokens so far are its first ones.
        return self.end[min(written - self.budget, len(self.end) - 1)]

    def apply(self, logits: torch.Tensor, output_token_ids: Sequence[int]) -> None:
        forced = self.forced_token(output_token_ids)
        if forced is not None:
            logits.fill_(float("-inf"))
            logits[forced] = 0.0


def build_logits_processors(
    params: SamplingParams, vocab_size: int, device: torch.device, prompt_token_ids: Sequence[int] = ()
) -> tuple[LogitsProcessor, ...]:
    """The processors `params` asks for, in the order the sampler applies them."""
    processors: list[LogitsProcessor] = []
    if params.allowed_token_ids is not None:
        processors.append(AllowedTokenIds(params.allowed_token_ids, vocab_size, device))
    if params.bad_words_token_ids:
        processors.append(BadWords(params.bad_words_token_ids))
    if params.thinking_token_budget is not None:
        processors.append(ThinkingBudget(params.thinking_token_budget, params.think_start_token_ids,
                                         params.think_end_token_ids, prompt_token_ids))
    return tuple(processors)


__all__ = ["AllowedTokenIds", "BadWords", "LogitsProcessor", "ThinkingBudget", "build_logits_processors"]

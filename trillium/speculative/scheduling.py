"""The scheduler's side of speculative decoding: the draft budget and its counters.

Pure Python, handed to the scheduler core when it is built (`DraftBudget`,
or `NO_DRAFTS` when speculative decoding is off). The core asks it how many
of a decoding request's proposed drafts this step verifies (`num_to_verify`)
and reports each verified request's outcome (`verified`).

The draft count is bounded so that the step stays exact and in budget:
never more than proposed, than the step's token budget leaves after the
request's own token, than max_tokens leaves (every emitted token is one of
the request's max_tokens: d drafts emit up to d + 1), or than max_model_len
leaves. Rollback (the core applies it, `rolled_back_computed`): after a
verification the request's KV is valid for its tokens but the last one, so
`num_computed_tokens = num_tokens - 1`, and blocks past that are freed.

Counters, lifetime totals in vLLM's sense (vllm/v1/spec_decode/metrics.py
SpecDecodingStats): drafts (verifications with at least one draft), draft
tokens, accepted tokens, and accepted tokens per draft position.
"""

from __future__ import annotations


class DraftBudget:
    def __init__(self, num_speculative_tokens: int) -> None:
        self.k = num_speculative_tokens
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * num_speculative_tokens

    def num_to_verify(self, num_proposed: int, budget_left: int, num_output_tokens: int, max_tokens: int,
                      num_tokens: int, max_model_len: int) -> int:
        """Drafts to schedule beside a decoding request's one token (0: none)."""
        return max(0, min(num_proposed, self.k, budget_left - 1, max_tokens - num_output_tokens - 1,
                          max_model_len - num_tokens - 1))

    def verified(self, num_drafts: int, num_accepted: int) -> None:
        if num_drafts <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for pos in range(min(num_accepted, self.k)):
            self.accepted_per_pos[pos] += 1

    def stats(self) -> dict:
        """SchedulerStats fields (lifetime totals)."""
        return dict(
            spec_decode_num_drafts_total=self.num_drafts,
            spec_decode_num_draft_tokens_total=self.num_draft_tokens,
            spec_decode_num_accepted_tokens_total=self.num_accepted_tokens,
            spec_decode_num_accepted_tokens_per_pos_total=tuple(self.accepted_per_pos),
        )


NO_DRAFTS = DraftBudget(0)
"""Speculative decoding off: never a draft (num_to_verify is 0 with k = 0), no counters."""


def build_draft_budget(speculative_config) -> DraftBudget:
    if not speculative_config.enabled:
        return NO_DRAFTS
    return DraftBudget(speculative_config.num_speculative_tokens)

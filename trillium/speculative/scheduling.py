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

disable_by_batch_size (vLLM's key; its v0 spec_decode_worker's rule, off when
`disable_by_batch_size < running_queue_size`): `begin_step` is told how many
requests are running when a step is planned, before it admits waiting ones;
above the threshold the step verifies no drafts at all. Drafts are proposed
at the end of the step before the one that verifies them, so each batch
also says whether the executor should propose (`proposes_next`): only when
the running requests after this step's admission are within the threshold.
That count never grows before the next step is planned (admission comes
after its draft decisions), so no proposal is made for a step that drops it;
when requests finish, the first step back under the threshold has none yet.

Counters, lifetime totals in vLLM's sense (vllm/v1/spec_decode/metrics.py
SpecDecodingStats): drafts (verifications with at least one draft), draft
tokens, accepted tokens, and accepted tokens per draft position; and
Trillium's own: steps planned with speculation off by disable_by_batch_size.
"""

from __future__ import annotations


class DraftBudget:
    def __init__(self, num_speculative_tokens: int, disable_by_batch_size: int = 0) -> None:
        self.k = num_speculative_tokens
        self.disable_by_batch_size = disable_by_batch_size  # 0: never off
        self._off = False  # this step: more running requests than disable_by_batch_size
        self.num_steps_disabled = 0
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * num_speculative_tokens

    def begin_step(self, num_running: int) -> None:
        """A step is being planned with `num_running` requests running (before admission)."""
        self._off = self._over(num_running)
        if self._off:
            self.num_steps_disabled += 1

    def proposes_next(self, num_running: int) -> bool:
        """Whether the executor proposes after this step, `num_running` running after admission."""
        return not self._over(num_running)

    def _over(self, num_running: int) -> bool:
        return 0 < self.disable_by_batch_size < num_running

    def num_to_verify(self, num_proposed: int, budget_left: int, num_output_tokens: int, max_tokens: int,
                      num_tokens: int, max_model_len: int) -> int:
        """Drafts to schedule beside a decoding request's one token (0: none)."""
        if self._off:
            return 0
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
            spec_decode_num_steps_disabled_by_batch_size_total=self.num_steps_disabled,
        )


NO_DRAFTS = DraftBudget(0)
"""Speculative decoding off: never a draft (num_to_verify is 0 with k = 0), no counters
(disable_by_batch_size 0: begin_step never changes it)."""


def build_draft_budget(speculative_config) -> DraftBudget:
    if not speculative_config.enabled:
        return NO_DRAFTS
    return DraftBudget(speculative_config.num_speculative_tokens, speculative_config.disable_by_batch_size)

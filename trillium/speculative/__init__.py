"""Speculative decoding: proposers, exact verification, and the scheduler's draft budget.

    config.py      SpeculativeConfig (vLLM's --speculative-config keys), parsed once at start-up
    proposer.py    the Proposer protocol, NgramProposer (prompt lookup), AdaptiveDepth (k per request)
    verify.py      rejection sampling over the target's processed distributions (executor side)
    scheduling.py  DraftBudget: how many drafts a step verifies, rollback rule, the metrics totals

Flow (vLLM v1's shape): after sampling, the executor proposes up to k draft
tokens per request and keeps them; `BatchResult.proposed_drafts` tells the
scheduler how many. The next step schedules 1 + d tokens for such a request
(`ExecuteBatch.num_draft_tokens`), the executor scores all of them in one
forward and `verify.verify_drafts` accepts a prefix and emits one more token.
The scheduler appends the emitted tokens and sets `num_computed_tokens` to
num_tokens - 1 (the rejected positions' KV is dropped), freeing the blocks past it.
"""

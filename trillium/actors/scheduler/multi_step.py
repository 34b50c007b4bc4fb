"""Multi-step decode: vLLM's --num-scheduler-steps (its v0 multi-step scheduling).

A decode step of a request may run up to `num_scheduler_steps` forwards on the
executor before its result comes back: the first feeds the request's last
known token, as any decode step; each later one feeds the token the one
before it sampled. The scheduler reserves the KV of every forward up front
and gets all the tokens in one `BatchResult`. WHY: on a small CPU the hops
around a step (the scheduler, the detokenizer, the api, four ZeroMQ messages)
cost a one-stream token ~3.6 ms of CPU beside a ~5 ms forward (README, issue
18); running K forwards per round trip plans once per K tokens, and with
--stream-interval K pays every hop once per K tokens.

It rides the speculative-decoding positions (trillium/speculative/): a
request running k more forwards is scheduled 1 + k tokens with
`num_draft_tokens` k, and its result carries `sampled_token_ids` (the first
forward's token) and `more_token_ids` (the others'), so the scheduler appends
them as it appends verified drafts (up to the first token that finishes the
request). Unlike drafts nothing is rolled back: a run keeps every forward's
token, or ends at a stop token id, which finishes the request (its blocks are
cached only up to its last token fed). The two cannot both be on (config.py).
The executor (ExecutorCore._run_ahead) samples each forward exactly as a decode
step would: the same sampler, penalties, seeded generators, grammar matcher
and logprobs, each seeing the tokens before it (argmax-only rows: native
greedy runs, the same bits); a run ends early after an EOS or stop token id
once min_tokens is reached, where the scheduler ends the request.

Streaming: every --stream-interval forwards (default 1: each), the executor
sends the tokens sampled since its last send as AheadTokens, before the
next forward starts (executor/actor.py AheadTokensSender: the torch thread
does not wait for the send); the scheduler passes them on to the
detokenizer at once (Scheduler.ahead_tokens; with async scheduling those of
a step behind one in flight after that one's result) and the step's result then
sends only the tokens past them. A run's last token is never sent ahead
(it may finish the request), so no streamed token is one past a stop. WHY:
without it a client sees a step's K tokens in one burst. The cost: each
AheadTokens is a message through the scheduler, the detokenizer and the
api (~1.8 ms of CPU for one stream on the 2-core box, taken from the
forward's cores), so a server after one stream's throughput sets
--stream-interval K.

With async scheduling (in_flight.py) the next step is planned while one runs, over
its K placeholders: the executor goes from one step's K forwards to the next's
without waiting for the scheduler's round trip (~4 ms a step on the 2-core box).

When: only while no request waits, every running request decodes and the
free KV blocks hold all their K tokens (extra forwards never preempt).
WHY: a waiting request's prefill, or a running one's next prompt chunk,
would wait the K forwards of the decoding ones; vLLM's v0 multi-step did the
same (it ran prefills in single steps). An abort or a stop string takes
effect after the step's K forwards (with async scheduling the step planned
behind it computes up to K more, whose tokens are dropped).
"""

from __future__ import annotations

from collections.abc import Sequence


def steps_ahead(num_scheduler_steps: int, running: Sequence, num_waiting: int, num_free_blocks: int,
                block_size: int) -> int:
    """Forwards beyond the first that a decoding request may run this step (0: one forward):
    num_scheduler_steps - 1 while nothing waits, every running request decodes and the free
    blocks hold every running request's K tokens. WHY the last: the first requests' extra blocks
    must not leave a later one without room for its own token (it would preempt one)."""
    if num_scheduler_steps <= 1 or num_waiting:
        return 0
    if any(r.num_tokens - r.num_computed_tokens > 1 for r in running):  # a prompt still being prefilled
        return 0
    if num_free_blocks < len(running) * (-(-num_scheduler_steps // block_size) + 1):
        return 0
    return num_scheduler_steps - 1


def extra_forwards(ahead: int, budget_left: int, num_output_tokens: int, max_tokens: int, num_tokens: int,
                   max_model_len: int) -> int:
    """Forwards beside a decoding request's first: at most `ahead`, and never more than the
    step's token budget leaves after its own token, than max_tokens leaves (each forward
    emits one of them) or than max_model_len leaves."""
    return max(0, min(ahead, budget_left - 1, max_tokens - num_output_tokens - 1, max_model_len - num_tokens - 1))

"""Exact verification of draft tokens: rejection sampling over the target's distributions.

Executor side, pure torch. Input: the target's logits at every scored
position of each speculative request (row 0 follows the last known token,
row j follows draft j-1), the request's `SamplingState` and its drafts.
Output per request: the tokens emitted this step (accepted drafts, then one
more), their logprobs, and how many drafts were accepted.

Exactness. A draft x is a point mass, so the rule of Leviathan et al. /
Chen et al. is: accept with probability p(x), where p is the target's fully
processed distribution at that position (grammar mask, logits processors,
logit bias, min_tokens, penalties, temperature, min_p, top_k, top_p: the
sampler's own stages, `sampler.process_logits` and `sampler.target_probs`);
on rejection emit a token from p with x removed (renormalised: the
exponential race needs no normalising). P(emit x) = p(x) and
P(emit y != x) = (1 - p(x)) p(y) / (1 - p(x)) = p(y): exactly p. A greedy row
accepts iff argmax == x and emits the argmax either way, so greedy output is
the non-speculative output token for token. After the last draft is accepted
one bonus token is sampled from p at the next row.

Positions are processed in order, batched over the requests still running:
the state sees the accepted tokens before the next position's logits are
processed (`SamplingState.append`), so penalties, min_tokens, logits
processors and the grammar matcher see exactly the prefix the target would
have seen; rejected drafts never reach the state (nothing to roll back).
The uniform draw and the race use the request's own generator when seeded.

Greedy runs that nothing processes (no penalties, bias, processors, grammar,
logprobs; min_tokens reached) skip the per-position loop: one argmax over all
their rows (`_verify_greedy`), since each position's argmax is then the same
whatever was accepted before it.

A run also ends after an emitted EOS / stop token id: later positions are
conditioned on a token that usually ends the request (and a finished
grammar matcher has no next mask). Ending a run early, on tokens already
emitted, keeps exactness: the next token is sampled by the next step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs
import torch

from trillium.actors.executor.grammar import apply_grammar_bitmask
from trillium.actors.executor.sampler import SamplingState, gather_logprobs, process_logits, race, target_probs
from trillium.actors.protocol.execute import TokenLogprobs


@attrs.define
class DraftRun:
    """One speculative request of the step: its state, drafts, first logits row."""

    state: SamplingState
    drafts: list[int]
    first_row: int
    stop_ids: frozenset[int] = frozenset()  # tokens that end a run (EOS, stop token ids)
    tokens: list[int] = attrs.Factory(list)  # emitted
    logprobs: list[TokenLogprobs] = attrs.Factory(list)
    num_accepted: int = 0
    done: bool = False


# accept(p_x, u) -> bool: the acceptance rule; tests swap in a wrong one to show the
# statistical test fails with it.
AcceptRule = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def exact_accept(p_x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return u < p_x


def verify_drafts(logits: torch.Tensor, runs: Sequence[DraftRun], accept: AcceptRule = exact_accept) -> None:
    """Fill each run's tokens / logprobs / num_accepted from `logits` [rows, V]
    (run r owns rows first_row .. first_row + len(drafts)). Appends every
    emitted token to the run's SamplingState."""
    plain = [r for r in runs if _unprocessed_greedy(r)]
    if plain:
        _verify_greedy(logits, plain)
        runs = [r for r in runs if not r.done]
    depth = max((len(r.drafts) for r in runs), default=-1)
    for j in range(depth + 1):
        alive = [r for r in runs if not r.done and j <= len(r.drafts)]
        if not alive:
            break
        index = torch.tensor([r.first_row + j for r in alive], dtype=torch.long, device=logits.device)
        rows = logits.index_select(0, index).float()
        tokens, accepted = _position(rows, alive, j, accept)
        for r, token, ok in zip(alive, tokens, accepted):
            r.tokens.append(token)
            r.state.append(token)
            if ok:
                r.num_accepted += 1
            if not ok or j == len(r.drafts) or token in r.stop_ids:
                r.done = True


def _unprocessed_greedy(run: DraftRun) -> bool:
    """Greedy, and no stage would touch its logits at any of its positions: no logits
    processors, bias, penalties, grammar or logprobs, min_tokens already reached (it
    only counts up). Its tokens are then the raw rows' argmax, whatever came before."""
    s = run.state
    return (s.is_greedy and s.grammar is None and s.params.logprobs is None and not s.processors
            and not s.bias_token_ids and not s.has_penalties
            and (not s.min_tokens_stop_ids or s.num_output_tokens >= s.params.min_tokens))


def _verify_greedy(logits: torch.Tensor, runs: Sequence[DraftRun]) -> None:
    """Every position of these runs at once: one argmax and one host copy for the step
    (the per-position loop would process and copy each position of each run in turn).
    Same tokens: with nothing processed, a position's argmax does not depend on the
    tokens accepted before it."""
    index = torch.tensor([r.first_row + j for r in runs for j in range(len(r.drafts) + 1)], dtype=torch.long,
                         device=logits.device)
    best = logits.index_select(0, index).float().argmax(dim=-1).tolist()
    at = 0
    for r in runs:
        for j in range(len(r.drafts) + 1):
            token = best[at + j]
            r.tokens.append(token)
            r.state.append(token)
            ok = j < len(r.drafts) and token == r.drafts[j]
            r.num_accepted += ok
            if not ok or token in r.stop_ids:
                break
        r.done = True
        at += len(r.drafts) + 1


def _position(rows: torch.Tensor, runs: Sequence[DraftRun], j: int, accept: AcceptRule):
    """Tokens emitted at position j and whether each was the accepted draft."""
    states = [r.state for r in runs]
    if any(s.grammar is not None for s in states):
        apply_grammar_bitmask(rows, [s.grammar for s in states], [s.output_token_ids for s in states])
    lp_rows = [i for i, s in enumerate(states) if s.params.logprobs is not None]
    raw = rows[lp_rows].log_softmax(dim=-1) if lp_rows else None
    process_logits(rows, states)
    drafts = [r.drafts[j] if j < len(r.drafts) else -1 for r in runs]
    tokens = rows.argmax(dim=-1).tolist()  # greedy rows: the answer; random rows: replaced below
    accepted = [d >= 0 and t == d for d, t in zip(drafts, tokens)]
    random_rows = [i for i, s in enumerate(states) if not s.is_greedy]
    if random_rows:
        sub = rows[random_rows]
        sub_states = [states[i] for i in random_rows]
        probs = target_probs(sub, sub_states)
        drafted = [k for k, i in enumerate(random_rows) if drafts[i] >= 0]  # the rest: bonus, plain sampling
        for i in random_rows:
            accepted[i] = False
        if drafted:
            index = torch.tensor(drafted, dtype=torch.long, device=probs.device)
            x = torch.tensor([drafts[random_rows[k]] for k in drafted], dtype=torch.long, device=probs.device)
            p_x = probs[index, x]
            u = _uniforms([sub_states[k] for k in drafted], probs.device)
            # WHY the second test: p(x) == 1 up to rounding leaves no other token to draw.
            ok = accept(p_x, u) | (probs[index].sum(dim=-1) - p_x <= 0.0)
            probs[index, x] = torch.where(ok, probs[index, x], 0.0)  # rejected rows: the residual, p without x
            for k, good in zip(drafted, ok.tolist()):
                accepted[random_rows[k]] = good
        draw = [k for k, i in enumerate(random_rows) if not accepted[i]]
        if draw:
            picks = race(probs[draw], [sub_states[k] for k in draw]).tolist()
            for k, token in zip(draw, picks):
                tokens[random_rows[k]] = token
        for i in random_rows:
            if accepted[i]:
                tokens[i] = drafts[i]
    if raw is not None:
        _record_logprobs(raw, lp_rows, tokens, runs, states)
    return tokens, accepted


def _uniforms(states: Sequence[SamplingState], device) -> torch.Tensor:
    """One U(0, 1) per row; seeded rows from their own generator (batch-independent)."""
    u = torch.rand(len(states), device=device)
    for k, state in enumerate(states):
        if state.generator is not None:
            u[k] = torch.rand((), generator=state.generator, device=device)
    return u


def _record_logprobs(raw: torch.Tensor, lp_rows: list[int], tokens: list[int], runs, states) -> None:
    ids = torch.tensor([tokens[i] for i in lp_rows], dtype=torch.long, device=raw.device)
    entries = gather_logprobs(raw, ids, [states[i].params.logprobs for i in lp_rows]).to_token_logprobs()
    for i, entry in zip(lp_rows, entries):
        runs[i].logprobs.append(entry)

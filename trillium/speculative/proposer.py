"""Draft proposers behind one protocol, and the per-request draft depth.

A `Proposer` sees a request's tokens (prompt + outputs so far) and returns
up to `max_tokens` guesses of what follows; it runs on the executor right
after a step sampled the request. It never changes what is generated, only
how fast: every draft is verified against the target (verify.py).

    EagleProposer   (eagle.py) an EAGLE head over the target's hidden states,
                    called once per step for the whole batch (HiddenStateProposer).
    NgramProposer   prompt lookup (vLLM's "ngram"): the longest suffix n-gram
                    (prompt_lookup_min..max tokens) found earlier in the
                    sequence, its earliest occurrence; the tokens after it.
                    No model. Mirrors vllm/v1/spec_decode/ngram_proposer.py.

    DraftModelProposer  a small model of the same vocabulary (vLLM's
                    "draft_model", speculative/draft_model.py): a
                    `BatchProposer`, proposing for every request of a step
                    in shared forwards, with a cache to free (`release`).

`AdaptiveDepth` is the per-request k, chosen for speed: it keeps an
exponential moving average of the request's per-position acceptance (weight
0.3 per verified step, starting at 1; a step that verified d drafts and
accepted a of them tried a + 1 positions, or d when all passed, and passed
a), and proposes the depth j <= k that maximises the expected tokens per
unit of time, (1 + α + ... + α^j) / (1 + j·c), at least 1 while α >= 0.15,
where c is what one more draft
costs relative to a step without drafts. `DraftCosts` measures c on the
executor: the time a verify row adds to a decode step plus the proposer's
time per draft position, over the time of a decode step without drafts
(0.1 until measured). So a cheap draft (a float target whose verify rows
cost little) keeps drafting at an acceptance where an expensive one (a
packed GGUF target whose rows cost arithmetic) drafts one. When no depth
beats none and α < 0.15, the request stops drafting and probes with one
draft every 8th step (so it can recover).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

import numpy as np

from trillium.speculative.config import SpeculativeConfig

_EMA_WEIGHT = 0.3
_PROBE_EVERY = 8  # a stopped request drafts once every this many steps
_UNMEASURED_COST = 0.1  # c before DraftCosts has seen a step with drafts
_STOP_BELOW = 0.15  # α under which a request may stop drafting (when no depth pays for itself)


class Proposer(Protocol):
    def propose(self, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        """Up to `max_tokens` draft tokens to follow `token_ids` (may be none)."""
        ...


class HiddenStateProposer(Protocol):
    """The batch-level hook (eagle.py): sees every scheduled request of the step with the
    target's hidden-state rows, once per step. `reads_hidden_states` is True."""

    reads_hidden_states: bool

    def propose_from_hidden(self, hidden, rows: Sequence[tuple]) -> dict[str, list[int]]:
        """rows: (request state, first row in `hidden`, rows scheduled, depth); drafts by request id."""
        ...


class BatchProposer(Protocol):
    """A proposer that drafts for all of a step's requests at once (a model: one forward per
    draft position for the whole batch) and keeps per-request state to free. `states` are the
    executor's request states (request_id, token_ids, ...); a proposer reading the target's
    hidden states can take the same call."""

    def propose_batch(self, states: Sequence, depths: Sequence[int]) -> list[list[int]]:
        ...

    def release(self, request_ids: Iterable[str]) -> None:
        """Requests that finished, were aborted or preempted: drop their state."""
        ...


class NgramProposer:
    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {min_n}, {max_n}")
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        tokens = np.asarray(token_ids, dtype=np.int64)
        total = tokens.shape[0]
        if max_tokens <= 0 or total <= self.min_n:
            return []
        # Longest n first: a longer matched context predicts better.
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            suffix = tokens[total - n:]
            # Windows that end before the last token (the suffix itself is not a match).
            windows = np.lib.stride_tricks.sliding_window_view(tokens[: total - 1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                start = int(hits[0]) + n  # the earliest occurrence, as vLLM's
                return tokens[start : start + max_tokens].tolist()
        return []


class AdaptiveDepth:
    """One request's draft depth (see the module docstring)."""

    __slots__ = ("k", "ema", "_idle")

    def __init__(self, k: int) -> None:
        self.k = k
        self.ema = 1.0  # per-position acceptance
        self._idle = 0  # steps without drafts since the last probe

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        if num_drafts > 0:
            tried = num_accepted + (num_accepted < num_drafts)  # positions up to the first rejection
            self.ema = (1 - _EMA_WEIGHT) * self.ema + _EMA_WEIGHT * (num_accepted / tried)

    def next_depth(self, relative_cost: float = _UNMEASURED_COST) -> int:
        """Drafts to propose for the next step (0: none this step); `relative_cost`: c, what one
        more draft costs relative to a step without drafts (DraftCosts.relative)."""
        best, best_rate = 0, 1.0
        expected, p = 1.0, 1.0  # expected tokens of a step verifying j drafts: 1 + α + ... + α^j
        for j in range(1, self.k + 1):
            p *= self.ema
            expected += p
            rate = expected / (1.0 + j * relative_cost)
            if rate > best_rate:
                best, best_rate = j, rate
        if best or self.ema >= _STOP_BELOW:  # WHY a floor: c is a moving measurement; α says the drafts are good
            self._idle = 0
            return max(best, 1)
        self._idle += 1
        if self._idle < _PROBE_EVERY:
            return 0
        self._idle = 0
        return 1


class DraftCosts:
    """What one more draft costs relative to a step without drafts, measured on the executor
    (exponential moving averages, weight 0.1, over decode steps: every row a decode or verify row):

        step_s      a decode step's time (forward, sampling, verification) with no draft rows
        row_s       the time each draft row adds: (a drafting step's time - step_s) / its draft rows
        position_s  the proposer's time per draft position (one proposer call drafts every
                    request's j-th token at once: a draft model's forward, n-gram lookups)

    relative() = (row_s + position_s) / step_s. WHY measured, not fixed: a verify row costs
    almost nothing where the weights' reads bound a step (float weights, a GPU) and a good
    fraction of one where arithmetic does (packed GGUF on a CPU), and a draft model's forward
    costs what its size and the device make it."""

    _WEIGHT = 0.1

    def __init__(self) -> None:
        self.step_s: float | None = None
        self.row_s: float | None = None
        self.position_s: float | None = None

    def _ema(self, old: float | None, sample: float) -> float:
        return sample if old is None else (1 - self._WEIGHT) * old + self._WEIGHT * sample

    def observe_step(self, seconds: float, num_draft_rows: int) -> None:
        """A decode step's time without its proposal, and how many draft rows it verified."""
        if num_draft_rows == 0:
            self.step_s = self._ema(self.step_s, seconds)
        elif self.step_s is not None:
            self.row_s = self._ema(self.row_s, max(0.0, seconds - self.step_s) / num_draft_rows)

    def observe_proposal(self, seconds: float, num_positions: int) -> None:
        if num_positions > 0:
            self.position_s = self._ema(self.position_s, seconds / num_positions)

    def relative(self) -> float:
        if self.step_s is None or self.row_s is None or self.position_s is None or self.step_s <= 0:
            return _UNMEASURED_COST
        return (self.row_s + self.position_s) / self.step_s


def drafts_left(max_tokens: int | None, num_tokens: int, num_prompt_tokens: int, max_model_len: int) -> int:
    """Drafts the scheduler could still verify for a request (DraftBudget caps them the same
    way); a model proposer's forwards past them would be wasted."""
    left = max_model_len - num_tokens - 1
    if max_tokens is not None:
        left = min(left, max_tokens - (num_tokens - num_prompt_tokens) - 1)
    return left


def build_proposer(config: SpeculativeConfig, **target) -> Proposer | BatchProposer | HiddenStateProposer | None:
    """The configured proposer; None when speculative decoding is off. `target`
    (model, engine_config: resolved, device): what a model-based proposer runs beside."""
    if not config.enabled:
        return None
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method == "eagle":
        from trillium.speculative.eagle import build_eagle_proposer

        return build_eagle_proposer(config, **target)
    if config.method == "draft_model":
        from trillium.speculative.draft_model import DraftModelProposer

        return DraftModelProposer(target["engine_config"], target["device"])
    raise ValueError(f"speculative method {config.method!r} has no proposer")

"""Batched token sampler: one step's last-position logits in, token ids out.

Pure torch, synchronous, device-agnostic (runs wherever the logits live); the
executor calls `sample` once per step with one `SamplingState` per sampled
sequence, in batch order, and then `append_tokens` with what was sampled.

State: a `SamplingState` per sequence, built once when the request reaches
the executor and kept across steps (and across preemption). It owns the
sequence's seeded `torch.Generator` and, only for requests with penalties, a
[V] count of generated tokens and a [V] mask of prompt tokens on the device.

The idea (vLLM v1's `Sampler.forward`, same order and semantics):

    grammar bitmask (structured outputs)        # vLLM applies it before its sampler
    raw logprobs = log_softmax(logits)          # before anything else
    per-request logits processors               # allowed_token_ids, bad_words
    logits += logit_bias                        # non-argmax-invariant
    logits[eos, stop ids] = -inf                # while outputs < min_tokens
    repetition (prompt+output), frequency, presence penalties
    greedy rows: argmax                         # done if all rows are greedy
    random rows: / temperature -> min_p -> top_k -> top_p -> softmax
                 -> argmax(probs / q), q ~ Exp(1)

The exponential race `argmax(p / q)` samples exactly from p; a seeded row
draws its q from its own generator, V values per step, so its tokens do not
depend on what else is in the batch or where it sits. Every stage runs as
one set of tensor ops over the rows that need it and is skipped when none
does; only the seeded q draws loop over rows.

NOTE: the order min_p -> top_k -> top_p is vLLM's (min_p is an argmax-invariant
logits processor applied before its top-k/top-p sampler), not top_k -> top_p
-> min_p.

NOTE on size (~420 lines): the per-request sampling state and the batched
logits processors it feeds are one pipeline; splitting them would put
the order above in two places.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from trillium.actors.executor.grammar import GrammarConstraint, apply_grammar_bitmask
from trillium.actors.executor.logits_processors import LogitsProcessor, build_logits_processors
from trillium.actors.protocol.execute import TokenLogprobs
from trillium.sampling_params import SamplingParams

# Same threshold as SamplingParams.greedy and vLLM's _SAMPLING_EPS.
_SAMPLING_EPS = 1e-5


class SamplingState:
    """One sequence's sampler state, created once per request by the executor.

    `sample_index` is the sequence's index among a request's n samples: like
    vLLM, child i of a seeded request draws from seed + i.
    """

    __slots__ = (
        "params", "vocab_size", "device", "is_greedy", "generator", "output_token_ids",
        "has_penalties", "output_counts", "prompt_mask", "bias_token_ids", "bias_values",
        "min_tokens_stop_ids", "processors", "grammar",
    )  # fmt: skip

    def __init__(
        self,
        params: SamplingParams,
        prompt_token_ids: Sequence[int],
        *,
        vocab_size: int,
        eos_token_ids: Sequence[int] = (),
        output_token_ids: Sequence[int] = (),
        device: torch.device | str = "cpu",
        sample_index: int = 0,
        grammar: GrammarConstraint | None = None,
    ) -> None:
        self.params = params
        # The structured-output matcher (executor/grammar.py), None when unconstrained.
        self.grammar = grammar
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.is_greedy = params.temperature < _SAMPLING_EPS
        self.generator: torch.Generator | None = None
        if not self.is_greedy and params.seed is not None:
            self.generator = torch.Generator(device=self.device)
            self.generator.manual_seed(params.seed + sample_index)
        self.output_token_ids: list[int] = []
        self.processors: tuple[LogitsProcessor, ...] = build_logits_processors(
            params, vocab_size, self.device, prompt_token_ids)
        # WHY: vLLM masks `all_stop_token_ids`, which holds the model's EOS even
        # when ignore_eos is set, so min_tokens masks EOS either way.
        stop_ids = set(params.stop_token_ids) | {int(t) for t in eos_token_ids}
        self.min_tokens_stop_ids = sorted(stop_ids) if params.min_tokens > 0 else []
        bias = params.logit_bias or {}
        self.bias_token_ids = list(bias.keys())
        self.bias_values = list(bias.values())
        self.has_penalties = (
            params.presence_penalty != 0.0
            or params.frequency_penalty != 0.0
            or params.repetition_penalty != 1.0
        )
        self.output_counts: torch.Tensor | None = None
        self.prompt_mask: torch.Tensor | None = None
        if self.has_penalties:
            self.output_counts = torch.zeros(vocab_size, dtype=torch.int32, device=self.device)
            self.prompt_mask = torch.zeros(vocab_size, dtype=torch.bool, device=self.device)
            prompt = _long_tensor(prompt_token_ids, self.device)
            if prompt.numel():
                self.prompt_mask[prompt] = True
        self.extend(output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def argmax_only(self) -> bool:
        """Does `sample` give this row the argmax of its raw logits, now and at every later token?
        Greedy with nothing that changes the logits (no grammar, logits processors, logit_bias or
        penalties; min_tokens already reached) and no logprobs to report. Native decode's greedy
        run (models/native_decode.py) samples such rows without the sampler."""
        return (self.is_greedy and self.grammar is None and self.params.logprobs is None and not self.processors
                and not self.bias_token_ids and not self.has_penalties
                and (not self.min_tokens_stop_ids or self.num_output_tokens >= self.params.min_tokens))

    def append(self, token_id: int) -> None:
        """Record one generated token (after each step that sampled this row)."""
        self.output_token_ids.append(token_id)
        if self.output_counts is not None:
            # NOTE: one tiny device op per penalized sequence per step; a shared
            # [max_seqs, V] counts pool would batch it if this ever shows up.
            self.output_counts[token_id] += 1

    def extend(self, token_ids: Sequence[int]) -> None:
        """Record several generated tokens at once (e.g. a resumed request)."""
        token_ids = [int(t) for t in token_ids]
        if not token_ids:
            return
        self.output_token_ids.extend(token_ids)
        if self.output_counts is not None:
            ids = _long_tensor(token_ids, self.device)
            self.output_counts += torch.bincount(ids, minlength=self.vocab_size).to(torch.int32)


def append_tokens(states: Sequence[SamplingState], token_ids: torch.Tensor | Sequence[int]) -> None:
    """Append each row's sampled token to its state (one device sync at most)."""
    ids = token_ids.tolist() if isinstance(token_ids, torch.Tensor) else list(token_ids)
    if len(ids) != len(states):
        raise ValueError(f"{len(ids)} token ids for {len(states)} states")
    for state, token_id in zip(states, ids):
        state.append(int(token_id))


@attrs.frozen(eq=False)
class LogprobsTensors:
    """Logprobs of a chosen token and the top-N per row, from raw logits.

    Shapes: token_ids, token_logprobs, token_ranks [R]; top_token_ids,
    top_logprobs [R, max_num] (descending). `num_logprobs[r]` is how many top
    entries row r asked for; -1 means the row asked for none and its values
    are meaningless. Ranks are 1-based: the number of tokens whose logprob is
    >= the chosen token's (vLLM's definition, ties count against it).
    """

    token_ids: torch.Tensor  # int64 [R]
    token_logprobs: torch.Tensor  # float32 [R]
    token_ranks: torch.Tensor  # int64 [R]
    top_token_ids: torch.Tensor  # int64 [R, max_num]
    top_logprobs: torch.Tensor  # float32 [R, max_num]
    num_logprobs: tuple[int, ...]

    def to_token_logprobs(self) -> list[TokenLogprobs | None]:
        """Python values per row (None where not requested); one copy per column."""
        columns = (self.token_ids, self.token_logprobs, self.token_ranks)
        ids, lps, ranks = (t.tolist() for t in columns)
        top_ids, top_lps = self.top_token_ids.tolist(), self.top_logprobs.tolist()
        return [
            None
            if num < 0
            else TokenLogprobs(ids[r], lps[r], ranks[r], tuple(top_ids[r][:num]), tuple(top_lps[r][:num]))
            for r, num in enumerate(self.num_logprobs)
        ]

    def row(self, r: int) -> TokenLogprobs | None:
        """Python values of row r (syncs per call: prefer to_token_logprobs in loops)."""
        num = self.num_logprobs[r]
        if num < 0:
            return None
        top = (tuple(self.top_token_ids[r, :num].tolist()), tuple(self.top_logprobs[r, :num].tolist()))
        token = (int(self.token_ids[r]), float(self.token_logprobs[r]), int(self.token_ranks[r]))
        return TokenLogprobs(*token, *top)


@attrs.frozen(eq=False)
class SamplerOutput:
    """token_ids: int64 [B] on the logits' device; logprobs: None when no row asked."""

    token_ids: torch.Tensor
    logprobs: LogprobsTensors | None


def sample(logits: torch.Tensor, states: Sequence[SamplingState]) -> SamplerOutput:
    """Sample one token per row of `logits` [B, V] with `states[i]` for row i.

    NOTE: float32 logits are processed in place (the executor's scratch); pass
    a clone to keep them.
    """
    if logits.dim() != 2 or logits.shape[0] != len(states):
        raise ValueError(f"logits {tuple(logits.shape)} do not match {len(states)} states")
    logits = logits.float()
    if any(s.grammar is not None for s in states):
        # WHY before the raw logprobs: vLLM's model runner applies the grammar
        # bitmask to the logits before its sampler runs (gpu_model_runner.py
        # apply_grammar_bitmask), so reported logprobs exclude banned tokens.
        apply_grammar_bitmask(logits, [s.grammar for s in states], [s.output_token_ids for s in states])
    lp_rows = [i for i, s in enumerate(states) if s.params.logprobs is not None]
    raw_logprobs = None
    if lp_rows:
        # vLLM's default logprobs_mode "raw_logprobs": before any processing.
        raw = logits if len(lp_rows) == len(states) else logits[lp_rows]
        raw_logprobs = raw.log_softmax(dim=-1)
    process_logits(logits, states)
    token_ids = _sample_tokens(logits, states)
    logprobs = None
    if raw_logprobs is not None:
        logprobs = _batch_logprobs(raw_logprobs, lp_rows, token_ids, states)
    return SamplerOutput(token_ids=token_ids, logprobs=logprobs)


def process_logits(logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
    """The argmax-changing stages, in place: the requests' own logits
    processors, logit_bias, min_tokens, penalties."""
    _apply_request_processors(logits, states)
    _apply_logit_bias(logits, states)
    _apply_min_tokens(logits, states)
    _apply_penalties(logits, states)
    return logits


def compute_prompt_logprobs(
    logits: torch.Tensor, next_token_ids: torch.Tensor, num_logprobs: int
) -> LogprobsTensors:
    """Per prompt position p: logprob and rank of next_token_ids[p] and the top-num.

    `logits` [P, V] are the raw outputs at positions whose next token is known
    (the prompt's own next tokens); like vLLM, nothing is processed first.
    """
    if logits.dim() != 2 or next_token_ids.shape != (logits.shape[0],):
        raise ValueError(f"logits {tuple(logits.shape)} vs next ids {tuple(next_token_ids.shape)}")
    logprobs = logits.float().log_softmax(dim=-1)
    ids = next_token_ids.to(device=logits.device, dtype=torch.long)
    return gather_logprobs(logprobs, ids, (num_logprobs,) * logits.shape[0])


# --- stages ---------------------------------------------------------------


def _long_tensor(values: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.as_tensor(values, dtype=torch.long).to(device)


def _float_column(values: Sequence[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)


def _apply_request_processors(logits: torch.Tensor, states: Sequence[SamplingState]) -> None:
    for i, s in enumerate(states):
        for processor in s.processors:
            processor.apply(logits[i], s.output_token_ids)


def _apply_logit_bias(logits: torch.Tensor, states: Sequence[SamplingState]) -> None:
    rows: list[int] = []
    ids: list[int] = []
    values: list[float] = []
    for i, s in enumerate(states):
        if s.bias_token_ids:
            rows.extend([i] * len(s.bias_token_ids))
            ids.extend(s.bias_token_ids)
            values.extend(s.bias_values)
    if rows:
        index = (_long_tensor(rows, logits.device), _long_tensor(ids, logits.device))
        bias = torch.tensor(values, dtype=logits.dtype, device=logits.device)
        logits.index_put_(index, bias, accumulate=True)


def _apply_min_tokens(logits: torch.Tensor, states: Sequence[SamplingState]) -> None:
    rows: list[int] = []
    ids: list[int] = []
    for i, s in enumerate(states):
        if s.min_tokens_stop_ids and s.num_output_tokens < s.params.min_tokens:
            rows.extend([i] * len(s.min_tokens_stop_ids))
            ids.extend(s.min_tokens_stop_ids)
    if rows:
        index = (_long_tensor(rows, logits.device), _long_tensor(ids, logits.device))
        logits.index_put_(index, torch.tensor(float("-inf"), device=logits.device))


def _apply_penalties(logits: torch.Tensor, states: Sequence[SamplingState]) -> None:
    """vLLM's apply_penalties over the penalized rows only."""
    rows = [i for i, s in enumerate(states) if s.has_penalties]
    if not rows:
        return
    pen = [states[i] for i in rows]
    every_row = len(rows) == len(states)
    index = None if every_row else _long_tensor(rows, logits.device)
    sub = logits if index is None else logits.index_select(0, index)
    counts = torch.stack([s.output_counts for s in pen])  # type: ignore[misc]
    generated = counts > 0
    repetition = [s.params.repetition_penalty for s in pen]
    if any(r != 1.0 for r in repetition):
        seen = torch.stack([s.prompt_mask for s in pen]) | generated  # type: ignore[misc]
        penalty = torch.where(seen, _float_column(repetition, logits.device), 1.0)
        # Divide positive logits, multiply negative ones: both lower the token.
        sub.mul_(torch.where(sub > 0, 1.0 / penalty, penalty))
    frequency = [s.params.frequency_penalty for s in pen]
    if any(f != 0.0 for f in frequency):
        sub.sub_(_float_column(frequency, logits.device) * counts)
    presence = [s.params.presence_penalty for s in pen]
    if any(p != 0.0 for p in presence):
        sub.sub_(_float_column(presence, logits.device) * generated)
    if index is not None:
        logits.index_copy_(0, index, sub)


def _sample_tokens(logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
    random_rows = [i for i, s in enumerate(states) if not s.is_greedy]
    if not random_rows:
        return logits.argmax(dim=-1)
    if len(random_rows) == len(states):
        return _sample_random(logits, states)
    token_ids = logits.argmax(dim=-1)
    index = _long_tensor(random_rows, logits.device)
    sampled = _sample_random(logits.index_select(0, index), [states[i] for i in random_rows])
    token_ids.index_copy_(0, index, sampled)
    return token_ids


def _sample_random(logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
    """Temperature, min_p, top_k, top_p, then the exponential race; rows all random."""
    return race(target_probs(logits, states), states)


def target_probs(logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
    """The distribution a random row samples from (rows all random, logits already
    through `process_logits`): temperature, min_p, top_k, top_p, softmax. In place
    on `logits`. Speculative verification (trillium/speculative/verify.py) reads it."""
    device = logits.device
    vocab_size = logits.shape[1]
    params = [s.params for s in states]
    temperature = [p.temperature for p in params]
    if any(t != 1.0 for t in temperature):
        logits.div_(_float_column(temperature, device))
    min_p = [p.min_p for p in params]
    if any(m > 0.0 for m in min_p):
        probs = logits.softmax(dim=-1)
        threshold = probs.amax(dim=-1, keepdim=True) * _float_column(min_p, device)
        logits.masked_fill_(probs < threshold, float("-inf"))
    top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
    top_p = [p.top_p for p in params]
    k = _long_tensor(top_k, device) if any(k < vocab_size for k in top_k) else None
    p = torch.tensor(top_p, dtype=torch.float32, device=device) if any(x < 1.0 for x in top_p) else None
    logits = _apply_top_k_top_p(logits, k, p, max_k=max(top_k))
    return logits.softmax(dim=-1)


def race(probs: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
    """One token per row drawn from `probs` [R, V] (weights: need not sum to 1)
    by the exponential race, seeded rows from their own generator. In place."""
    q = torch.empty_like(probs)
    if any(s.generator is None for s in states):
        q.exponential_()
    for j, s in enumerate(states):
        if s.generator is not None:
            q[j].exponential_(generator=s.generator)
    # WHY: a q of exactly 0 over a masked (p == 0) token gives 0/0 = NaN, and
    # argmax would pick it; no valid token can lose to a tiny positive q.
    q.clamp_(min=torch.finfo(q.dtype).tiny)
    return probs.div_(q).argmax(dim=-1)


def _apply_top_k_top_p(
    logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None, max_k: int
) -> torch.Tensor:
    """vLLM's apply_top_k_top_p: k [R] (V = off), p [R] (1 = off); ties at the
    k-th value are kept, and top-p always keeps the most likely token."""
    if p is None:
        if k is None:
            return logits
        # Top-k alone needs no full sort: the k-th largest value per row.
        kth = logits.topk(max_k, dim=-1).values.gather(1, (k - 1).unsqueeze(1))
        return logits.masked_fill_(logits < kth, float("-inf"))
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)
    if k is not None:
        kth = logits_sort.gather(1, (logits_sort.shape[1] - k).unsqueeze(1))
        logits_sort.masked_fill_(logits_sort < kth, float("-inf"))
    probs_sum = logits_sort.softmax(dim=-1).cumsum_(dim=-1)
    drop = probs_sum <= 1.0 - p.unsqueeze(1)
    drop[:, -1] = False
    logits_sort.masked_fill_(drop, float("-inf"))
    return logits_sort.scatter(dim=-1, index=logits_idx, src=logits_sort)


# --- logprobs -------------------------------------------------------------


def gather_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, num_logprobs: Sequence[int]
) -> LogprobsTensors:
    max_num = min(max([0, *num_logprobs]), logprobs.shape[1])
    top_logprobs, top_token_ids = logprobs.topk(max_num, dim=-1)
    token_logprobs = logprobs.gather(1, token_ids.unsqueeze(1))
    token_ranks = (logprobs >= token_logprobs).sum(dim=-1)
    return LogprobsTensors(
        token_ids=token_ids,
        token_logprobs=token_logprobs.squeeze(1),
        token_ranks=token_ranks,
        top_token_ids=top_token_ids,
        top_logprobs=top_logprobs,
        num_logprobs=tuple(min(n, logprobs.shape[1]) for n in num_logprobs),
    )


def _batch_logprobs(
    raw_logprobs: torch.Tensor,
    lp_rows: list[int],
    token_ids: torch.Tensor,
    states: Sequence[SamplingState],
) -> LogprobsTensors:
    """Gather over the rows that asked, laid out over all B rows (-1 = none)."""
    nums = [states[i].params.logprobs for i in lp_rows]
    if len(lp_rows) == len(states):
        return gather_logprobs(raw_logprobs, token_ids, nums)  # type: ignore[arg-type]
    index = _long_tensor(lp_rows, token_ids.device)
    part = gather_logprobs(raw_logprobs, token_ids.index_select(0, index), nums)  # type: ignore[arg-type]
    batch = len(states)

    def spread(t: torch.Tensor) -> torch.Tensor:
        full = t.new_zeros((batch, *t.shape[1:]))
        return full.index_copy_(0, index, t)

    num_logprobs = [-1] * batch
    for i, n in zip(lp_rows, part.num_logprobs):
        num_logprobs[i] = n
    return LogprobsTensors(
        token_ids=token_ids,
        token_logprobs=spread(part.token_logprobs),
        token_ranks=spread(part.token_ranks),
        top_token_ids=spread(part.top_token_ids),
        top_logprobs=spread(part.top_logprobs),
        num_logprobs=tuple(num_logprobs),
    )

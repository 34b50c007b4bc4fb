"""Unit tests of the batched sampler against straightforward per-row references."""

from __future__ import annotations

import math

import pytest
import torch

from trillium.actors.executor.sampler import (
    SamplingState,
    append_tokens,
    compute_prompt_logprobs,
    process_logits,
    sample,
)
from trillium.sampling_params import SamplingParams

V = 32
EOS = 2


def state(vocab_size: int = V, prompt=(5, 6, 7), outputs=(), eos=(EOS,), **params) -> SamplingState:
    return SamplingState(
        SamplingParams(**params),
        list(prompt),
        vocab_size=vocab_size,
        eos_token_ids=eos,
        output_token_ids=list(outputs),
    )


def rand_logits(batch: int, vocab_size: int = V, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, vocab_size, generator=g) * 3


# --- greedy, bias, min_tokens, penalties ------------------------------------


def test_greedy_equals_argmax():
    logits = rand_logits(6)
    states = [state(temperature=0.0) for _ in range(6)]
    out = sample(logits.clone(), states)
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert out.logprobs is None


def test_greedy_rows_in_mixed_batch_take_argmax():
    logits = rand_logits(8)
    states = [state(temperature=0.0 if i % 2 else 1.0, top_k=3) for i in range(8)]
    out = sample(logits.clone(), states)
    greedy = logits.argmax(-1)
    for i in range(1, 8, 2):
        assert out.token_ids[i] == greedy[i]
    for i in range(0, 8, 2):  # random rows stay inside their top-3
        assert out.token_ids[i] in logits[i].topk(3).indices


def test_greedy_seeded_request_has_no_generator():
    assert state(temperature=0.0, seed=3).generator is None
    assert state(temperature=0.8, seed=3).generator is not None


def test_logit_bias_added_and_steers_greedy():
    logits = rand_logits(3)
    states = [state(), state(logit_bias={4: 100.0, 9: -5.0}), state(logit_bias={0: 1.5})]
    processed = process_logits(logits.clone(), states)
    expected = logits.clone()
    expected[1, 4] += 100.0
    expected[1, 9] -= 5.0
    expected[2, 0] += 1.5
    torch.testing.assert_close(processed, expected)
    greedy = [state(temperature=0.0, logit_bias={4: 100.0}) for _ in range(3)]
    assert sample(logits.clone(), greedy).token_ids.tolist() == [4, 4, 4]


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_min_tokens_masks_eos_and_stop_ids_until_reached(ignore_eos):
    s = state(min_tokens=2, stop_token_ids=[11, 12], ignore_eos=ignore_eos, temperature=0.0)
    other = state(stop_token_ids=[11], temperature=0.0)  # no min_tokens: untouched
    logits = rand_logits(2)
    logits[:, EOS] = 50.0
    for step in range(2):
        processed = process_logits(logits.clone(), [s, other])
        masked = torch.isinf(processed[0]).nonzero().flatten().tolist()
        assert masked == [EOS, 11, 12], step
        assert not torch.isinf(processed[1]).any()
        out = sample(logits.clone(), [s, other])
        assert out.token_ids[0] != EOS and out.token_ids[1] == EOS
        append_tokens([s, other], out.token_ids)
    processed = process_logits(logits.clone(), [s, other])
    assert not torch.isinf(processed).any()
    assert sample(logits[:1].clone(), [s]).token_ids.item() == EOS


def reference_penalties(logits: torch.Tensor, params: SamplingParams, prompt, outputs) -> torch.Tensor:
    """Per-token loop over vLLM's definitions."""
    out = logits.clone()
    for t in range(out.shape[0]):
        x = out[t].item()
        if t in prompt or t in outputs:
            r = params.repetition_penalty
            x = x / r if x > 0 else x * r
        count = outputs.count(t)
        x -= params.frequency_penalty * count
        x -= params.presence_penalty * (count > 0)
        out[t] = x
    return out


def test_penalties_match_per_row_reference():
    rows = [
        dict(repetition_penalty=1.3),
        dict(),  # no penalties in a penalized batch
        dict(presence_penalty=0.7),
        dict(frequency_penalty=0.4),
        dict(repetition_penalty=0.8, presence_penalty=-0.5, frequency_penalty=1.1),
    ]
    prompts = [(1, 2, 3), (4,), (5, 5, 6), (7, 8), (9, 1)]
    outputs = [(3, 10, 10), (4, 4), (10, 11, 11, 11), (8, 8, 12), (1, 1, 9, 20)]
    logits = rand_logits(len(rows))
    states = []
    for kw, prompt, out in zip(rows, prompts, outputs):
        s = state(prompt=prompt, outputs=out[:1], **kw)
        for t in out[1:]:  # both the constructor's and append's bookkeeping
            s.append(t)
        states.append(s)
    processed = process_logits(logits.clone(), states)
    for i, (kw, prompt, out) in enumerate(zip(rows, prompts, outputs)):
        ref = reference_penalties(logits[i], SamplingParams(**kw), list(prompt), list(out))
        torch.testing.assert_close(processed[i], ref)
    greedy = [state(prompt=p, outputs=o, temperature=0.0, **kw) for kw, p, o in zip(rows, prompts, outputs)]
    assert torch.equal(sample(logits.clone(), greedy).token_ids, processed.argmax(-1))


def test_unpenalized_batch_is_left_alone():
    logits = rand_logits(4)
    processed = process_logits(logits.clone(), [state(outputs=(1, 2)) for _ in range(4)])
    assert torch.equal(processed, logits)


# --- random sampling: allowed sets and distribution --------------------------


def allowed_set(logits_row: torch.Tensor, top_k=-1, top_p=1.0, min_p=0.0, temperature=1.0) -> set[int]:
    """Reference filter in vLLM's order: temperature, min_p, top_k, top_p."""
    x = logits_row.double() / temperature
    probs = x.softmax(-1)
    keep = probs >= probs.max() * min_p
    if top_k > 0:
        keep &= x >= x[keep].topk(min(top_k, int(keep.sum()))).values[-1]
    p = torch.where(keep, probs, 0.0)
    p = p / p.sum()
    order = p.argsort(descending=True).tolist()
    kept, mass = set(), 0.0
    for t in order:
        if not keep[t]:
            break
        kept.add(t)
        mass += p[t].item()
        if mass >= top_p - 1e-9:
            break
    return kept


@pytest.mark.parametrize(
    "filters",
    [
        dict(top_k=3),
        dict(top_p=0.6),
        dict(top_p=0.25),
        dict(min_p=0.2),
        dict(top_k=5, top_p=0.8),
        dict(top_k=6, min_p=0.1, top_p=0.9, temperature=0.7),
        # vLLM's order matters here: top_p after min_p keeps 5 tokens, before it 7.
        dict(min_p=0.4, top_p=0.7, temperature=2.0),
    ],
)
def test_filters_never_sample_outside_allowed_set(filters):
    torch.manual_seed(1)
    vocab_size = 16
    row = torch.linspace(-2.0, 2.0, vocab_size)[torch.randperm(vocab_size)]
    draws = 3000
    states = [state(vocab_size, **filters) for _ in range(draws)]
    # Half of the draws share a batch with unfiltered rows, which must stay unfiltered.
    logits = row.repeat(draws, 1)
    free = [state(vocab_size) for _ in range(draws)]
    tokens = sample(logits.clone(), states).token_ids
    mixed = sample(row.repeat(2 * draws, 1), [s for pair in zip(states, free) for s in pair]).token_ids
    allowed = allowed_set(row, **filters)
    seen = set(tokens.tolist()) | set(mixed[0::2].tolist())
    assert seen <= allowed
    assert seen == allowed  # every allowed token has probability >= ~2% here
    assert len(set(mixed[1::2].tolist())) > len(allowed)


def test_temperature_matches_distribution_chi_square():
    torch.manual_seed(1234)
    row = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0])
    temperature = 0.6
    draws = 20000
    states = [state(5, eos=(), temperature=temperature)] * draws
    tokens = sample(row.repeat(draws, 1), states).token_ids
    observed = torch.bincount(tokens, minlength=5).double()
    expected = (row.double() / temperature).softmax(-1) * draws
    chi2 = ((observed - expected) ** 2 / expected).sum().item()
    assert chi2 < 25.0, (observed, expected)  # df=4: p ~ 5e-5 at 25


def test_top_k_only_and_sorted_paths_agree_on_top_k():
    # One row with top_k only takes the topk path; alongside a top_p row it
    # takes the sort path. Same seed => same token either way.
    logits = rand_logits(1, 64, seed=3)
    alone = state(64, top_k=5, seed=9)
    together = state(64, top_k=5, seed=9)
    t_alone = [sample(logits.clone(), [alone]).token_ids[0].item() for _ in range(20)]
    t_together = [
        sample(torch.cat([logits, logits]), [together, state(64, top_p=0.5)]).token_ids[0].item()
        for _ in range(20)
    ]
    assert t_alone == t_together


# --- seeds -----------------------------------------------------------------


def run_seeded(position: int, batch: int, steps: int = 12) -> list[int]:
    """The same seeded request at `position` in a batch of `batch` rows."""
    vocab_size = 50
    target = state(vocab_size, seed=42, temperature=0.9, top_p=0.95, top_k=20)
    others = [
        state(vocab_size, temperature=0.0),
        state(vocab_size, seed=7, min_p=0.05),
        state(vocab_size),
        state(vocab_size, temperature=1.3, top_p=0.5, presence_penalty=0.5),
        state(vocab_size, seed=42, temperature=0.9),
        state(vocab_size, top_k=2, logit_bias={3: 5.0}),
        state(vocab_size, temperature=0.5, repetition_penalty=1.2, logprobs=3),
    ][: batch - 1]
    states = others[:position] + [target] + others[position:]
    tokens = []
    for step in range(steps):
        # The target's logits depend only on the step; other rows vary with the batch.
        row = rand_logits(1, vocab_size, seed=100 + step)
        logits = rand_logits(batch, vocab_size, seed=1000 * batch + step)
        logits[position] = row[0]
        out = sample(logits, states)
        append_tokens(states, out.token_ids)
        tokens.append(out.token_ids[position].item())
    return tokens


def test_seeded_request_independent_of_batch_composition():
    alone = run_seeded(position=0, batch=1)
    assert run_seeded(position=0, batch=8) == alone
    assert run_seeded(position=3, batch=8) == alone
    assert run_seeded(position=7, batch=8) == alone
    assert run_seeded(position=2, batch=4) == alone


def test_seeded_request_reproducible_and_seed_dependent():
    vocab_size = 1000
    logits = torch.zeros(1, vocab_size)  # uniform: tokens differ unless seeds match

    def run(seed: int) -> list[int]:
        s = state(vocab_size, seed=seed)
        return [sample(logits.clone(), [s]).token_ids.item() for _ in range(10)]

    torch.manual_seed(0)
    first = run(5)
    torch.manual_seed(99)  # the default generator does not matter
    assert run(5) == first
    assert run(6) != first


def test_sample_index_offsets_seed():
    a = SamplingState(SamplingParams(seed=5), [1], vocab_size=100, sample_index=1)
    b = SamplingState(SamplingParams(seed=6), [1], vocab_size=100)
    logits = torch.zeros(1, 100)
    assert [sample(logits.clone(), [a]).token_ids.item() for _ in range(5)] == [
        sample(logits.clone(), [b]).token_ids.item() for _ in range(5)
    ]


# --- logprobs --------------------------------------------------------------


def test_logprobs_from_raw_logits_with_ranks():
    logits = rand_logits(5)
    states = [
        state(logprobs=3, temperature=0.5, presence_penalty=1.0, outputs=(1,)),
        state(),  # no logprobs
        state(logprobs=0, temperature=0.0, logit_bias={7: 50.0}),
        state(logprobs=5, top_k=4),
        state(logprobs=1, seed=1),
    ]
    out = sample(logits.clone(), states)
    raw = logits.log_softmax(-1)
    lp = out.logprobs
    assert lp is not None and lp.num_logprobs == (3, -1, 0, 5, 1)
    rows = lp.to_token_logprobs()
    assert rows[1] is None and lp.row(1) is None
    for i in (0, 2, 3, 4):
        tok = out.token_ids[i].item()
        row = rows[i]
        assert row == lp.row(i)
        assert row.token_id == tok
        assert math.isclose(row.logprob, raw[i, tok].item(), rel_tol=1e-5, abs_tol=1e-6)
        assert row.rank == 1 + sum(1 for x in raw[i].tolist() if x > raw[i, tok].item())
        n = states[i].params.logprobs
        top = raw[i].topk(n) if n else None
        assert len(row.top_token_ids) == len(row.top_logprobs) == n
        if n:
            assert list(row.top_token_ids) == top.indices.tolist()
            torch.testing.assert_close(torch.tensor(row.top_logprobs), top.values)
    assert rows[2].token_id == 7  # the bias moved the sample but not the logprob
    assert rows[2].rank == 1 + int((raw[2] > raw[2, 7]).sum())


def test_logprobs_more_than_vocab_and_bf16_logits():
    logits = rand_logits(2, 8).to(torch.bfloat16)
    out = sample(logits, [state(8, logprobs=20, temperature=0.0)] * 2)
    rows = out.logprobs.to_token_logprobs()
    assert len(rows[0].top_token_ids) == 8
    assert rows[0].rank == 1 and rows[0].token_id == rows[0].top_token_ids[0]


def test_prompt_logprobs():
    prompt = [3, 9, 1, 1, 30]
    logits = rand_logits(len(prompt) - 1)
    nxt = torch.tensor(prompt[1:])
    lp = compute_prompt_logprobs(logits, nxt, 2)
    raw = logits.log_softmax(-1)
    rows = lp.to_token_logprobs()
    assert len(rows) == 4
    for p, row in enumerate(rows):
        t = prompt[p + 1]
        assert row.token_id == t
        assert math.isclose(row.logprob, raw[p, t].item(), rel_tol=1e-5, abs_tol=1e-6)
        assert row.rank == int((raw[p] >= raw[p, t]).sum())
        assert list(row.top_token_ids) == raw[p].topk(2).indices.tolist()
    assert compute_prompt_logprobs(logits, nxt, 0).to_token_logprobs()[0].top_token_ids == ()


def test_state_counts_follow_appends():
    s = state(prompt=(1, 2), outputs=(4, 4), frequency_penalty=0.5)
    append_tokens([s], torch.tensor([4]))
    s.extend([5, 6])
    assert s.num_output_tokens == 5 and s.output_token_ids == [4, 4, 4, 5, 6]
    assert s.output_counts[4].item() == 3 and s.output_counts[5].item() == 1
    assert s.prompt_mask.nonzero().flatten().tolist() == [1, 2]
    assert state().output_counts is None  # no penalties: nothing on the device
    with pytest.raises(ValueError):
        append_tokens([s], [1, 2])
    with pytest.raises(ValueError):
        sample(torch.zeros(2, V), [s])


def test_argmax_only_holds_exactly_where_sample_takes_the_raw_argmax() -> None:
    """SamplingState.argmax_only (native decode's greedy run samples such rows without the sampler):
    true for a plain greedy row, and then `sample` gives the raw logits' argmax; false for whatever
    changes the logits or reports logprobs; min_tokens only until the outputs reach it."""
    logits = rand_logits(1, seed=4)
    plain = state(temperature=0.0)
    assert plain.argmax_only
    assert int(sample(logits.clone(), [plain]).token_ids[0]) == int(logits.argmax())
    not_only = [
        dict(temperature=0.7),
        dict(temperature=0.0, logprobs=1),
        dict(temperature=0.0, logit_bias={3: 2.0}),
        dict(temperature=0.0, repetition_penalty=1.1),
        dict(temperature=0.0, presence_penalty=0.5),
        dict(temperature=0.0, frequency_penalty=0.5),
        dict(temperature=0.0, allowed_token_ids=(1, 2, 3)),
        dict(temperature=0.0, bad_words_token_ids=((4,),)),
        dict(temperature=0.0, min_tokens=3),
    ]
    for params in not_only:
        assert not state(**params).argmax_only, params
    assert state(temperature=0.0, min_tokens=3, outputs=(9, 9, 9)).argmax_only  # reached: EOS is no longer masked
    assert state(temperature=0.0, prompt_logprobs=2).argmax_only  # the prompt's, computed apart from sampling

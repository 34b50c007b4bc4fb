"""Unit tests of the per-request logits processors (allowed_token_ids, bad_words, thinking_token_budget).

The semantics mirror vLLM v1: vllm/v1/sample/ops/bad_words.py
(`_apply_bad_words_single_batch`: a sequence's last token is banned when the
generated tokens end with the rest of it; one-token words always; the prompt
is not looked at) and vllm/v1/sample/sampler.py (`Sampler.forward`: allowed
ids, then bad words, then logit bias and penalties; logprobs are the raw
ones, before any of them), and vllm/v1/sample/logits_processor/builtin.py
(`ThinkingTokenBudgetLogitsProcessor`: the thinking opened last, in the
prompt or the output, gets `thinking_token_budget` tokens, then its end
sequence is forced token by token).
"""

from __future__ import annotations

import math

import pytest
import torch

from trillium.actors.executor.logits_processors import (AllowedTokenIds, BadWords, ThinkingBudget,
                                                        build_logits_processors)
from trillium.actors.executor.sampler import SamplingState, append_tokens, sample
from trillium.sampling_params import SamplingParams

V = 32
CPU = torch.device("cpu")


def state(prompt=(5, 6, 7), outputs=(), **params) -> SamplingState:
    return SamplingState(SamplingParams(**params), list(prompt), vocab_size=V, eos_token_ids=(2,),
                         output_token_ids=list(outputs))


def banned(processor, outputs) -> set[int]:
    logits = torch.zeros(V)
    processor.apply(logits, list(outputs))
    return {i for i in range(V) if logits[i] == -math.inf}


def test_allowed_token_ids_masks_every_other_id():
    assert banned(AllowedTokenIds([3, 9, 31], V, CPU), ()) == set(range(V)) - {3, 9, 31}


def test_bad_words_one_token_word_is_always_banned():
    assert banned(BadWords([[4]]), ()) == {4}
    assert banned(BadWords([[4]]), (1, 2, 3)) == {4}


def test_bad_words_longer_word_bans_its_last_token_only_after_its_prefix():
    words = BadWords([[7, 8, 9]])
    assert banned(words, ()) == set()  # the prefix cannot be there yet
    assert banned(words, (7,)) == set()
    assert banned(words, (1, 7, 8)) == {9}
    assert banned(words, (7, 8, 1)) == set()
    assert banned(words, (8, 7)) == set()


def test_bad_words_match_generated_tokens_not_the_prompt():
    # The prompt ends with 7, 8: vLLM passes only output ids, so 9 is still allowed first.
    s = state(prompt=(7, 8), bad_words_token_ids=((7, 8, 9),))
    logits = torch.zeros(1, V)
    logits[0, 9] = 10.0
    assert sample(logits, [s]).token_ids.item() == 9


def test_build_follows_vllm_order_and_skips_unset():
    assert build_logits_processors(SamplingParams(), V, CPU) == ()
    kinds = [type(p) for p in build_logits_processors(
        SamplingParams(allowed_token_ids=(1, 2), bad_words_token_ids=((3,),)), V, CPU)]
    assert kinds == [AllowedTokenIds, BadWords]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_sampled_token_is_allowed_even_against_logit_bias(temperature):
    allowed = (3, 11, 20)
    states = [state(temperature=temperature, seed=i, allowed_token_ids=allowed,
                    logit_bias={5: 100.0}) for i in range(4)]
    g = torch.Generator().manual_seed(0)
    for _ in range(25):
        logits = torch.randn(len(states), V, generator=g) * 3
        out = sample(logits, states)
        assert set(out.token_ids.tolist()) <= set(allowed)
        append_tokens(states, out.token_ids)


def test_a_banned_sequence_is_never_completed_over_many_steps():
    # Logits that favour 7 then 8 then 9: the sampler must break 7, 8, 9 and never emit 4.
    word, single = (7, 8, 9), (4,)
    states = [state(temperature=1.0, seed=i, bad_words_token_ids=(word, single)) for i in range(8)]
    g = torch.Generator().manual_seed(1)
    for _ in range(40):
        logits = torch.randn(len(states), V, generator=g)
        for r, s in enumerate(states):
            last = s.output_token_ids[-1:] or [None]
            logits[r, {7: 8, 8: 9}.get(last[0], 7)] += 6.0
            logits[r, 4] += 6.0
        append_tokens(states, sample(logits, states).token_ids)
    for s in states:
        ids = s.output_token_ids
        assert 4 not in ids
        assert not any(tuple(ids[i:i + 3]) == word for i in range(len(ids) - 2))
        assert any(tuple(ids[i:i + 2]) == (7, 8) for i in range(len(ids) - 1))  # the prefix itself is fine


def test_logprobs_stay_raw_under_constraints():
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(2))
    raw = logits.log_softmax(-1)
    s = state(temperature=0.0, logprobs=3, allowed_token_ids=(1,))
    out = sample(logits.clone(), [s])
    assert out.token_ids.item() == 1
    entry = out.logprobs.row(0)
    assert entry.token_id == 1 and entry.logprob == pytest.approx(raw[0, 1].item(), abs=1e-5)
    assert list(entry.top_token_ids) == raw[0].topk(3).indices.tolist()


@pytest.mark.parametrize(("params", "name"), [
    (dict(allowed_token_ids=()), "allowed_token_ids"),
    (dict(allowed_token_ids=(1, V)), "allowed_token_ids"),
    (dict(bad_words_token_ids=((),)), "bad_words"),
    (dict(bad_words_token_ids=((1, -1),)), "bad_words"),
    (dict(thinking_token_budget=-1, think_start_token_ids=(3,), think_end_token_ids=(4,)), "thinking_token_budget"),
    (dict(thinking_token_budget=2), "thinking_token_budget"),  # no delimiters
    (dict(thinking_token_budget=2, think_start_token_ids=(3,), think_end_token_ids=(V,)), "think_end_token_ids"),
])
def test_validate_names_the_bad_constraint(params, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**params).validate(V)


START, END = (20,), (21, 22)  # a two-token end sequence, as </think> may be


def forced_run(budget, prompt, outputs):
    """The forced token before each next output token, feeding `outputs` one by one."""
    processor = ThinkingBudget(budget, START, END, prompt)
    return [processor.forced_token(list(outputs[:i])) for i in range(len(outputs) + 1)]


def test_thinking_opened_in_the_output_gets_its_budget_then_the_end_is_forced():
    # 5 9 | <think> a b c </think(21) 22> then free
    run = forced_run(3, (5, 9), [1, 20, 11, 12, 13, 21, 22, 14])
    assert run == [None, None, None, None, None, 21, 22, None, None]


def test_thinking_opened_by_the_prompt_counts_from_the_prompt():
    # The template wrote "<think> x" already: one thinking token is spent.
    assert forced_run(2, (5, 20, 9), [11, 21, 22, 13]) == [None, 21, 22, None, None]
    assert forced_run(0, (5, 20), [21, 22, 3]) == [21, 22, None, None]


def test_thinking_closed_before_the_budget_is_never_forced():
    assert forced_run(4, (5,), [20, 11, 21, 22, 13, 14, 15, 16]) == [None] * 9
    # A prompt that closed its thinking (enable_thinking false): nothing to bound.
    assert forced_run(0, (20, 21, 22), [7, 8]) == [None] * 3


def test_a_forced_end_can_finish_a_half_written_one():
    # The model wrote 21 on its own as its last budgeted token: the forcing writes the end anew.
    assert forced_run(2, (20,), [11, 21, 21, 22, 9]) == [None, None, 21, 22, None, None]


def test_rolled_back_tokens_are_read_again():
    processor = ThinkingBudget(2, START, END, (20,))
    assert processor.forced_token([11, 12]) == 21
    assert processor.forced_token([11]) is None  # fewer tokens than it read: reread from the start
    assert processor.forced_token([11, 12, 21]) == 22


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sampler_writes_the_budget_then_the_end_sequence(temperature):
    # Logits that never favour the end: only the budget ends the thinking.
    states = [state(prompt=(5, 20), temperature=temperature, seed=i, thinking_token_budget=4,
                    think_start_token_ids=START, think_end_token_ids=END) for i in range(3)]
    g = torch.Generator().manual_seed(3)
    for _ in range(10):
        logits = torch.randn(len(states), V, generator=g)
        logits[:, [2, 21, 22]] -= 50.0
        append_tokens(states, sample(logits, states).token_ids)
    for s in states:
        assert s.output_token_ids[4:6] == [21, 22]
        assert 21 not in s.output_token_ids[:4] and 21 not in s.output_token_ids[6:]

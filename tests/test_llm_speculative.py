"""Speculative decoding end to end through `trillium.LLM` (real actors in-process).

Greedy output with ngram speculation is token for token the output without it
(vLLM's own check, tests/v1/e2e/test_spec_decode.py: ngram vs reference
greedy), with stop strings, max_tokens, n > 1, logprobs, a grammar, a penalty, and under a KV cache
small enough that requests are preempted and recompute. Sampled output has
the target's distribution: many seeds at a fixed prefix, the second token's
frequencies with and without speculation agree (two-sample chi-square).
"""

from __future__ import annotations

import pytest
import torch

from trillium import LLM, SamplingParams
from trillium.speculative.proposer import NgramProposer
from trillium.structured_outputs import StructuredOutputsParams

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
# 20 blocks of 16 tokens: the identity test's batch needs ~40.
ENGINE = dict(num_blocks=20, max_num_batched_tokens=96, max_num_seqs=16)


@pytest.fixture(scope="module")
def engines(checkpoint):
    path = str(checkpoint("llama"))
    with LLM(path, **ENGINE) as base, LLM(path, speculative_config=SPEC, **ENGINE) as spec:
        yield base, spec


def _prompts() -> list[dict]:
    loop = [11, 12, 13, 14, 15] * 4
    return [{"prompt_token_ids": loop}, {"prompt_token_ids": list(range(20, 60))},
            {"prompt_token_ids": [7, 8, 9] * 6 + [40, 41]}, {"prompt_token_ids": [200, 201, 202]}]


def _same(a, b) -> None:
    for x, y in zip(a, b, strict=True):
        for cx, cy in zip(x.outputs, y.outputs, strict=True):
            assert cx.token_ids == cy.token_ids
            assert cx.text == cy.text and cx.finish_reason == cy.finish_reason
            if cx.logprobs is not None:
                for px, py in zip(cx.logprobs, cy.logprobs, strict=True):
                    assert px.keys() == py.keys()
                    assert all(abs(px[t].logprob - py[t].logprob) < 1e-4 for t in px)


def test_greedy_identity_with_stops_lengths_n_logprobs_and_preemption(engines):
    base, spec = engines
    before = _stats(spec)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, logprobs=2) for m in (40, 33, 17, 1)]
    params[2] = SamplingParams(n=2, temperature=0, max_tokens=24, ignore_eos=True)
    # Beside them, requests enough to overflow the small KV cache: preempted and recomputed.
    crowd = [{"prompt_token_ids": [30 + i, 31 + i, 32 + i] * 8} for i in range(6)]
    crowd_params = [SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)] * 6
    ref = base.generate(_prompts() + crowd, params + crowd_params)
    _same(ref, spec.generate(_prompts() + crowd, params + crowd_params))
    assert _stats(spec).num_preempted_total > before.num_preempted_total, "the small KV cache should preempt"
    # A stop string cut from the middle of the reference text ends both runs at the same place.
    text = ref[1].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    stops = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop])
    _same(base.generate(_prompts()[1:2], stops), spec.generate(_prompts()[1:2], stops))
    # A grammar: the matcher sees each position's accepted prefix; a penalty: likewise.
    grammar = SamplingParams(temperature=0, max_tokens=24, structured_outputs=StructuredOutputsParams(
        grammar='root ::= ("a" | "b")+ "."'))
    penalty = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=1.3)
    _same(base.generate(_prompts()[:2], [grammar, penalty]), spec.generate(_prompts()[:2], [grammar, penalty]))
    stats = _stats(spec)
    drafts = stats.spec_decode_num_drafts_total - before.spec_decode_num_drafts_total
    draft_tokens = stats.spec_decode_num_draft_tokens_total - before.spec_decode_num_draft_tokens_total
    accepted = stats.spec_decode_num_accepted_tokens_total - before.spec_decode_num_accepted_tokens_total
    assert 0 < drafts <= draft_tokens <= 4 * drafts and 0 < accepted <= draft_tokens
    per_pos = stats.spec_decode_num_accepted_tokens_per_pos_total
    assert len(per_pos) == 4 and list(per_pos) == sorted(per_pos, reverse=True)
    assert sum(per_pos) == stats.spec_decode_num_accepted_tokens_total
    assert _stats(base).spec_decode_num_drafts_total == 0


def _stats(llm: LLM):
    """The latest SchedulerStats (an engine that has not stepped yet has none: zeros)."""
    from trillium.actors.protocol.outputs import SchedulerStats

    return llm.get_stats() or SchedulerStats(0, 0, 0, 0, 0.0, 0, 0, 0, 0)


def _second_tokens(llm: LLM, prompt: dict, num: int) -> list[int]:
    params = [SamplingParams(temperature=1.0, top_k=3, seed=s, max_tokens=3, ignore_eos=True) for s in range(num)]
    return [out.outputs[0].token_ids[1] for out in llm.generate([prompt] * num, params)]


def test_sampled_tokens_keep_the_target_distribution(engines):
    base, spec = engines
    # The prompt holds each likely first token followed by the model's greedy next token,
    # so the ngram drafts are often likely: both acceptance and rejection happen.
    start = [7, 8, 9] * 6 + [40, 41]
    firsts = {o.outputs[0].token_ids[0] for o in base.generate(
        [{"prompt_token_ids": start}] * 32, [SamplingParams(temperature=1.0, top_k=3, seed=s, max_tokens=1)
                                             for s in range(32)])}
    pairs = []
    for first in sorted(firsts):
        greedy = base.generate([{"prompt_token_ids": start + [first]}], SamplingParams(temperature=0, max_tokens=1))
        pairs += [first, greedy[0].outputs[0].token_ids[0]]
    prompt = {"prompt_token_ids": pairs + start}
    before = _stats(spec)
    a, b = _second_tokens(base, prompt, 160), _second_tokens(spec, prompt, 160)
    after = _stats(spec)
    draft_tokens = after.spec_decode_num_draft_tokens_total - before.spec_decode_num_draft_tokens_total
    accepted = after.spec_decode_num_accepted_tokens_total - before.spec_decode_num_accepted_tokens_total
    assert 0 < accepted < draft_tokens and draft_tokens >= 100, (accepted, draft_tokens)
    tokens = sorted(set(a) | set(b))
    ca = torch.tensor([a.count(t) for t in tokens], dtype=torch.float64)
    cb = torch.tensor([b.count(t) for t in tokens], dtype=torch.float64)
    keep = (ca + cb) >= 10  # pool the rare tokens into one cell
    ca = torch.cat([ca[keep], ca[~keep].sum(0, keepdim=True)])
    cb = torch.cat([cb[keep], cb[~keep].sum(0, keepdim=True)])
    total = ca + cb
    stat = sum(((c - total * c.sum() / total.sum()) ** 2 / (total * c.sum() / total.sum())).clamp(min=0).nan_to_num()
               for c in (ca, cb)).sum()
    df = int((total > 0).sum()) - 1
    p_value = float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), stat / 2))
    assert p_value > 1e-3, (p_value, tokens, ca.tolist(), cb.tolist())


def test_a_request_can_opt_out(engines):
    _, spec = engines
    counts = []
    for speculative in (True, False):
        before = _stats(spec).spec_decode_num_drafts_total
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, speculative=speculative)
        spec.generate(_prompts(), params)
        counts.append(_stats(spec).spec_decode_num_drafts_total - before)
    assert counts[0] > 0 and counts[1] == 0
    with pytest.raises(ValueError, match="speculative"):
        spec.generate(_prompts()[:1], SamplingParams(max_tokens=2, speculative="no"))


@pytest.fixture(scope="module")
def by_batch_size(checkpoint):
    with LLM(str(checkpoint("llama")), speculative_config={**SPEC, "disable_by_batch_size": 2}, **ENGINE) as llm:
        yield llm


def _spec_counts(llm: LLM, prompts: list[dict], params) -> tuple[list, int, int]:
    """Outputs, drafts verified and steps planned with speculation off, over one generate."""
    before = _stats(llm)
    outs = llm.generate(prompts, params)
    after = _stats(llm)
    return (outs, after.spec_decode_num_drafts_total - before.spec_decode_num_drafts_total,
            after.spec_decode_num_steps_disabled_by_batch_size_total
            - before.spec_decode_num_steps_disabled_by_batch_size_total)


def test_disable_by_batch_size_turns_drafts_off_while_more_requests_run(engines, by_batch_size, monkeypatch):
    base, spec = engines
    loops = [{"prompt_token_ids": [11 + i, 12 + i, 13 + i, 14 + i, 15 + i] * 4} for i in range(4)]
    # Four requests running together the whole time: no step is within the threshold, and
    # the executor does no n-gram lookup for steps that would drop it. NOTE: the prompts
    # reach the scheduler a few ms apart, so the first may run a step or two alone (it may
    # look up, and verify, then); none looks up past its second token.
    same = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    ref = base.generate(loops, same)
    _, free_drafts, _ = _spec_counts(spec, loops, same)
    lookups = []  # the sequence length at each lookup
    propose = NgramProposer.propose
    monkeypatch.setattr(NgramProposer, "propose",
                        lambda self, ids, n: lookups.append(len(ids)) or propose(self, ids, n))
    outs, drafts, disabled = _spec_counts(by_batch_size, loops, same)
    monkeypatch.undo()
    _same(ref, outs)
    assert free_drafts > 0 and drafts <= len(lookups) and max(lookups, default=0) <= 22, (drafts, lookups)
    assert disabled >= 18, disabled
    # Two of them end early: the other two draft once they run alone.
    mixed = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (4, 40, 4, 40)]
    outs, drafts, disabled = _spec_counts(by_batch_size, loops, mixed)
    _same(base.generate(loops, mixed), outs)
    assert drafts > 0 and 3 <= disabled <= 5, (drafts, disabled)
    # One at a time: never over the threshold.
    outs, drafts, disabled = _spec_counts(by_batch_size, loops[:1], same)
    _same(ref[:1], outs)
    assert drafts > 0 and disabled == 0, (drafts, disabled)

"""The draft_model proposer (trillium/speculative/draft_model.py).

Config keys as vLLM's SpeculativeConfig takes them (vllm-project/vllm
vllm/config/speculative.py: `model` with `method` "draft_model", which is also
the method a `model` without one gets; `draft_tensor_parallel_size`;
`draft_sample_method` "greedy"), a start-up error for a draft whose vocabulary
differs from the target's, both KV caches in one budget, the proposer's cache
rolled back to what verification kept, freed on release and at sleep, and greedy output
through `LLM` token for token the non-speculative output under a KV cache small
enough to preempt (vLLM's check, tests/v1/e2e/test_spec_decode.py, draft vs
reference greedy). The draft is the target's checkpoint cut to its first layer:
it agrees with the target often, not always, so drafts are both accepted and
rejected.
"""

from __future__ import annotations

import json

import attrs
import pytest
import torch

from trillium import LLM, SamplingParams
from trillium.config import EngineConfig
from trillium.speculative.config import parse_speculative_config

K = 3
ENGINE = dict(num_blocks=20, max_num_batched_tokens=96, max_num_seqs=16)


def _spec(draft: str, **extra) -> dict:
    return {"method": "draft_model", "model": draft, "num_speculative_tokens": K, **extra}


def test_config_keys_as_vllm_takes_them():
    spec = parse_speculative_config({"model": "/d", "num_speculative_tokens": 2})  # vLLM's default method
    assert spec.method == "draft_model" and spec.model == "/d" and spec.num_speculative_tokens == 2
    assert parse_speculative_config(json.dumps(_spec("/d", draft_tensor_parallel_size=1,
                                                    draft_sample_method="greedy"))).model == "/d"
    refused = [
        ({"method": "draft_model", "num_speculative_tokens": 2}, "needs model"),
        (_spec("/d", draft_sample_method="probabilistic"), "draft_sample_method 'probabilistic'"),
        (_spec("/d", draft_tensor_parallel_size=2), "draft_tensor_parallel_size"),
        (_spec("/d", prompt_lookup_min=2), "prompt_lookup_min"),
        (_spec("/d", quantization="fp8"), "quantization"),
        ({"method": "ngram", "num_speculative_tokens": 2, "model": "/d"}, "model"),
    ]
    for value, needle in refused:
        with pytest.raises(ValueError, match=needle):
            parse_speculative_config(value)


def test_vocab_mismatch_is_a_start_up_error(first_layer_draft, checkpoint):
    target, _ = first_layer_draft
    other = str(checkpoint("llama", vocab_size=384))
    config = EngineConfig.build(model=target, num_blocks=20, speculative_config=_spec(other))
    with pytest.raises(ValueError, match="vocab size 384.*has 512"):
        config.resolve()
    with pytest.raises(ValueError, match="nowhere"):
        EngineConfig.build(model=target, speculative_config=_spec("/nowhere")).resolve()


def test_both_kv_caches_share_one_budget(first_layer_draft):
    target, draft = first_layer_draft
    plain = EngineConfig.build(model=target, kv_cache_memory="4MiB").resolve()
    both = EngineConfig.build(model=target, kv_cache_memory="4MiB", speculative_config=_spec(draft)).resolve()
    spec = both.speculative_config
    per_draft_block = plain.kv_block_bytes // 2  # one of the target's two layers
    tail = spec.num_draft_blocks - both.num_blocks
    assert tail == both.max_num_seqs * 2 and both.num_blocks < plain.num_blocks
    assert both.num_blocks * both.kv_block_bytes + spec.num_draft_blocks * per_draft_block <= 4 * 2**20
    assert (both.num_blocks + 1) * both.kv_block_bytes + (spec.num_draft_blocks + 1) * per_draft_block > 4 * 2**20


@attrs.define
class _Req:
    request_id: str
    token_ids: list[int]


def test_proposer_rolls_back_to_the_kept_tokens_and_frees_on_release(first_layer_draft):
    from trillium.speculative.draft_model import DraftModelProposer

    target, draft = first_layer_draft
    # A pool of 4 blocks of 16 tokens (2 for the first request, 2 tail blocks).
    config = EngineConfig.build(model=target, num_blocks=2, max_num_seqs=1, max_model_len=64,
                                speculative_config=_spec(draft)).resolve()
    assert config.speculative_config.num_draft_blocks == 4
    proposer = DraftModelProposer(config, torch.device("cpu"))
    fresh = DraftModelProposer(config, torch.device("cpu"))
    prompt = list(range(40, 60))
    a = _Req("a", list(prompt))
    first = proposer.propose_batch([a], [K])[0]
    assert len(first) == K and proposer.num_free_blocks == 2  # positions 0..21: 2 blocks
    # Verification kept one draft and corrected the next: the cache must hold exactly the
    # request's tokens again, so the next drafts are what a fresh cache proposes.
    a.token_ids += [first[0], (first[1] + 1) % 512]
    again = proposer.propose_batch([a], [K])[0]
    assert again == fresh.propose_batch([_Req("x", list(a.token_ids))], [K])[0]
    # A second request does not fit beside the first (no blocks left): no drafts, no error.
    b = _Req("b", list(range(100, 131)))  # 31 + 2 draft positions: 3 blocks
    assert proposer.propose_batch([b], [K]) == [[]]
    proposer.release(["a", "b"])
    assert proposer.num_free_blocks == 4
    assert len(proposer.propose_batch([b], [K])[0]) == K  # now it fits
    # Sleep frees the draft's cache (and every request's draft state); the wake allocates it again.
    assert proposer.sleep() > 0 and proposer.num_free_blocks == 4 and not proposer.kv_caches
    proposer.wake_weights()
    proposer.wake_kv_cache(config)
    assert proposer.propose_batch([_Req("c", list(a.token_ids))], [K]) == [again]


def _prompts() -> list[dict]:
    return [{"prompt_token_ids": [11, 12, 13, 14, 15] * 4}, {"prompt_token_ids": list(range(20, 60))},
            {"prompt_token_ids": [7, 8, 9] * 6 + [40, 41]}, {"prompt_token_ids": [200, 201, 202]}]


def test_greedy_identity_under_preemption(first_layer_draft):
    target, draft = first_layer_draft
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, logprobs=1) for m in (32, 25, 17, 1)]
    params[2] = SamplingParams(n=2, temperature=0, max_tokens=24, ignore_eos=True)
    # Beside them, requests enough to overflow the 20-block cache: preempted and recomputed.
    crowd = [{"prompt_token_ids": [30 + i, 31 + i, 32 + i] * 8} for i in range(6)]
    crowd_params = [SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)] * 6
    with LLM(target, **ENGINE) as base, LLM(target, speculative_config=_spec(draft), **ENGINE) as spec:
        ref = base.generate(_prompts() + crowd, params + crowd_params)
        out = spec.generate(_prompts() + crowd, params + crowd_params)
        stats = spec.get_stats()
    for x, y in zip(ref, out, strict=True):
        for cx, cy in zip(x.outputs, y.outputs, strict=True):
            assert cx.token_ids == cy.token_ids and cx.finish_reason == cy.finish_reason
            if cx.logprobs is not None:
                for px, py in zip(cx.logprobs, cy.logprobs, strict=True):
                    assert px.keys() == py.keys() and all(abs(px[t].logprob - py[t].logprob) < 1e-4 for t in px)
    assert stats.num_preempted_total > 0, "the small KV cache should preempt"
    assert 0 < stats.spec_decode_num_accepted_tokens_total < stats.spec_decode_num_draft_tokens_total


def test_greedy_identity_when_disable_by_batch_size_skips_proposals(first_layer_draft):
    """Steps with more running requests than disable_by_batch_size propose nothing: the draft's
    cache misses those tokens and catches up at the next proposal, output unchanged."""
    target, draft = first_layer_draft
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (6, 30, 6, 30)]
    with LLM(target, **ENGINE) as base, LLM(target, speculative_config=_spec(draft, disable_by_batch_size=2),
                                            **ENGINE) as spec:
        ref = base.generate(_prompts(), params)
        out = spec.generate(_prompts(), params)
        stats = spec.get_stats()
    assert [c.token_ids for x in ref for c in x.outputs] == [c.token_ids for x in out for c in x.outputs]
    assert stats.spec_decode_num_steps_disabled_by_batch_size_total >= 4
    assert 0 < stats.spec_decode_num_accepted_tokens_total <= stats.spec_decode_num_draft_tokens_total

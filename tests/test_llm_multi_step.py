"""--num-scheduler-steps (multi-step decode) end to end: the real actors in-process,
transformers and the one-forward-per-step engine as oracles (scheduler/multi_step.py).

A decode step running K forwards on the executor must change nothing a client
sees but how tokens are grouped: greedy tokens and top-5 logprobs identical to
transformers, also when a tiny KV pool makes requests evict each other; for
a mixed batch (every max_tokens from 1, stop token ids with and without
min_tokens, a stop string, n = 3 seeded with every penalty, logprobs, a
structured-output choice) the same tokens, text, finish reasons and counts
as with one forward per step. And it must really run: far fewer steps than
tokens while one request decodes alone, none of it while a request waits.
vLLM's flag: vllm/engine/arg_utils.py EngineArgs.num_scheduler_steps (its v0
multi-step scheduling, vllm/engine/output_processor/multi_step.py).
"""

from __future__ import annotations

import pytest

from support.llm_parity import assert_runs_agree, mixed_batch, preemption_inputs, view
from trillium import LLM, SamplingParams
from trillium.actors.scheduler.multi_step import extra_forwards, steps_ahead
from trillium.config import EngineConfig


def test_multi_step_matches_one_step_and_transformers(checkpoint):
    path = checkpoint("llama")
    hf_model, prompts, greedy = preemption_inputs(path, seed=2)
    runs = {}
    for steps in (1, 4):
        # 20 blocks of 16 tokens: the largest request needs 12, so requests evict each other.
        with LLM(str(path), num_blocks=20, max_num_batched_tokens=64, max_num_seqs=16,
                 num_scheduler_steps=steps) as llm:
            assert llm.config.async_scheduling  # unset: planned ahead while at most 4 run, K forwards a step too
            parity = llm.generate(prompts, greedy)
            preempted = llm.get_stats().num_preempted_total
        with LLM(str(path), num_scheduler_steps=steps) as llm:  # room for all: steps of K forwards
            mixed, params, stop_id = mixed_batch(llm)
            runs[steps] = (parity, preempted, view(llm.generate(mixed, params)))
    (one, _, one_mixed), (parity, preempted, mixed) = runs[1], runs[4]
    assert preempted > 0, "the tiny KV cache should force preemption"
    assert_runs_agree(hf_model, prompts, parity, one, mixed, one_mixed, stop_id)


def test_multi_step_runs_k_forwards_per_step_only_while_nothing_waits(checkpoint):
    """Step counts from the engine's own stats: one request of 33 tokens takes its prefill step
    and 8 steps of 4 forwards; with a request waiting behind max_num_seqs = 1, one per token."""
    path = checkpoint("llama")
    params = SamplingParams(temperature=0.0, max_tokens=33, ignore_eos=True)
    # WHY synchronous: planned ahead, the first request may run a step of K before the second's
    # AddRequest lands, and the counts below would depend on that race
    with LLM(str(path), num_scheduler_steps=4, max_num_seqs=1, async_scheduling=False) as llm:
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0.0, max_tokens=2))
        before = llm.get_stats().step_id
        out = llm.generate([{"prompt_token_ids": list(range(20, 40))}], params)
        alone = llm.get_stats().step_id - before
        assert len(out[0].outputs[0].token_ids) == 33
        before = llm.get_stats().step_id
        two = llm.generate([{"prompt_token_ids": list(range(20, 40))}, {"prompt_token_ids": list(range(50, 70))}],
                           params)
        queued = llm.get_stats().step_id - before
    assert alone == 1 + 8
    assert [len(o.outputs[0].token_ids) for o in two] == [33, 33]
    # The first request decodes one token a step while the second waits; the second runs alone.
    assert queued == 33 + 1 + 8


class _Running:
    def __init__(self, num_tokens: int, num_computed_tokens: int) -> None:
        self.num_tokens = num_tokens
        self.num_computed_tokens = num_computed_tokens


def test_steps_ahead_and_caps():
    decoding = [_Running(10, 9), _Running(30, 29)]
    assert steps_ahead(1, decoding, 0, 100, 16) == 0  # off
    assert steps_ahead(8, decoding, 0, 100, 16) == 7
    assert steps_ahead(8, decoding, 1, 100, 16) == 0  # a request waits
    assert steps_ahead(8, [*decoding, _Running(40, 16)], 0, 100, 16) == 0  # a prompt is mid-prefill
    assert steps_ahead(8, decoding, 0, 4, 16) == 7  # 2 blocks each: room for both
    assert steps_ahead(8, decoding, 0, 3, 16) == 0  # not: one forward, never a preemption for them
    # ahead, budget left, outputs so far, max_tokens, tokens, max_model_len
    assert extra_forwards(7, 100, 0, 100, 10, 1000) == 7
    assert extra_forwards(7, 3, 0, 100, 10, 1000) == 2  # the step's token budget
    assert extra_forwards(7, 100, 5, 8, 10, 1000) == 2  # max_tokens: 3 left, the first forward's included
    assert extra_forwards(7, 100, 0, 100, 997, 1000) == 2  # max_model_len
    assert extra_forwards(7, 100, 7, 8, 10, 1000) == 0


@pytest.mark.parametrize("extra, message", [
    (dict(num_scheduler_steps=0), "must be in 1..16"),
    (dict(num_scheduler_steps=17), "must be in 1..16"),
    (dict(num_scheduler_steps=4, speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
     "with --speculative-config"),
    (dict(num_scheduler_steps=4, tensor_parallel_size=2), "with --tensor-parallel-size"),
])
def test_multi_step_refused_where_not_supported(extra, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.build(model="unused", **extra)


def test_multi_step_keeps_async_scheduling(checkpoint, caplog):
    """Multi-step steps are planned ahead too (scheduler/in_flight.py: a step's K placeholders;
    tests/test_llm_async_scheduling.py holds them to the synchronous engine): asked, at any batch;
    unset, while at most 4 requests run; no warning."""
    path = checkpoint("llama")
    asked = EngineConfig.build(model=str(path), num_scheduler_steps=4, async_scheduling=True).resolve()
    assert (asked.async_scheduling, asked.async_max_running) == (True, 0)
    unset = EngineConfig.build(model=str(path), num_scheduler_steps=4).resolve()
    assert (unset.async_scheduling, unset.async_max_running) == (True, 4)
    assert "async" not in caplog.text


def test_a_run_ended_at_a_stop_id_caches_no_block_past_its_keys(checkpoint):
    """A multi-step run that ends at a stop token id mid-step (the scheduler had counted every forward
    as computed) registers in the prefix cache only blocks whose keys were written: the stop token
    here is the last slot of a block, and it is never fed, so that block is not cached. A follow-up
    prompt extending the conversation through the stop token (a chat template does) then gets the
    same greedy tokens as an engine without a prefix cache."""
    path = checkpoint("llama")
    prompt = list(range(20, 33))  # 13 tokens: output i sits at position 13 + i
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    with LLM(str(path), enable_prefix_caching=False) as llm:  # the oracle: no cache to share blocks with
        free = list(llm.generate([{"prompt_token_ids": prompt}], greedy)[0].outputs[0].token_ids)
    # position 31 ends block 1; output 18 is there, the second forward of the step of outputs 17-24
    i = 18
    assert free[i] not in free[:i], "the stop id must first come at output 18"
    with LLM(str(path), num_scheduler_steps=8) as llm:
        stop = SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[free[i]])
        out = llm.generate([{"prompt_token_ids": prompt}], stop)[0].outputs[0]
        assert (list(out.token_ids), out.finish_reason) == (free[: i + 1], "stop")
        follow = {"prompt_token_ids": prompt + free[: i + 1] + [5, 6, 7]}
        before = llm.get_stats().prefix_cache_hits_total
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)
        cached = llm.generate([follow], params)[0].outputs[0]
        assert llm.get_stats().prefix_cache_hits_total - before == 16, "block 0 only: block 1's last slot is unwritten"
    with LLM(str(path), enable_prefix_caching=False) as llm:
        fresh = llm.generate([follow], params)[0].outputs[0]
    assert cached.token_ids == fresh.token_ids
    for got, want in zip(cached.logprobs, fresh.logprobs):
        assert got.keys() == want.keys() and all(abs(got[t].logprob - want[t].logprob) < 1e-3 for t in got)

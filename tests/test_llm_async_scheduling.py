"""--async-scheduling end to end: the real actors in-process, transformers and the
synchronous engine as oracles (scheduler/in_flight.py).

With a step planned while the previous one runs, every request must come out
exactly as without: greedy tokens and top-5 logprobs identical to
transformers under preemption (a KV pool so small requests evict each other
while a step is in flight); and, for a mixed batch of max_tokens, stop token
ids, stop strings, seeded sampling, n > 1, penalties, logprobs and a
structured-output choice, the same tokens, text, finish reasons and counts
as the synchronous engine. Mirrors vLLM's async scheduling
(vllm/v1/core/sched/async_scheduler.py; LLM(async_scheduling=...) is
vllm/engine/arg_utils.py EngineArgs.async_scheduling).
"""

from __future__ import annotations

from support.llm_parity import assert_runs_agree, mixed_batch, preemption_inputs, view
from trillium import LLM, SamplingParams


def test_async_scheduling_matches_sync_and_transformers_under_preemption(checkpoint):
    path = checkpoint("llama")
    hf_model, prompts, greedy = preemption_inputs(path, seed=1)
    runs = {}
    for mode in (False, True):
        # 20 blocks of 16 tokens: the largest request needs 12, so requests evict each other.
        with LLM(str(path), num_blocks=20, max_num_batched_tokens=64, max_num_seqs=16,
                 async_scheduling=mode) as llm:
            assert llm.config.async_scheduling is mode
            parity = llm.generate(prompts, greedy)
            mixed, params, stop_id = mixed_batch(llm)
            runs[mode] = (parity, view(llm.generate(mixed, params)), llm.get_stats())
    (sync, sync_mixed, _), (parity, mixed, stats) = runs[False], runs[True]
    assert stats.num_preempted_total > 0, "the tiny KV cache should force preemption"
    assert_runs_agree(hf_model, prompts, parity, sync, mixed, sync_mixed, stop_id)


def test_async_multi_step_matches_sync_and_transformers_under_preemption(checkpoint):
    """--async-scheduling with --num-scheduler-steps 4: a step of K forwards is planned while the one
    before runs, over its K placeholders (in_flight.py). The same parity as above against the
    synchronous one-forward engine; and greedy streams without logprobs (native greedy runs where
    compiled decode is on), a stop token id ending a run mid-step, so the step planned behind it
    finds that request finished (executor RequestState.ended)."""
    path = checkpoint("llama")
    hf_model, prompts, greedy = preemption_inputs(path, seed=3)
    plain = [{"prompt_token_ids": p["prompt_token_ids"][:12]} for p in prompts[:3]]  # room in the pool: K forwards
    runs = {}
    for mode, steps in ((False, 1), (True, 4)):
        with LLM(str(path), num_blocks=20, max_num_batched_tokens=64, max_num_seqs=16, async_scheduling=mode,
                 num_scheduler_steps=steps, enforce_eager=not mode) as llm:
            assert llm.config.async_scheduling is mode
            parity = llm.generate(prompts, greedy)
            mixed, params, stop_id = mixed_batch(llm)
            mixed_view = view(llm.generate(mixed, params))
            before = llm.get_stats().step_id
            free = llm.generate(plain, SamplingParams(temperature=0.0, max_tokens=21, ignore_eos=True))
            stops = [SamplingParams(temperature=0.0, max_tokens=21, stop_token_ids=[o.outputs[0].token_ids[i]])
                     for i, o in zip((6, 13, 2), free)]
            stopped = [o.outputs[0] for o in llm.generate(plain, stops)]
            runs[mode] = (parity, mixed_view, llm.get_stats(), llm.get_stats().step_id - before, free, stopped)
    (sync, sync_mixed, _, sync_steps, sync_free, sync_stopped) = runs[False]
    (parity, mixed, stats, steps_taken, free, stopped) = runs[True]
    assert stats.num_preempted_total > 0, "the tiny KV cache should force preemption"
    assert_runs_agree(hf_model, prompts, parity, sync, mixed, sync_mixed, stop_id)
    assert [o.outputs[0].token_ids for o in free] == [o.outputs[0].token_ids for o in sync_free]
    assert [(o.token_ids, o.finish_reason, o.stop_reason) for o in stopped] == [
        (o.token_ids, o.finish_reason, o.stop_reason) for o in sync_stopped]
    assert all(o.finish_reason == "stop" for o in stopped)
    assert steps_taken < sync_steps / 2, (steps_taken, sync_steps)  # K forwards a step

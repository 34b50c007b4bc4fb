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
from trillium import LLM


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

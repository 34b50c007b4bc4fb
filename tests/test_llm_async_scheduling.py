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

import pytest

from support.llm_parity import assert_parity, mixed_prompts
from support.oracles import transformers_model
from trillium import LLM, SamplingParams


def test_async_greedy_parity_with_transformers_under_preemption(checkpoint):
    path = checkpoint("llama")
    hf_model = transformers_model(path)
    prompts = mixed_prompts(hf_model.config.vocab_size, seed=1)
    with LLM(str(path), num_blocks=20, max_num_batched_tokens=64, max_num_seqs=16, async_scheduling=True) as llm:
        assert llm.config.async_scheduling
        assert_parity(llm, hf_model, prompts)
        stats = llm.get_stats()
    assert stats.num_preempted_total > 0, "the tiny KV cache should force preemption"

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

from support.llm_parity import MAX_NEW, mixed_batch, mixed_prompts, view
from support.oracles import hf_greedy, transformers_model
from trillium import LLM, SamplingParams


def test_async_scheduling_matches_sync_and_transformers_under_preemption(checkpoint):
    path = checkpoint("llama")
    hf_model = transformers_model(path)
    prompts = [{"prompt_token_ids": p} for p in mixed_prompts(hf_model.config.vocab_size, seed=1)]
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=MAX_NEW, logprobs=5)
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
    for a, b in zip(parity, sync):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for got, want in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert got.keys() == want.keys()
            assert all(abs(got[t].logprob - want[t].logprob) < 1e-3 for t in got)
    # WHY four: transformers is the slow part; test_llm.py holds the sync engine to it on all of them.
    for prompt, out in list(zip(prompts, parity))[-4:]:
        assert list(out.outputs[0].token_ids) == hf_greedy(hf_model, prompt["prompt_token_ids"], MAX_NEW)[0]
    assert mixed == sync_mixed
    counts = [len(choices[0][0]) for choices in mixed[:5]]
    assert counts == [1, 2, 3, 7, 16]  # no token lost or duplicated at max_tokens
    stopped = mixed[5][0]
    assert stopped[2] == "stop" and stopped[3] == stop_id and stopped[0].count(stop_id) == 1
    assert mixed[7][0][2] == "stop"  # the stop string
    assert len({c[0] for c in mixed[8]}) > 1 and all(len(c[0]) == 10 for c in mixed[8])
    assert mixed[10][0][1] in ("left", "right", "up")

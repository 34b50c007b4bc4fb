"""Greedy parity of the offline `LLM` with transformers: mixed prompts and the check itself.

`assert_parity` generates greedily with top-5 logprobs and compares every
token and logprob with `support.oracles.hf_greedy`. Used by the synthetic
checkpoint tests (test_llm.py) and the real-model ones (test_llm_real_models.py).
"""

from __future__ import annotations

import random

from support.oracles import hf_greedy
from trillium import LLM, SamplingParams

MAX_NEW = 12


def mixed_prompts(vocab: int, seed: int = 0, count: int = 18) -> list[list[int]]:
    """Mixed lengths (4..180 tokens); five prompts share a 100-token prefix."""
    rng = random.Random(seed)
    shared = [rng.randrange(7, vocab) for _ in range(100)]
    prompts = []
    for i in range(count):
        if i % 3 == 0 and len(prompts) < 15:
            prompts.append(shared + [rng.randrange(7, vocab) for _ in range(rng.randint(1, 40))])
        else:
            prompts.append([rng.randrange(7, vocab) for _ in range(rng.choice([4, 9, 30, 70, 130, 180]))])
    return prompts


def assert_parity(llm: LLM, hf_model, prompts: list[list[int]], max_new: int = MAX_NEW) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=max_new, min_tokens=max_new, logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, output in zip(prompts, outputs):
        expected_tokens, expected_tops = hf_greedy(hf_model, prompt, max_new)
        completion = output.outputs[0]
        assert completion.token_ids == expected_tokens, f"prompt of {len(prompt)} tokens diverged"
        assert completion.finish_reason == "length"
        for step, (ids, values) in enumerate(expected_tops):
            got = completion.logprobs[step]
            for token_id, value in zip(ids, values):
                assert token_id in got, f"step {step}: top-5 token {token_id} missing"
                assert abs(got[token_id].logprob - value) < 1e-3, (step, token_id)

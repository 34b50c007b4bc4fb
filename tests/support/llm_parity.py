"""Greedy parity of the offline `LLM` with transformers: mixed prompts and the check itself.

`assert_parity` generates greedily with top-5 logprobs and compares every
token and logprob with `support.oracles.hf_greedy`. Used by the synthetic
checkpoint tests (test_llm.py) and the real-model ones (test_llm_real_models.py).
`mixed_batch` / `view`: a batch touching every stop rule and per-request sampling state,
and what two engine configurations must both produce for it; `preemption_inputs` /
`assert_runs_agree`: the rest of a test holding a configuration to the default one
(test_llm_async_scheduling.py, test_llm_multi_step.py).
"""

from __future__ import annotations

import random

from support.oracles import hf_greedy, transformers_model
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


def mixed_batch(llm: LLM):
    """Prompts and params covering every stop rule and the executor's per-request state: max_tokens
    1..16, a stop token id (with and without min_tokens), a stop string, n = 3 seeded with every
    penalty, logprobs, a structured-output choice. Returns (prompts, params, the stop token id)."""
    from trillium.structured_outputs import StructuredOutputsParams

    free = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    tokens, text = list(free.outputs[0].token_ids), free.outputs[0].text
    stop_id = tokens[4]
    prompts, params = [], []

    def add(prompt, p):
        prompts.append(prompt)
        params.append(p)

    for max_tokens in (1, 2, 3, 7, 16):  # max_tokens known ahead: never planned past it
        add({"prompt_token_ids": list(range(10, 10 + 3 * max_tokens))},
            SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    add("Once upon a time", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=[stop_id]))
    add("Once upon a time", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=[stop_id],
                                           min_tokens=tokens.index(stop_id) + 2))
    add("Once upon a time", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[text[5:8]]))
    add({"prompt_token_ids": list(range(40, 90))},  # n > 1, seeded, with every penalty
        SamplingParams(n=3, temperature=1.0, top_p=0.9, seed=7, max_tokens=10, ignore_eos=True,
                       presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2))
    add({"prompt_token_ids": [5, 6, 7, 8]}, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3))
    add("Pick one:", SamplingParams(temperature=1.0, seed=3, max_tokens=8,
                                    structured_outputs=StructuredOutputsParams(choice=("left", "right", "up"))))
    return prompts, params, stop_id


def view(outputs):
    """What a run must reproduce: per choice its tokens, text, finish and stop reasons, logprobs."""
    return [[(tuple(c.token_ids), c.text, c.finish_reason, c.stop_reason,
              [sorted(lp) for lp in (c.logprobs or [])]) for c in out.outputs] for out in outputs]


def preemption_inputs(path, seed: int):
    """(transformers model, mixed prompts as requests, greedy top-5-logprob params) for a parity run."""
    hf_model = transformers_model(path)
    prompts = [{"prompt_token_ids": p} for p in mixed_prompts(hf_model.config.vocab_size, seed=seed)]
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=MAX_NEW, logprobs=5)
    return hf_model, prompts, greedy


def assert_runs_agree(hf_model, prompts, parity, reference, mixed, reference_mixed, stop_id: int) -> None:
    """A configuration's run against the default one's: greedy tokens equal and logprobs within 1e-3
    of the reference run, the last four equal to transformers, and the mixed batch (`view`) identical,
    each of its stop rules and states as `mixed_batch` set them."""
    for a, b in zip(parity, reference):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for got, want in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert got.keys() == want.keys()
            assert all(abs(got[t].logprob - want[t].logprob) < 1e-3 for t in got)
    # WHY four: transformers is the slow part; test_llm.py holds the default engine to it on all of them.
    for prompt, out in list(zip(prompts, parity))[-4:]:
        assert list(out.outputs[0].token_ids) == hf_greedy(hf_model, prompt["prompt_token_ids"], MAX_NEW)[0]
    assert mixed == reference_mixed
    assert [len(choices[0][0]) for choices in mixed[:5]] == [1, 2, 3, 7, 16]  # no token lost or duplicated
    stopped = mixed[5][0]
    assert stopped[2] == "stop" and stopped[3] == stop_id and stopped[0].count(stop_id) == 1
    assert mixed[7][0][2] == "stop"  # the stop string
    assert len({c[0] for c in mixed[8]}) > 1 and all(len(c[0]) == 10 for c in mixed[8])
    assert mixed[10][0][1] in ("left", "right", "up")

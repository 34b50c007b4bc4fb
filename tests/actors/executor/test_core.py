"""ExecutorCore driven by the real scheduler core, checked step by step
against the model run from scratch on each sequence's full token list.

Covers the per-step fast paths: pure decode steps (every row sampled, no
row gather), mixed prefill + decode steps, and logprobs converted to Python
once per step for the rows that asked.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from trillium.actors.executor.core import ExecutorCore
from trillium.actors.protocol.requests import AddRequest
from trillium.actors.scheduler.core import build_scheduler
from trillium.config import EngineConfig
from trillium.kernels import AttentionMetadata
from trillium.sampling_params import SamplingParams


def _last_logprobs(core: ExecutorCore, tokens: list[int]) -> torch.Tensor:
    """log_softmax of the next-token logits after `tokens`, one fresh prefill."""
    model = core.model
    block_size = 16
    num_blocks = -(-len(tokens) // block_size)
    caches = model.allocate_kv_caches(num_blocks, block_size)
    meta = AttentionMetadata.build([len(tokens)], [len(tokens)], [list(range(num_blocks))], block_size)
    with torch.inference_mode():
        hidden = model(torch.tensor(tokens), torch.arange(len(tokens)), caches, meta)
        return model.compute_logits(hidden[-1:])[0].log_softmax(-1)


def test_steps_match_the_model_run_from_scratch(checkpoint) -> None:
    cfg = EngineConfig(model=str(checkpoint("llama")), max_num_batched_tokens=48, kv_cache_memory="4MiB").resolve()
    core, scheduler = ExecutorCore(cfg), build_scheduler(cfg)
    prompts = {"a": [5, 9, 13, 2, 7], "b": list(range(10, 70)), "c": [3] * 21}
    wants_logprobs = {"a": 3, "b": None, "c": 2}
    for rid, prompt in prompts.items():
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=wants_logprobs[rid])
        scheduler.add_request(AddRequest(
            request_id=rid, prompt_token_ids=np.array(prompt, np.int32), sampling=params,
            eos_token_ids=(2,), arrival_time=time.time(),
        ))  # fmt: skip
    tokens = {rid: list(p) for rid, p in prompts.items()}
    num_pure_decode_steps = num_sampled = 0
    while scheduler.has_work():
        batch = scheduler.schedule()
        if batch is None:
            break
        num_pure_decode_steps += all(n == 1 for n in batch.num_scheduled_tokens.tolist())
        result = core.execute(batch)
        for rid, token in zip(result.request_ids, result.sampled_token_ids.tolist()):
            if token < 0:
                continue  # a prefill chunk that does not reach the end of the prompt
            expected = _last_logprobs(core, tokens[rid])
            assert token == int(expected.argmax())
            if wants_logprobs[rid] is None:
                assert rid not in result.logprobs
            else:
                got = result.logprobs[rid]
                assert got.token_id == token
                assert abs(got.logprob - float(expected[token])) < 1e-4
                assert len(got.top_token_ids) == wants_logprobs[rid]
                assert got.top_token_ids[0] == token
            tokens[rid].append(token)
            num_sampled += 1
        scheduler.update_from_output(result)
    assert num_sampled == 18
    assert num_pure_decode_steps >= 3

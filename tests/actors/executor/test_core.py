"""ExecutorCore driven by the real scheduler core, checked step by step
against the model run from scratch on each sequence's full token list.

Covers the per-step fast paths: pure decode steps (every row sampled, no
row gather), mixed prefill + decode steps, and logprobs converted to Python
once per step for the rows that asked.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
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


def test_multi_step_sends_each_intervals_tokens_ahead_and_never_a_runs_last(checkpoint) -> None:
    """Multi-step decode (scheduler/multi_step.py): every --stream-interval forwards the executor
    hands the tokens sampled since its last send to `on_ahead_tokens` (AheadTokens), with their
    logprobs; they are the step's tokens in order, never its last (c's stop token id ends its run
    mid-step and is never sent ahead); the scheduler's deltas (ahead, then the result's rest)
    give every output token once."""
    for interval in (1, 2):
        cfg = EngineConfig(model=str(checkpoint("llama")), kv_cache_memory="4MiB", num_scheduler_steps=4,
                           stream_interval=interval, enforce_eager=True).resolve()
        core, scheduler = ExecutorCore(cfg), build_scheduler(cfg)
        free_c = _greedy(core, [7, 3, 11], 11)
        cut = next(i for i in range(4, 11) if free_c[i] not in free_c[:i])  # mid-run, after the prefill step
        expected = {"a": _greedy(core, [5, 9, 13], 11), "c": free_c[: cut + 1]}
        expected["b"] = expected["a"]
        sent = []
        core.on_ahead_tokens = sent.append
        for rid, prompt, logprobs, stop in (("a", [5, 9, 13], 2, []), ("b", [5, 9, 13], None, []),
                                            ("c", [7, 3, 11], None, [free_c[cut]])):
            params = SamplingParams(temperature=0.0, max_tokens=11, ignore_eos=True, logprobs=logprobs,
                                    stop_token_ids=stop)
            scheduler.add_request(AddRequest(request_id=rid, prompt_token_ids=np.array(prompt, np.int32),
                                             sampling=params, eos_token_ids=(2,), arrival_time=time.time()))
        streamed = {rid: [] for rid in expected}
        finish = {}
        num_multi_steps = 0
        while scheduler.has_work():
            batch = scheduler.schedule()
            sent.clear()
            result = core.execute(batch)
            num_multi_steps += bool(sent)
            for k, message in enumerate(sent):
                assert message.step_id == batch.step_id and message.token_ids.shape[1] == interval
                offset = k * interval
                for i, rid in enumerate(message.request_ids):
                    step = [int(result.sampled_token_ids[result.request_ids.index(rid)]),
                            *result.more_token_ids[rid]]
                    assert message.token_ids[i].tolist() == step[offset: offset + interval]
                    assert offset + interval < len(step), "a run's last token is never sent ahead"
                    if rid == "a":
                        lps = [result.logprobs["a"], *result.more_logprobs["a"]][offset: offset + interval]
                        assert message.logprobs["a"] == tuple(lps)
                    else:
                        assert rid not in message.logprobs
                deltas = scheduler.ahead_tokens(message)
                for d in deltas.deltas:
                    streamed[d.request_id].extend(d.new_token_ids)
            for d in scheduler.update_from_output(result).deltas:
                streamed[d.request_id].extend(d.new_token_ids)
                finish[d.request_id] = d.finish_reason
        assert num_multi_steps >= 2
        assert streamed == expected
        assert finish == {"a": "length", "b": "length", "c": "stop"}


def test_multi_step_greedy_rows_run_natively_with_the_samplers_tokens(checkpoint) -> None:
    """Multi-step decode's inner forwards of rows the sampler would give their argmax
    (SamplingState.argmax_only) run as native greedy runs (CompiledDecode.greedy_run): the same
    tokens as the model run from scratch, a stop token id mid-run ending that row's run, rows of
    different max_tokens, every --stream-interval's tokens still sent ahead, each step's first
    forward in the run too; a row asking for logprobs sends its whole batch's forwards through the
    sampler again."""
    for interval in (1, 3):
        cfg = EngineConfig(model=str(checkpoint("llama")), kv_cache_memory="4MiB", num_scheduler_steps=8,
                           stream_interval=interval, enforce_eager=False).resolve()
        core, scheduler = ExecutorCore(cfg), build_scheduler(cfg)
        if getattr(core.forward, "native_decode", None) is None:
            pytest.skip("no native decode here (the C++ ops did not build)")
        free_c = _greedy(core, [7, 3, 11], 19)
        cut = next(i for i in range(9, 19) if free_c[i] not in free_c[:i])  # in the second step's run
        expected = {"a": _greedy(core, [5, 9, 13], 19), "c": free_c[: cut + 1]}
        expected["b"] = expected["a"][:13]
        requests = (("a", [5, 9, 13], 19, []), ("b", [5, 9, 13], 13, []), ("c", [7, 3, 11], 19, [free_c[cut]]))
        for rid, prompt, max_tokens, stop in requests:
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, stop_token_ids=stop)
            scheduler.add_request(AddRequest(request_id=rid, prompt_token_ids=np.array(prompt, np.int32),
                                             sampling=params, eos_token_ids=(2,), arrival_time=time.time()))
        got, sent = _run_to_end(core, scheduler)
        assert got == expected
        # every forward of the three decode steps natively, each step's first one too (_greedy_from_first):
        # 8 (all three), 8 (b's 4 within them), 2 (a's last two)
        assert core.forward.num_greedy_steps == 18, core.forward.num_greedy_steps
        assert all(m.token_ids.shape[1] == interval for m in sent) and len(sent) >= (2 if interval == 3 else 6)
        # a row with logprobs beside them: every inner forward through the sampler, the same tokens
        before = core.forward.num_greedy_steps
        for rid, logprobs in (("d", None), ("e", 2)):
            params = SamplingParams(temperature=0.0, max_tokens=19, ignore_eos=True, logprobs=logprobs)
            scheduler.add_request(AddRequest(request_id=rid, prompt_token_ids=np.array([5, 9, 13], np.int32),
                                             sampling=params, eos_token_ids=(2,), arrival_time=time.time()))
        got, _ = _run_to_end(core, scheduler)
        assert got == {"d": expected["a"], "e": expected["a"]}
        assert core.forward.num_greedy_steps == before


def test_multi_step_greedy_runs_of_more_rows_than_dense_cpus(checkpoint) -> None:
    """20 greedy rows (past dense_cpu's 16 on a Zen 4, where native decode runs the layers' and the LM
    head's float32 linears on their panel-packed copies): the native greedy runs take all 20 at once
    and every request's tokens are the model run from scratch."""
    cfg = EngineConfig(model=str(checkpoint("llama")), kv_cache_memory="8MiB", num_scheduler_steps=8,
                       stream_interval=4, enforce_eager=False, max_num_seqs=32).resolve()
    core, scheduler = ExecutorCore(cfg), build_scheduler(cfg)
    native = getattr(core.forward, "native_decode", None)
    if native is None or native.greedy_rows < 20:
        pytest.skip("no native greedy runs of 20 rows here")
    widths: list[int] = []  # the rows of each greedy run that ran (not refused)
    greedy = native.greedy

    def counted(first_ids, run, *args, **kwargs):
        tokens = greedy(first_ids, run, *args, **kwargs)
        if tokens is not None:
            widths.append(run.num_seqs)
        return tokens

    native.greedy = counted
    prompts = {f"r{i}": [5 + i, 9, 13 + 2 * i, 4 + i % 3] for i in range(20)}
    expected = {rid: _greedy(core, prompt, 12) for rid, prompt in prompts.items()}
    for rid, prompt in prompts.items():
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        scheduler.add_request(AddRequest(request_id=rid, prompt_token_ids=np.array(prompt, np.int32),
                                         sampling=params, eos_token_ids=(2,), arrival_time=time.time()))
    got, _ = _run_to_end(core, scheduler)
    assert got == expected
    assert max(widths) == 20 and core.forward.num_greedy_steps >= 8


def _run_to_end(core: ExecutorCore, scheduler) -> tuple[dict[str, list[int]], list]:
    """Step until nothing is left: each request's output tokens, and the AheadTokens sent."""
    got: dict[str, list[int]] = {}
    sent: list = []
    core.on_ahead_tokens = sent.append
    while scheduler.has_work():
        batch = scheduler.schedule()
        if batch is None:
            break
        for d in scheduler.update_from_output(core.execute(batch)).deltas:
            got.setdefault(d.request_id, []).extend(d.new_token_ids)
    return got, sent


def _greedy(core: ExecutorCore, prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(int(_last_logprobs(core, tokens).argmax()))
    return tokens[len(prompt):]

"""Compiled decode (executor/compiled_decode.py): the one test that compiles.

A real ExecutorCore with `enforce_eager=False` and one bucket (4) against an
eager core on the same checkpoint, both driven by the real scheduler core:
greedy tokens identical to eager and to transformers (3 requests: decode
steps of 3 rows padded to 4, then 1-2 rows as they finish), then a live
weight update (in-place copy, and a `param.data` swap as shadow weights and
sleep do) must change the compiled tokens exactly as it changes eager ones:
the graph holds no stale weights. The same run under --async-scheduling (two
steps in flight, each result taken after the next step was planned) gives the
same tokens, every decode step in the graph, and no recompile.

Mirrors vLLM's habit of compiling decode at fixed batch sizes and padding a
batch to the next one (vllm/config/compilation.py `cudagraph_capture_sizes`,
vllm/v1/worker/gpu_model_runner.py pads num_input_tokens to the next size).
"""

from __future__ import annotations

import time

import attrs
import numpy as np
import pytest
import torch

from support.oracles import hf_greedy, transformers_model
from trillium.actors.executor.compiled_decode import CompiledDecode
from trillium.actors.executor.core import ExecutorCore
from trillium.actors.protocol.requests import AddRequest
from trillium.actors.scheduler.core import build_scheduler
from trillium.config import EngineConfig
from trillium.sampling_params import SamplingParams

PROMPTS = {"a": [5, 9, 13, 2, 7], "b": list(range(10, 40)), "c": [3] * 21}
MAX_TOKENS = {"a": 8, "b": 6, "c": 4}  # finish at different steps: decode batches of 3, 2, 1


def _config(path, enforce_eager: bool) -> EngineConfig:
    return EngineConfig(model=str(path), kv_cache_memory="4MiB", enforce_eager=enforce_eager,
                        compile_batch_sizes=(4,)).resolve()


@pytest.fixture(scope="module")
def cores(checkpoint):
    path = checkpoint("llama")
    torch.set_num_threads(1)
    return ExecutorCore(_config(path, False)), ExecutorCore(_config(path, True)), path


def _greedy(core: ExecutorCore, async_scheduling: bool = False, ahead: list | None = None) -> dict[str, list[int]]:
    scheduler = build_scheduler(attrs.evolve(core.config, async_scheduling=async_scheduling))
    for rid, prompt in PROMPTS.items():
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS[rid], ignore_eos=True)
        scheduler.add_request(AddRequest(request_id=rid, prompt_token_ids=np.array(prompt, np.int32),
                                         sampling=params, eos_token_ids=(2,), arrival_time=time.time()))
    out: dict[str, list[int]] = {rid: [] for rid in PROMPTS}
    in_flight = []  # results not taken yet, oldest first (--async-scheduling: up to two)
    while scheduler.has_work() or in_flight:
        while not in_flight or scheduler.may_schedule_ahead:
            batch = scheduler.schedule()
            if batch is None:
                break
            if in_flight and ahead is not None:
                ahead.append(batch.step_id)  # planned while the previous step was out
            in_flight.append(core.execute(batch))  # the executor runs batches in the order sent
        if not in_flight:
            break
        for delta in scheduler.update_from_output(in_flight.pop(0)).deltas:
            out[delta.request_id].extend(delta.new_token_ids)
    return out


def test_compiled_greedy_matches_eager_and_transformers_then_follows_weight_updates(cores):
    from torch._dynamo.utils import counters  # WHY here: importing dynamo at collection costs every run

    compiled, eager, path = cores
    assert isinstance(compiled.forward, CompiledDecode) and not isinstance(eager.forward, CompiledDecode)
    assert compiled.forward.compile_s.keys() == {4}
    graphs = counters["stats"]["unique_graphs"]  # compiled at start; nothing recompiles after
    before = _greedy(compiled)
    assert compiled.forward.num_compiled_steps >= 7  # every decode step of the run (3, 2, 2, 1, 1, 1, 1 rows)
    assert before == _greedy(eager)
    # --async-scheduling: the step planned ahead feeds the token the executor has just sampled
    # into the same graphs (same padded buffers, dtypes, bucket); no recompile, no eager fallback.
    steps = compiled.forward.num_compiled_steps
    ahead: list[int] = []
    assert _greedy(compiled, async_scheduling=True, ahead=ahead) == before
    assert len(ahead) >= 5  # the decode steps did go out two at a time
    assert compiled.forward.num_compiled_steps >= steps + 7
    hf = transformers_model(path)
    for rid, prompt in PROMPTS.items():
        assert before[rid] == hf_greedy(hf, prompt, MAX_TOKENS[rid])[0]

    # A live update (load_weights copies in place) and a storage swap (param.data =, as shadow weights do).
    steps = compiled.forward.num_compiled_steps
    generator = torch.Generator().manual_seed(1)
    for core in (compiled, eager):
        params = dict(core.model.named_parameters())
        down = params["model.layers.0.mlp.down_proj.weight"]
        core.model.load_weights([("model.layers.0.mlp.down_proj.weight", down * -3.0)])
        gate_up = params["model.layers.1.mlp.gate_up_proj.weight"]
        gate_up.data = gate_up.data + torch.randn(gate_up.shape, generator=generator.manual_seed(1)) * 0.5
    after = _greedy(compiled)
    assert compiled.forward.num_compiled_steps > steps  # still compiled, not an eager fallback
    assert after != before
    assert after == _greedy(eager)
    assert counters["stats"]["unique_graphs"] == graphs

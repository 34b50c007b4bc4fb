"""Builders for the scheduler's pure loop: a tiny core, its EngineControl
and SchedulerLoop, and a fake executor step.

`build_loop()` -> SchedulerLoop over a 64-block, block-size-4 core (no
model, no trio). `fake_result(core, batch)` is the BatchResult a model
would return: token `token` for every request due to sample, -1 for a
prefill chunk short of its prompt's end.
"""

from __future__ import annotations

import numpy as np

from trillium.actors.protocol.execute import BatchResult, ExecuteBatch
from trillium.actors.protocol.requests import AddRequest
from trillium.actors.scheduler.control import EngineControl
from trillium.actors.scheduler.core import Scheduler, SchedulerConfig
from trillium.actors.scheduler.loop import SchedulerLoop
from trillium.config import EngineConfig
from trillium.observability.profiling import LoopProfiler
from trillium.sampling_params import SamplingParams

NUM_BLOCKS, BLOCK_SIZE, MAX_MODEL_LEN = 64, 4, 128
PARAMS = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


def small_engine_config(**overrides) -> EngineConfig:
    """An EngineConfig the scheduler can run on (sizes set; the model is never read)."""
    args = dict(model="/models/m", num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN)
    return EngineConfig(**{**args, **overrides})


def build_loop(**config) -> SchedulerLoop:
    """`config`: more SchedulerConfig fields (e.g. async_scheduling=True)."""
    core = Scheduler(SchedulerConfig(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN,
                                     **config))
    return SchedulerLoop(core, EngineControl(core, small_engine_config(), LoopProfiler("scheduler")))


def add_request(rid: str, prompt=(1, 2, 3, 4, 5), params=PARAMS) -> AddRequest:
    return AddRequest(rid, np.asarray(prompt, np.int32), params, (), arrival_time=0.0)


def fake_result(core: Scheduler, batch: ExecuteBatch, token: int = 9) -> BatchResult:
    ids = [n.request_id for n in batch.new_requests] + list(batch.cached.request_ids)
    tokens = []
    for rid in ids:
        request = core.get_request(rid)
        due = request is not None and request.num_computed_tokens >= request.num_tokens
        tokens.append(token if due else -1)
    return BatchResult(batch.step_id, tuple(ids), np.asarray(tokens, np.int32))

"""The executor actor alone in a nursery over inproc://, its scheduler faked.

The test plays the scheduler with a real scheduler core (it builds the
ExecuteBatch messages and reads the BatchResults back) through an inbox
bound with the real transport and codec (support/fake_peers.py), on the
tiny synthetic checkpoint; HF transformers is the oracle for the tokens.
"""

from __future__ import annotations

import attrs
import numpy as np
import pytest
import trio

from trillium.actors.executor import actor as executor
from trillium.actors.protocol.execute import BatchResult, CachedRequests, ExecutorFailed
from trillium.actors.protocol.admin import ControlReply, StopProfile
from trillium.actors.protocol.requests import AddRequest
from trillium.actors.scheduler.core import build_scheduler
from trillium.config import EngineConfig
from trillium.sampling_params import SamplingParams

from support.fake_peers import FakePeers, assert_shutdown_ends, inproc_config, run_alone
from support.oracles import hf_greedy, transformers_model

PROMPT = [5, 6, 7, 8, 9, 10]
MAX_TOKENS = 6


@pytest.fixture
def config(checkpoint):
    engine = EngineConfig(model=str(checkpoint("llama")), kv_cache_memory="8MiB", num_threads=1)
    return inproc_config(engine.resolve())


def greedy_request(rid: str) -> AddRequest:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return AddRequest(rid, np.asarray(PROMPT, np.int32), params, (), arrival_time=0.0)


async def test_steps_sample_what_transformers_samples(config):
    core = build_scheduler(config.engine)
    core.add_request(greedy_request("a"))
    tokens = []
    async with run_alone(executor.run, config, "executor") as peers:
        while (batch := core.schedule()) is not None:
            await peers.send(batch)
            result = await peers.receive("scheduler")
            assert isinstance(result, BatchResult) and result.step_id == batch.step_id
            for delta in core.update_from_output(result).deltas:
                tokens += delta.new_token_ids
    expected, _ = hf_greedy(transformers_model(config.engine.model), PROMPT, MAX_TOKENS)
    assert tokens == expected


async def test_a_command_gets_its_reply_and_the_executor_goes_on(config):
    core = build_scheduler(config.engine)
    core.add_request(greedy_request("a"))
    async with run_alone(executor.run, config, "executor") as peers:
        await peers.send(StopProfile("s@executor"))
        reply = await peers.receive("scheduler")
        assert isinstance(reply, ControlReply) and reply.command_id == "s@executor" and reply.status == 409
        batch = core.schedule()
        await peers.send(batch)
        assert (await peers.receive("scheduler")).step_id == batch.step_id


async def test_a_failed_step_is_reported_then_raised(config):
    core = build_scheduler(config.engine)
    core.add_request(greedy_request("a"))
    first = core.schedule()
    # A step for a request the executor never heard of: it cannot run.
    ghost = CachedRequests(request_ids=("ghost",), num_computed_tokens=np.zeros(1, np.int32),
                           new_block_offsets=np.zeros(2, np.int32))
    broken = attrs.evolve(first, new_requests=(), cached=ghost)
    peers = FakePeers(config, "executor")
    received = []
    try:
        with pytest.raises(BaseExceptionGroup) as info:
            with trio.fail_after(60):
                async with trio.open_nursery() as nursery:
                    await nursery.start(executor.run, config.to_bytes())
                    await peers.send(broken)
                    received.append(await peers.receive("scheduler"))
                    await trio.sleep_forever()  # until the actor raises
    finally:
        peers.close()
    (failed,) = received
    assert isinstance(failed, ExecutorFailed) and failed.step_id == broken.step_id
    (raised,) = _leaves(info.value)
    assert failed.error.startswith(type(raised).__name__), "the error the actor raised is the one reported"


def _leaves(group: BaseException) -> list[BaseException]:
    if isinstance(group, BaseExceptionGroup):
        return [leaf for inner in group.exceptions for leaf in _leaves(inner)]
    return [group]


async def test_shutdown_ends_the_actor(config):
    await assert_shutdown_ends(executor.run, config, "executor", timeout_s=60)

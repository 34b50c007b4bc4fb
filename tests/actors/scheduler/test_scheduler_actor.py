"""The scheduler actor alone in a nursery over inproc://, its peers faked.

The test binds the executor's, detokenizer's and api's inboxes with the real
transport and codec (support/fake_peers.py) and plays them: it sends
AddRequest and commands as the api, answers ExecuteBatch with BatchResult
as the executor, and reads the TokenDeltas, stats and replies. The profile
deadline runs on trio's MockClock (autojump), no real waiting.
"""

from __future__ import annotations

import os

import pytest
import trio

from trillium.actors.protocol.execute import ExecuteBatch, ExecutorFailed
from trillium.actors.protocol.admin import ControlReply, GetEngineInfo, StartProfile, StopProfile
from trillium.actors.protocol.outputs import SchedulerStats, TokenDeltas
from trillium.actors.scheduler import actor as scheduler
from trillium.actors.scheduler.core import build_scheduler
from trillium.actors.scheduler.loop import EngineStopped

from support.fake_peers import FakePeers, assert_shutdown_ends, inproc_config, run_alone
from support.scheduler_loop import add_request, fake_result, small_engine_config


@pytest.fixture
def config():
    return inproc_config(small_engine_config())


async def test_a_request_runs_to_its_length_limit_over_the_fake_executor(config):
    # The fake executor keeps its own copy of the core's bookkeeping, to know who is due.
    shadow = build_scheduler(config.engine)
    async with run_alone(scheduler.run, config, "scheduler") as peers:
        await peers.send(add_request("a"))
        shadow.add_request(add_request("a"))
        tokens, finish_reason = [], None
        while finish_reason is None:
            batch = await peers.receive("executor")
            assert isinstance(batch, ExecuteBatch)
            assert shadow.schedule().step_id == batch.step_id
            result = fake_result(shadow, batch)
            shadow.update_from_output(result)
            await peers.send(result)
            deltas = await peers.receive("detokenizer")
            assert isinstance(deltas, TokenDeltas) and deltas.step_id == batch.step_id
            (delta,) = deltas.deltas
            tokens += delta.new_token_ids
            finish_reason = delta.finish_reason
        assert tokens == [9, 9, 9] and finish_reason == "length"
        # Stats follow every step's deltas; the last ones show the request gone.
        stats = await peers.receive("api")
        while not (stats.step_id == 3 and stats.num_running == 0):
            stats, _ = await peers.receive_type("api", SchedulerStats)
        assert stats.num_waiting == 0 and stats.num_free_blocks == 64


async def test_a_command_is_answered_after_fresh_stats(config):
    async with run_alone(scheduler.run, config, "scheduler") as peers:
        await peers.send(add_request("a"))
        await peers.receive("executor")  # step 0 in flight, never answered
        await peers.send(GetEngineInfo("i"))
        reply, before = await peers.receive_type("api", ControlReply)
        assert reply.command_id == "i" and reply.data["num_running"] == 1
        assert isinstance(before[-1], SchedulerStats) and before[-1].num_running == 1


async def test_shutdown_ends_the_actor(config):
    await assert_shutdown_ends(scheduler.run, config, "scheduler", timeout_s=30)


async def test_executor_failed_stops_the_engine(config):
    peers = FakePeers(config, "scheduler")
    try:
        with pytest.raises(BaseExceptionGroup) as info:
            with trio.fail_after(10):
                async with trio.open_nursery() as nursery:
                    await nursery.start(scheduler.run, config.to_bytes())
                    await peers.send(add_request("a"))
                    batch = await peers.receive("executor")
                    await peers.send(ExecutorFailed(step_id=batch.step_id, error="boom"))
        assert info.value.subgroup(EngineStopped) is not None
    finally:
        peers.close()


async def test_the_profile_deadline_expires_on_trios_clock(config, autojump_clock, tmp_path):
    async with run_alone(scheduler.run, config, "scheduler") as peers:
        start = trio.current_time()
        await peers.send(StartProfile("p", profile_dir=str(tmp_path), actors=("scheduler",), max_duration_s=5))
        reply, _ = await peers.receive_type("api", ControlReply)
        assert reply.ok and os.listdir(tmp_path) == []
        await trio.sleep_until(start + 4)
        assert os.listdir(tmp_path) == [], "still profiling"
        await trio.sleep_until(start + 6)
        written = sorted(os.listdir(tmp_path))
        assert any(name.endswith(".trace.json") for name in written), "expired: the files are written"
        await peers.send(StopProfile("s"))
        reply, _ = await peers.receive_type("api", ControlReply)
        assert reply.ok and sorted(os.path.basename(f) for f in reply.data["files"]) == written

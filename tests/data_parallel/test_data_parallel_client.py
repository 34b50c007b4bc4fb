"""`ReplicaClient` over two scripted replicas (no processes): ownership, fan-out, the split-update rule.

The replicas are `Replica` objects with EngineClient's surface whose
control replies the test scripts: a request id is unique across replicas
and its abort reaches its owner only; stats aggregate into one view (the
first non-serving state, the versions joined when they differ); a weight
update that one replica refuses pauses both and `Resume` is then a 409
until the versions agree; a LoRA load that one replica refuses is unloaded
from the other; a failed replica is out of routing and of the fan-out; the
update group's init reaches each replica with its own rank offset.
"""

from __future__ import annotations

import attrs
import pytest

from trillium.actors.assembly import ActorConfig, Addresses
from trillium.actors.protocol import admin as cmd
from trillium.actors.protocol.admin import ControlReply
from trillium.actors.protocol.outputs import RequestOutputDelta, SchedulerStats
from trillium.actors.protocol.vocabulary import EngineState
from trillium.data_parallel.client import ReplicaClient
from trillium.config import EngineConfig
from trillium.data_parallel.router import ReplicaRouter
from trillium.sampling_params import SamplingParams


class Replica:
    def __init__(self, index: int, tensor_parallel_size: int = 1) -> None:
        self.index = index
        self.config = ActorConfig(EngineConfig(model="m", tensor_parallel_size=tensor_parallel_size),
                                  Addresses.inproc())
        self.stats_listeners: list = []
        self.finish_listeners: list = []
        self.last_stats = None
        self.version = "0"
        self.commands: list = []
        self.aborted: list = []
        self.refuse: tuple = ()  # command classes this replica answers 400
        self.streams: list[str] = []

    def stats(self, state=EngineState.SERVING, **fields) -> None:
        self.last_stats = SchedulerStats(step_id=1, num_running=1, num_waiting=0, num_preempted_total=0,
                                         kv_usage=0.5, num_free_blocks=10, prefix_cache_queries_total=0,
                                         prefix_cache_hits_total=0, num_scheduled_tokens=0, engine_state=state,
                                         weight_version=self.version, **fields)
        for listener in self.stats_listeners:
            listener(self.last_stats)

    async def generate(self, request_id, prompt, params, eos, **kwargs):
        self.streams.append(request_id)
        return [request_id]

    async def abort(self, ids) -> None:
        self.aborted += ids

    async def control(self, command, timeout_s):
        self.commands.append(command)
        if isinstance(command, self.refuse):
            return ControlReply(command.command_id, 400, f"replica {self.index} refuses",
                                {"weight_version": self.version})
        if isinstance(command, cmd.UpdateWeightsFromDisk):
            self.version = command.weight_version
        state = "paused" if isinstance(command, cmd.Pause) else "serving"
        self.stats()
        return ControlReply(command.command_id, 200, "", {"state": state, "weight_version": self.version})

    def fail_all(self, reason, *, commands=False):
        ids, self.streams = self.streams, []
        return ids

    def finish(self, request_id: str) -> None:
        delta = RequestOutputDelta(request_id=request_id, text="", new_token_ids=(), finished=True,
                                   finish_reason="stop")
        for listener in self.finish_listeners:
            listener(delta)


def make(tensor_parallel_size: int = 1) -> tuple[ReplicaClient, list[Replica]]:
    replicas = [Replica(0, tensor_parallel_size), Replica(1, tensor_parallel_size)]
    return ReplicaClient(replicas, ReplicaRouter(2, 4, 100)), replicas


GREEDY = SamplingParams(temperature=0.0, max_tokens=4)


async def test_ids_are_unique_across_replicas_and_aborts_reach_the_owner():
    client, replicas = make()
    await client.generate("a", [1, 2], GREEDY, ())
    await client.generate("b", [3, 4], GREEDY, ())
    assert [r.streams for r in replicas] == [["a"], ["b"]]
    with pytest.raises(ValueError, match="already in use"):
        await client.generate("a", [5], GREEDY, ())
    await client.abort(["b"])
    assert replicas[0].aborted == [] and replicas[1].aborted == ["b"]
    replicas[0].finish("a")
    assert client.active_request_ids() == ["b"] and client.router.pending_tokens == [0, 6]


async def test_stats_aggregate_into_one_engine_view():
    client, replicas = make()
    replicas[0].stats()
    replicas[1].version = "v2"
    replicas[1].stats(state=EngineState.SLEEPING)
    stats = client.last_stats
    assert stats.num_running == 2 and stats.num_free_blocks == 20 and stats.kv_usage == 0.5
    assert stats.engine_state == EngineState.SLEEPING and stats.weight_version == "0|v2"


async def test_a_split_weight_update_pauses_every_replica_and_resume_waits():
    client, replicas = make()
    replicas[1].refuse = (cmd.UpdateWeightsFromDisk,)
    reply = await client.control(cmd.UpdateWeightsFromDisk("u", "/m", weight_version="v2"))
    assert reply.status == 400 and reply.data["state"] == "paused"
    assert "replica 0: 'v2', replica 1: '0'" in reply.message
    assert all(isinstance(r.commands[-1], cmd.Pause) and r.commands[-1].mode == "keep" for r in replicas)
    resume = await client.control(cmd.Resume("r"))
    assert resume.status == 409 and not any(isinstance(c, cmd.Resume) for r in replicas for c in r.commands)
    replicas[1].refuse = ()
    assert (await client.control(cmd.UpdateWeightsFromDisk("u2", "/m", weight_version="v2"))).ok
    assert (await client.control(cmd.Resume("r2"))).ok


async def test_a_lora_load_one_replica_refuses_is_undone_on_the_other():
    client, replicas = make()
    replicas[0].refuse = (cmd.LoadLoRAAdapter,)
    reply = await client.control(cmd.LoadLoRAAdapter("l", 1, "a", "/a"))
    assert reply.status == 400 and reply.message == "replica 0: replica 0 refuses; replica 1: ok"
    assert isinstance(replicas[1].commands[-1], cmd.UnloadLoRAAdapter)


async def test_a_failed_replica_is_out_of_routing_and_fan_out():
    client, replicas = make()
    await client.generate("a", [1], GREEDY, ())
    assert client.replica_failed(0, "replica 0: engine actor 'executor' failed") == ["a"]
    assert client.num_active_requests == 0
    await client.generate("b", [1], GREEDY, ())
    await client.generate("c", [2], GREEDY, ())
    assert replicas[1].streams == ["b", "c"]
    await client.control(cmd.ResetPrefixCache("p"))
    assert replicas[0].commands == [] and len(replicas[1].commands) == 1
    client.replica_failed(1, "gone")
    assert (await client.control(cmd.ResetPrefixCache("q"))).status == 503
    with pytest.raises(Exception, match="no replica is serving"):
        await client.generate("d", [1], GREEDY, ())


async def test_the_update_group_gives_each_replica_its_ranks():
    """2 replicas x 2 ranks, world_size 5 (slime's layout): replica i from rank_offset 1 + 2i."""
    client, replicas = make(tensor_parallel_size=2)
    reply = await client.control(cmd.InitWeightsUpdateGroup("g", "127.0.0.1", 29500, rank_offset=1, world_size=5))
    assert reply.ok and [r.commands[-1].rank_offset for r in replicas] == [1, 3]
    small = await client.control(cmd.InitWeightsUpdateGroup("h", "127.0.0.1", 29500, rank_offset=1, world_size=4))
    assert small.status == 400 and len(replicas[0].commands) == 1  # refused before reaching any replica


def test_aggregate_keeps_the_events_out():
    client, replicas = make()
    replicas[0].stats(num_prompt_tokens=5)
    assert client.last_stats.num_prompt_tokens == 0  # events reach listeners per replica, never twice
    seen = []
    client.stats_listeners.append(seen.append)
    replicas[1].stats(num_prompt_tokens=3)
    assert [s.num_prompt_tokens for s in seen] == [3]
    assert attrs.has(type(client.last_stats))


"""The data-parallel routing rule and the control-reply merge, driven directly (pure, no processes).

Router: requests with no shared prefix spread by load (ties alternate); a
prompt that extends an earlier one goes where that one went while the
load gap is within the prefix it saves, and to the least-loaded replica
beyond that; the KV usage of a replica's stats counts as load; a replica
out of `live` is never chosen. Merge: every replica's data is listed, the
first failure's status wins and the message names each replica;
StartProfile gets a directory per replica; the update group's rank offsets
per replica (and a world_size too small for them is refused).
replica_configs gives each replica its own 0700 ipc dir, link secret,
device and a share of the cores.
"""

from __future__ import annotations

import numpy as np
import pytest

from trillium.actors.protocol import admin as cmd
from trillium.actors.protocol.admin import ControlReply
from trillium.data_parallel import control
from trillium.data_parallel.router import ReplicaRouter

BLOCK = 4


def router(num: int = 2, kv_tokens: int = 1000) -> ReplicaRouter:
    return ReplicaRouter(num, BLOCK, kv_tokens)


def send(r: ReplicaRouter, prompt, tokens: int | None = None, salt=None) -> int:
    replica, hashes = r.choose(prompt, salt)
    r.remember(hashes, replica)
    r.started(replica, len(prompt) if tokens is None else tokens)
    return replica


def test_distinct_prompts_alternate_then_follow_load():
    r = router()
    assert [send(r, [i] * 8) for i in range(4)] == [0, 1, 0, 1]
    r.finished(1, 8)
    r.finished(1, 8)
    assert send(r, [9] * 8) == 1  # replica 1 has no pending work left


def test_a_conversation_sticks_to_its_replica_within_the_saving():
    r = router()
    turn1 = list(range(10, 22))  # 3 full blocks
    first = send(r, turn1)
    other = 1 - first
    turn2 = turn1 + [5, 6, 7, 8, 9]
    assert r.affinity(r.prefix_hashes(turn2), [0, 1]) == (first, 12)
    assert send(r, turn2, tokens=0) == first  # load gap 12 <= the 12 tokens of cached prefix
    r.started(first, 100)  # far more loaded than the prefix is worth
    assert send(r, turn2 + [1] * 4) == other


def test_salt_and_partial_blocks_do_not_match():
    r = router()
    prompt = list(range(30, 38))
    first = send(r, prompt, tokens=0, salt=(1, None))
    assert r.affinity(r.prefix_hashes(prompt, (0, None)), [0, 1]) == (None, 0)
    assert r.prefix_hashes(prompt[:3]) == []  # under one block: nothing to share
    assert r.affinity(r.prefix_hashes(prompt, (1, None)), [0, 1]) == (first, 8)


def test_kv_usage_counts_as_load_and_dead_replicas_are_skipped():
    r = router(kv_tokens=1000)
    r.observe_kv_usage(0, 0.5)  # 500 tokens held
    assert send(r, np.arange(8)) == 1
    assert r.choose([1, 2, 3], live=[0])[0] == 0
    with pytest.raises(ValueError, match="no replica"):
        r.choose([1], live=[])


def test_merge_lists_replicas_and_names_failures():
    ok = ControlReply("c", 200, "", {"state": "serving", "weight_version": "2", "files": ["a"]})
    bad = ControlReply("c", 400, "cannot read", {"state": "serving", "weight_version": "1"})
    merged = control.merge(cmd.StopProfile("c"), {0: ok, 1: ok})
    assert merged.ok and merged.data["files"] == ["a", "a"] and len(merged.data["replicas"]) == 2
    failed = control.merge(cmd.UpdateWeightsFromDisk("c", "/x"), {0: ok, 1: bad})
    assert failed.status == 400 and failed.message == "replica 0: ok; replica 1: cannot read"
    assert control.versions_of({0: ok, 1: bad}) == {0: "2", 1: "1"}
    split = control.split_update_message(failed, {0: "2", 1: "1"})
    assert split.data["state"] == "paused" and "replica 0: '2', replica 1: '1'" in split.message


def test_per_replica_commands_refusals_and_resume_guard():
    start = control.per_replica(cmd.StartProfile("c", profile_dir="/p"), 1)
    assert start.profile_dir == "/p/replica-1"
    refused = control.refusal(cmd.InitWeightsUpdateGroup("c", "127.0.0.1", 1, 1, 2), 2, 1, {})
    assert refused.status == 400 and "--data-parallel-size 2" in refused.message
    assert "ranks 1..2 join; the trainer's world_size is 3" in refused.message
    # slime's layout for N engines of T ranks: replica i's ranks from rank_offset + i * T, world 1 + N * T
    init = cmd.InitWeightsUpdateGroup("c", "127.0.0.1", 1, rank_offset=1, world_size=5)
    assert control.refusal(init, 2, 2, {}) is None
    assert [control.per_replica(init, i, 2).rank_offset for i in (0, 1)] == [1, 3]
    assert control.refusal(init, 2, 2, {1: "executor died"}).status == 503
    assert control.refusal(cmd.Resume("c"), 2, 1, {}) is None
    assert control.version_conflict(cmd.Resume("c"), {0: "1", 1: "2"}).status == 409
    assert control.version_conflict(cmd.Resume("c"), {0: "2", 1: "2"}) is None


def test_replica_configs_own_sockets_secrets_devices_and_cores(tmp_path):
    from trillium.config import EngineConfig
    from trillium.data_parallel.processes import replica_configs, replica_device

    assert [replica_device(d, 1) for d in ("cuda", "cuda:2", "cpu")] == ["cuda:1", "cuda:3", "cpu"]
    configs = replica_configs(EngineConfig(model="m", num_threads=0), str(tmp_path), 2)
    assert configs[0].addresses.scheduler == f"ipc://{tmp_path}/r0/scheduler"
    assert configs[1].addresses.api == f"ipc://{tmp_path}/r1/api"
    assert configs[0].link_secret != configs[1].link_secret
    assert all(c.engine.num_threads >= 1 for c in configs)
    assert (tmp_path / "r1").stat().st_mode & 0o777 == 0o700


def test_replicas_of_a_tensor_parallel_engine_have_their_own_ranks(tmp_path):
    """--data-parallel-size 2 --tensor-parallel-size 2: each replica's executor and executor-rank1 share
    that replica's store port, devices and link secret, and no other replica's (vLLM's DP x TP layout:
    replica i on devices i*tp .. i*tp + tp - 1)."""
    import os

    from trillium.actors.assembly import ActorConfig, engine_specs
    from trillium.config import EngineConfig
    from trillium.data_parallel.processes import replica_configs

    engine = EngineConfig(model="m", tensor_parallel_size=2, device="cuda")
    configs = replica_configs(engine, str(tmp_path), 2)
    assert [c.engine.device for c in configs] == ["cuda:0", "cuda:2"]
    ports = [c.engine.tp_master_port for c in configs]
    assert 0 not in ports and ports[0] != ports[1]
    for config in configs:
        specs = {s.name: ActorConfig.from_bytes(s.config) for s in engine_specs(config)}
        assert list(specs) == ["executor", "executor-rank1", "detokenizer", "scheduler"]
        assert [specs[n].tp_rank for n in ("executor", "executor-rank1")] == [0, 1]
        assert {s.engine.tp_master_port for s in specs.values()} == {config.engine.tp_master_port}
        assert {s.link_secret for s in specs.values()} == {config.link_secret}
    (tmp_path / "cpu").mkdir()
    cpu = replica_configs(EngineConfig(model="m", tensor_parallel_size=2), str(tmp_path / "cpu"), 2)
    assert all(c.engine.num_threads == max(1, (os.cpu_count() or 1) // 4) for c in cpu)  # 4 ranks share the cores

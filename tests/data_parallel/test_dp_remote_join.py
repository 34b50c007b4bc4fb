"""The api host's join socket for data-parallel replicas on other hosts (data_parallel/remote.py), in process.

A headless host's Hello (signed with the deployment secret) joins its replicas; a Hello signed with
another secret, without a proof, replayed, announcing another engine config or a replica outside the
expected range, naming another api inbox than the api host's layout, or arriving after the join
joins nothing and is counted by reason. The shape mirrors vLLM's handshake on the rpc port
(vllm-project/vllm, vllm/v1/engine/utils.py `wait_for_engine_startup`: every engine checks in
before the api serves), which here is authenticated.
"""

from __future__ import annotations

import os

import trio

from support.serve_process import free_port
from trillium.config import EngineConfig
from trillium.data_parallel import remote

SECRET = os.urandom(32).hex()


def _addresses(replica: int, rpc_port: int):
    return remote.headless_addresses("127.0.0.1", "127.0.0.1", rpc_port, replica)


async def test_only_a_signed_hello_with_the_same_config_joins():
    port = free_port()
    engine = EngineConfig(model="/m")
    fingerprint = remote.fingerprint_of(engine)
    listener = remote.JoinListener("127.0.0.1", port, SECRET, range(1, 3), fingerprint)
    other = remote.fingerprint_of(EngineConfig(model="/m", max_num_seqs=3))
    announced = {1: _addresses(1, port), 2: _addresses(2, port)}
    good = remote.hello_frames(SECRET, fingerprint, announced, {1: {"scheduler": 7}})
    sent = [
        remote.hello_frames(os.urandom(32).hex(), fingerprint, {1: _addresses(1, port)}, {}),  # another secret
        [b"no proof", b"{}"],
        remote.hello_frames(SECRET, other, {1: _addresses(1, port)}, {}),  # another engine config
        remote.hello_frames(SECRET, fingerprint, {5: _addresses(5, port)}, {}),  # not a remote replica here
        remote.hello_frames(SECRET, fingerprint, {1: _addresses(1, port + 7)}, {}),  # another api inbox
        good,
        good,  # replayed
    ]
    outbox = await remote.send_hello("127.0.0.1", port, sent[0])
    try:
        for frames in sent[1:]:
            await outbox.send_frames(frames)
        with trio.fail_after(20):
            joined = await listener.wait_joined()
        assert sorted(joined) == [1, 2] and joined[1]["pids"] == {"scheduler": 7}
        assert {i: joined[i]["addresses"] for i in joined} == announced
        assert joined[1]["peer"] == "127.0.0.1"
        assert joined[1]["addresses"].api == f"tcp://127.0.0.1:{port + 1}"
        late = remote.hello_frames(SECRET, fingerprint, {1: _addresses(1, port)}, {})
        await outbox.send_frames(late)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(listener.count_strangers)
            with trio.fail_after(20):
                while listener.rejected.get("replayed", 0) < 1 or listener.rejected.get("forbidden", 0) < 4:
                    await trio.sleep(0.05)
            nursery.cancel_scope.cancel()
        assert listener.rejected == {"unauthenticated": 2, "forbidden": 4, "replayed": 1}
        assert listener.rejected_frames() == {remote.JOIN_ACTOR: listener.rejected}
    finally:
        outbox.close()
        listener.close()


def test_each_replica_has_its_own_secret():
    secrets = {remote.replica_secret(SECRET, i) for i in range(4)}
    assert len(secrets) == 4 and SECRET not in secrets
    assert remote.replica_secret(SECRET, 1) == remote.replica_secret(SECRET, 1)


async def test_the_link_watch_sees_the_peer_come_and_go():
    """What fails a remote replica on the api host, and stops a headless host when the api host goes."""
    from trillium.actors.codec import Codec
    from trillium.actors.transport import Inbox

    address = f"tcp://127.0.0.1:{free_port()}"
    with remote.LinkWatch(address) as watch:
        inbox = Inbox.bind(address, Codec([]))
        with trio.fail_after(20):
            await watch.wait_connected()
        inbox.close()
        with trio.fail_after(20):
            await watch.wait_lost()

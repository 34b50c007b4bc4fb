"""An engine mailbox on tcp:// refuses a peer without the deployment's secret.

The same `Links` as every engine process, with tcp://127.0.0.1 addresses (what a
link between hosts would use), and a raw ZeroMQ PUSH client as the stranger: it
sends garbage, a well-formed message without a proof, one signed under another
secret, and a replay of a captured valid frame. Only the signed message (and the
captured one's first copy) reaches the actor; the mailbox keeps serving and reports
each drop by reason to the api. (tests/reliability/test_engine_sockets.py does the
same against a live server's ipc:// sockets.)
"""

from __future__ import annotations

import pytest
import trio
import zmq

from support.serve_process import free_port
from trillium.actors.assembly import ActorConfig, Addresses, engine_codec
from trillium.actors.link_auth import LinkKey, Signer
from trillium.actors.links import Links
from trillium.actors.protocol.rejections import FramesRejected
from trillium.actors.protocol.requests import AbortRequest
from trillium.config import EngineConfig

CODEC = engine_codec()


@pytest.fixture
def tcp_config():
    addresses = Addresses(*(f"tcp://127.0.0.1:{free_port()}" for _ in range(4)))
    return ActorConfig(EngineConfig(model="/m"), addresses)


async def test_a_tcp_mailbox_drops_strangers_and_replays_and_keeps_serving(tcp_config):
    api = Links(tcp_config, "api")
    api_mailbox, scheduler_mailbox = api.mailbox(), Links(tcp_config, "scheduler").mailbox()
    to_scheduler = api.outbox("scheduler")
    captured = Signer(tcp_config.link_key(), "api").sign(CODEC.encode(AbortRequest(("captured",))))
    forged = Signer(LinkKey.generate(), "api").sign(CODEC.encode(AbortRequest(("forged",))))
    context = zmq.Context.instance()
    stranger = context.socket(zmq.PUSH)
    stranger.setsockopt(zmq.LINGER, 0)
    stranger.connect(tcp_config.addresses.scheduler)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(api_mailbox.pump)
            nursery.start_soon(scheduler_mailbox.pump)
            stranger.send_multipart([b"\x00\x01garbage", b"more"])
            stranger.send_multipart([bytes(f) for f in CODEC.encode(AbortRequest(("no-proof",)))])
            stranger.send_multipart([bytes(f) for f in forged])
            stranger.send_multipart([bytes(f) for f in captured])
            stranger.send_multipart([bytes(f) for f in captured])  # the replay
            await trio.sleep(0.5)  # WHY: the stranger's frames reach the inbox before the real one
            await to_scheduler.send(AbortRequest(("real",)))
            received, totals = [], {}
            with trio.fail_after(20):
                while len(received) < 2:
                    received.append((await scheduler_mailbox.receive()).request_ids)
                while sum(totals.values()) < 4:
                    report = await api_mailbox.receive()
                    if isinstance(report, FramesRejected) and report.actor == "scheduler":
                        totals = dict(report.totals)
            assert received == [("captured",), ("real",)]
            assert {reason: n for reason, n in totals.items() if n} == {"unauthenticated": 3, "replayed": 1}
            nursery.cancel_scope.cancel()
    finally:
        stranger.close()
        to_scheduler.close()

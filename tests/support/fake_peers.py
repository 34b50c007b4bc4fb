"""Fake peers for running one engine actor alone over inproc://.

`run_alone(run, config, actor)` starts the actor's real `run` in a nursery
and yields a `FakePeers`: the inboxes of every other actor (scheduler,
executor, detokenizer, api) bound with the real transport and the engine
codec, and an Outbox to the actor under test. The test plays those peers:
it sends what they would send and reads what the actor sends them. Both
ways the frames carry the run's link proof (actors/link_auth.py): each
message is signed as the role that sends that type to the actor
(protocol/senders.py), over one socket, so the order stays as sent; what
the actor sends is verified before it is decoded.

`inproc_config(engine)` is an ActorConfig with fresh inproc:// addresses.
"""

from __future__ import annotations

import contextlib

import trio

from trillium.actors.assembly import ActorConfig, Addresses, engine_codec
from trillium.actors.protocol.supervision import Shutdown
from trillium.actors.link_auth import Signer, Verifier
from trillium.actors.protocol.rejections import FramesRejected
from trillium.actors.protocol.senders import ROLES, sender_of
from trillium.actors.transport import Inbox, Outbox
from trillium.config import EngineConfig

ACTORS = ("scheduler", "executor", "detokenizer", "api")


def inproc_config(engine: EngineConfig) -> ActorConfig:
    return ActorConfig(engine, Addresses.inproc())


class FakePeers:
    def __init__(self, config: ActorConfig, actor: str) -> None:
        addresses = config.addresses
        self._codec = codec = engine_codec()
        self.actor = actor
        key = config.link_key()
        self._verifier = Verifier(key, ROLES)
        self._signers = {role: Signer(key, role) for role in ROLES}
        self.inboxes = {name: Inbox.bind(getattr(addresses, name), codec) for name in ACTORS if name != actor}
        self.to_actor = Outbox.connect(getattr(addresses, actor), codec)

    async def send(self, *messages) -> None:
        """Into the actor's inbox, in order (as one peer would send them)."""
        for message in messages:
            signer = self._signers[sender_of(self.actor, type(message))]
            await self.to_actor.send_frames(signer.sign(self._codec.encode(message)))

    def _decode(self, frames):
        return self._codec.decode(self._verifier.verify(frames)[1])

    async def _next(self, peer: str):
        """The next message to `peer`, skipping the actor's FramesRejected reports to the api."""
        while True:
            frames, _ = await self.inboxes[peer].receive_frames()
            message = self._decode(frames)
            if not isinstance(message, FramesRejected):
                return message

    async def receive(self, peer: str, timeout_s: float = 30.0):
        """The next message the actor sent to `peer`."""
        with trio.fail_after(timeout_s):
            return await self._next(peer)

    async def receive_type(self, peer: str, message_type, timeout_s: float = 30.0):
        """The next message of `message_type` sent to `peer`; returns (it, the others before it)."""
        skipped = []
        with trio.fail_after(timeout_s):
            while True:
                message = await self._next(peer)
                if isinstance(message, message_type):
                    return message, skipped
                skipped.append(message)

    def pending(self, peer: str) -> list:
        """What the actor has sent to `peer` and the test has not read yet."""
        messages = []
        while True:
            try:
                message = self._decode(self.inboxes[peer].receive_frames_nowait())
            except trio.WouldBlock:
                return messages
            if not isinstance(message, FramesRejected):
                messages.append(message)

    def close(self) -> None:
        self.to_actor.close()
        for inbox in self.inboxes.values():
            inbox.close()


@contextlib.asynccontextmanager
async def run_alone(run, config: ActorConfig, actor: str):
    """Run `actor`'s `run(config_bytes)` in a nursery, peers faked; cancelled on exit."""
    peers = FakePeers(config, actor)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(run, config.to_bytes())
            yield peers
            nursery.cancel_scope.cancel()
    finally:
        peers.close()


async def assert_shutdown_ends(run, config: ActorConfig, actor: str, timeout_s: float = 30.0) -> None:
    """Start `actor` alone, send it Shutdown: its `run` must return within `timeout_s`."""
    peers = FakePeers(config, actor)
    try:
        with trio.fail_after(timeout_s):
            async with trio.open_nursery() as nursery:
                await nursery.start(run, config.to_bytes())
                await peers.send(Shutdown())
    finally:
        peers.close()

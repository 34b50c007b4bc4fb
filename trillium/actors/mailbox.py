"""A bound inbox drained by a background task into a bounded trio channel.

WHY: an actor loop needs both `await receive()` and a non-blocking drain
(take every pending message before scheduling the next step). A reader task
moves decoded messages from the ZeroMQ inbox into a memory channel, whose
`receive_nowait` gives the drain; the channel bound gives back-pressure.

Every engine actor (scheduler, executor, detokenizer) reads through one, so
the deadline-aware receive (wake when a profile's time is up, with no
message) is written once: `receive(deadline=...)`, on trio's clock.

With a `PongSender` (actors/liveness.py) the pump answers `Ping`s itself,
so an actor busy awaiting a long step still answers: only a frozen process
or trio loop goes quiet.
"""

from __future__ import annotations

import math

import trio

from trillium.actors.codec import Codec
from trillium.actors.liveness import PongSender
from trillium.actors.protocol.supervision import Ping
from trillium.actors.transport import Inbox


class Mailbox:
    def __init__(self, inbox: Inbox, max_buffered: int = 4096, pongs: PongSender | None = None) -> None:
        self._inbox = inbox
        self._pongs = pongs
        self._send, self._receive = trio.open_memory_channel(max_buffered)

    @classmethod
    def bind(cls, address: str, codec: Codec, max_buffered: int = 4096,
             pongs: PongSender | None = None) -> "Mailbox":
        return cls(Inbox.bind(address, codec), max_buffered, pongs)

    async def pump(self) -> None:
        """Run in the actor's nursery: forward inbox messages forever (answering pings)."""
        try:
            while True:
                message = await self._inbox.receive()
                if self._pongs is not None and isinstance(message, Ping):
                    await self._pongs.answer(message)
                    continue
                await self._send.send(message)
        finally:
            self._inbox.close()
            if self._pongs is not None:
                self._pongs.close()

    @property
    def depth(self) -> int:
        """Decoded messages waiting to be received."""
        return self._receive.statistics().current_buffer_used

    async def receive(self, deadline: float = math.inf):
        """The next message; None if `deadline` (trio's clock) passes first."""
        with trio.move_on_at(deadline):
            return await self._receive.receive()
        return None

    def drain(self) -> list:
        messages = []
        while True:
            try:
                messages.append(self._receive.receive_nowait())
            except trio.WouldBlock:
                return messages

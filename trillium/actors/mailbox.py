"""A bound inbox drained by a background task into a bounded trio channel.

WHY: an actor loop needs both `await receive()` and a non-blocking drain
(take every pending message before scheduling the next step). A reader task
moves decoded messages from the ZeroMQ inbox into a memory channel, whose
`receive_nowait` gives the drain; the channel bound gives back-pressure.

Every engine actor (scheduler, executor, detokenizer) reads through one, so
the deadline-aware receive (wake when a profile's time is up, with no
message) is written once: `receive(deadline=...)`, on trio's clock.
"""

from __future__ import annotations

import math

import trio

from trillium.actors.codec import Codec
from trillium.actors.transport import Inbox


class Mailbox:
    def __init__(self, inbox: Inbox, max_buffered: int = 4096) -> None:
        self._inbox = inbox
        self._send, self._receive = trio.open_memory_channel(max_buffered)

    @classmethod
    def bind(cls, address: str, codec: Codec, max_buffered: int = 4096) -> "Mailbox":
        return cls(Inbox.bind(address, codec), max_buffered)

    async def pump(self) -> None:
        """Run in the actor's nursery: forward inbox messages forever."""
        try:
            while True:
                await self._send.send(await self._inbox.receive())
        finally:
            self._inbox.close()

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

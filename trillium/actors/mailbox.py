"""A bound inbox drained by a background task into a bounded trio channel.

WHY: an actor loop needs both `await receive()` and a non-blocking drain
(take every pending message before scheduling the next step). A reader task
moves messages from the ZeroMQ inbox into a memory channel, whose
`receive_nowait` gives the drain; the channel bound gives back-pressure.

Every engine actor (scheduler, executor, detokenizer) and the api read
through one, so two things are written once:

- the deadline-aware receive (wake when a profile's time is up, with no
  message): `receive(deadline=...)`, on trio's clock;
- the gate (`gate.py`): each received message passes the size cap, the link
  proof, the codec and the sender policy, or is dropped, counted and logged;
  a bad frame never reaches the actor and never stops the reader. With a
  `report_to` outbox (every actor but the api) the reader also sends the
  gate's counts to the api, at most once every `REPORT_INTERVAL_S` while
  they change;
- liveness: with a `PongSender` (actors/liveness.py) the pump answers an
  admitted `Ping` itself, so an actor busy awaiting a long step still
  answers: only a frozen process or trio loop goes quiet.

Build one with `links.Links.mailbox()`.
"""

from __future__ import annotations

import math

import trio

from trillium.actors.gate import Gate
from trillium.actors.liveness import PongSender
from trillium.actors.protocol.supervision import Ping
from trillium.actors.transport import Inbox, Outbox

REPORT_INTERVAL_S = 1.0


class Mailbox:
    def __init__(self, inbox: Inbox, gate: Gate, report_to: Outbox | None = None,
                 max_buffered: int = 4096, pongs: PongSender | None = None) -> None:
        self._inbox = inbox
        self.gate = gate
        self._report_to = report_to
        self._pongs = pongs
        self._send, self._receive = trio.open_memory_channel(max_buffered)

    async def pump(self) -> None:
        """Run in the actor's nursery: forward admitted inbox messages forever (answering pings)."""
        try:
            async with trio.open_nursery() as nursery:
                if self._report_to is not None:
                    nursery.start_soon(self._report_rejections)
                while True:
                    frames, peer = await self._inbox.receive_frames()
                    message = self.gate.admit(frames, peer)
                    if message is None:
                        continue
                    if self._pongs is not None and isinstance(message, Ping):
                        await self._pongs.answer(message)
                        continue
                    await self._send.send(message)
        finally:
            self._inbox.close()
            if self._report_to is not None:
                self._report_to.close()
            if self._pongs is not None:
                self._pongs.close()

    async def _report_rejections(self) -> None:
        reported = 0
        while True:
            await trio.sleep(REPORT_INTERVAL_S)
            if self.gate.num_rejected != reported:
                reported = self.gate.num_rejected
                await self._report_to.send(self.gate.report())

    @property
    def depth(self) -> int:
        """Messages admitted and waiting to be received."""
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

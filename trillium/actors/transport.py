"""ZeroMQ under trio: the only module that imports zmq.

An actor's mailbox is an :class:`Inbox` (a PULL socket that binds); it talks
to another actor through an :class:`Outbox` (a PUSH socket that connects).
Messages are turned into frames by a :class:`~trillium.actors.codec.Codec`
and travel as one multipart ZeroMQ message. Addresses are ``inproc://name``
(one process), ``ipc:///path`` (one host) and ``tcp://host:port``.

pyzmq has no trio integration, so we wait on the socket's ``zmq.FD`` with
``trio.lowlevel.wait_readable``. That FD is edge-triggered and says only that
``zmq.EVENTS`` may have changed, so:

- an operation is always tried first (NOBLOCK) and we wait only after it
  reported ``zmq.Again``; a readable FD is never taken to mean a message;
- after waking we re-read ``zmq.EVENTS`` (which also re-arms the FD) and go
  back to sleep if the event we need is still absent.

Trying the operation before every wait drains the queue fully across calls,
and a send on the same socket cannot swallow a receive's edge.

Peers that restart: an Outbox over ``ipc://`` or ``tcp://`` reconnects by
itself (messages written in the instant of the drop are lost, later ones
queue up to the HWM and flow on reconnect). ZeroMQ does not reconnect
``inproc://``: when an inproc Inbox closes, its Outboxes must be recreated.

Engine links (``actors/links.py``) add two things here: an Outbox may sign
its frames (a ``link_auth.Signer`` puts the proof frame in front), and an
Inbox may cap what it accepts (``max_message_bytes``, set as
``ZMQ_MAXMSGSIZE``: ZeroMQ drops a larger frame, and the connection that
sent it, before allocating it) and hand out raw frames with the sender's
peer address (``receive_frames``) for the links' gate to check and decode.

State owned: one ``zmq.Context`` per process (``inproc://`` needs both ends
on the same context) and the sockets of the boxes created here. One task at a
time may ``receive`` on an Inbox or ``send`` on an Outbox (trio raises
``BusyResourceError`` if two wait on the same socket).
"""

from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import Callable
from typing import Any, Self

import trio
import zmq

from trillium.actors.codec import Codec, CodecError

__all__ = ["DEFAULT_HWM_MESSAGES", "Inbox", "Outbox", "fresh_ipc_address"]

# Messages queued per socket before send() waits (back-pressure, not memory
# growth). 1000 is ZeroMQ's own default; per-step traffic is far below it.
DEFAULT_HWM_MESSAGES = 1000
# WHY: a peer that restarts (a respawned executor) should be found again
# quickly, but a dead one should not be hammered.
_RECONNECT_IVL_MS = 100
_RECONNECT_IVL_MAX_MS = 2000


def _context() -> zmq.Context:
    # pyzmq keeps one instance per process and makes a new one after fork.
    return zmq.Context.instance()


def fresh_ipc_address(name: str = "actor", directory: str | None = None) -> str:
    """A new ``ipc://`` address: ``name`` in a fresh private temp dir, or a
    unique ``name-xxxxxxxx`` inside ``directory`` (which the caller cleans up).

    ZeroMQ leaves the socket file behind when the Inbox closes, so a
    long-lived owner (the supervisor of ``trillium serve``) should pass a
    ``directory`` it removes at exit. Unix socket paths are limited to ~107
    bytes, so keep ``directory`` short.
    """
    if directory is None:
        path = os.path.join(tempfile.mkdtemp(prefix="trl-"), name)
    else:
        path = os.path.join(directory, f"{name}-{uuid.uuid4().hex[:8]}")
    return f"ipc://{path}"


class _TrioSocket:
    """A zmq socket plus the FD-wait logic shared by both boxes."""

    def __init__(self, socket_type: int, codec: Codec, hwm_messages: int) -> None:
        self._socket = _context().socket(socket_type)
        self._signer: Any = None
        self._max_message_bytes: int | None = None
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SNDHWM, hwm_messages)
        self._socket.setsockopt(zmq.RCVHWM, hwm_messages)
        self._socket.setsockopt(zmq.RECONNECT_IVL, _RECONNECT_IVL_MS)
        self._socket.setsockopt(zmq.RECONNECT_IVL_MAX, _RECONNECT_IVL_MAX_MS)
        self._fd: int = self._socket.getsockopt(zmq.FD)
        self._codec = codec
        self.address = ""

    @property
    def closed(self) -> bool:
        return self._socket.closed

    async def _wait_for(self, event: int) -> None:
        # Reading EVENTS first also re-arms the edge-triggered FD.
        while not self._socket.getsockopt(zmq.EVENTS) & event:
            await trio.lowlevel.wait_readable(self._fd)

    def close(self, linger_ms: int = 0) -> None:
        """Close now. Queued outgoing messages are dropped, unless ``linger_ms``
        gives ZeroMQ that long to flush them in the background (an actor's
        last words before it exits)."""
        if self._socket.closed:
            return
        try:
            # Wakes any task waiting on the FD (it gets ClosedResourceError)
            # and unregisters the FD before the number can be reused.
            trio.lowlevel.notify_closing(self._fd)
        except RuntimeError:
            pass  # not inside trio.run: nothing can be waiting
        self._socket.close(linger=linger_ms)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class Inbox(_TrioSocket):
    """The receiving end of an actor: a PULL socket that binds."""

    @classmethod
    def bind(
        cls, address: str, codec: Codec, *, hwm_messages: int = DEFAULT_HWM_MESSAGES,
        max_message_bytes: int | None = None,
    ) -> Inbox:
        """Bind to ``address``; ``tcp://host:*`` picks a free port (see ``.address``).

        ``max_message_bytes``: ZeroMQ drops any larger frame (and its connection)."""
        inbox = cls(zmq.PULL, codec, hwm_messages)
        if max_message_bytes is not None:
            inbox._socket.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        try:
            inbox._socket.bind(address)
        except zmq.ZMQError as exc:
            inbox.close()
            raise OSError(f"cannot bind {address}: {exc}") from exc
        inbox.address = inbox._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        return inbox

    async def receive(self) -> Any:
        """The next message, decoded. Cancellable while waiting."""
        frames = await self._recv_multipart()
        return self._codec.decode([frame.buffer for frame in frames])

    async def _recv_multipart(self) -> list[zmq.Frame]:
        await trio.lowlevel.checkpoint_if_cancelled()
        while True:
            if self._socket.closed:
                raise trio.ClosedResourceError("inbox is closed")
            try:
                frames = self._socket.recv_multipart(zmq.NOBLOCK, copy=False)
                break
            except zmq.Again:
                await self._wait_for(zmq.POLLIN)
        # Shielded: the message is already off the socket and must not be lost
        # to a cancellation arriving now.
        await trio.lowlevel.cancel_shielded_checkpoint()
        return frames

    async def receive_frames(self) -> tuple[list[memoryview], Callable[[], str]]:
        """The next message's raw frames, undecoded, and a function giving its sender's address.

        The address is ZeroMQ's ``Peer-Address``: ``host:port`` over tcp://,
        ``localhost:<uid>:<gid>:<pid>`` (the peer's credentials) over ipc://,
        "" over inproc://. WHY a function: reading it costs a few
        microseconds, and only a rejected frame needs it."""
        frames = await self._recv_multipart()

        def peer() -> str:
            try:
                return frames[0].get("Peer-Address") or ""
            except zmq.ZMQError:  # inproc:// has no peer address
                return ""

        return [frame.buffer for frame in frames], peer

    def receive_nowait(self) -> Any:
        """The next message if one is queued, else raise ``trio.WouldBlock``."""
        return self._codec.decode(self.receive_frames_nowait())

    def receive_frames_nowait(self) -> list[memoryview]:
        """The next message's raw frames if one is queued, else raise ``trio.WouldBlock``."""
        try:
            frames = self._socket.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            raise trio.WouldBlock from None
        return [frame.buffer for frame in frames]


class Outbox(_TrioSocket):
    """The sending end towards one actor: a PUSH socket that connects.

    Connecting never fails on a missing peer: messages queue (up to the HWM)
    and flow once the peer binds, and again after it restarts.
    """

    @classmethod
    def connect(
        cls, address: str, codec: Codec, *, hwm_messages: int = DEFAULT_HWM_MESSAGES, signer: Any = None,
        max_message_bytes: int | None = None,
    ) -> Outbox:
        """``signer``: a ``link_auth.Signer`` whose proof frame leads every message.
        ``max_message_bytes``: the receiver's cap; a larger message raises CodecError
        here (WHY: past the receiver's ZMQ_MAXMSGSIZE, ZeroMQ would drop it and the
        link's connection without a word)."""
        outbox = cls(zmq.PUSH, codec, hwm_messages)
        outbox._signer = signer
        outbox._max_message_bytes = max_message_bytes
        try:
            outbox._socket.connect(address)
        except zmq.ZMQError as exc:
            outbox.close()
            raise OSError(f"cannot connect {address}: {exc}") from exc
        outbox.address = address
        return outbox

    async def send(self, message: object) -> None:
        """Queue ``message``; waits (without blocking trio) while the HWM is reached."""
        await trio.lowlevel.checkpoint_if_cancelled()
        frames = self._codec.encode(message)
        if self._max_message_bytes is not None:
            size = sum(memoryview(frame).nbytes for frame in frames)
            if size > self._max_message_bytes:
                raise CodecError(f"{type(message).__name__} is {size} bytes, over the receiver's cap of "
                                 f"{self._max_message_bytes} ({self.address})")
        if self._signer is not None:
            frames = self._signer.sign(frames)
        await self.send_frames(frames)

    async def send_frames(self, frames: list[Any]) -> None:
        """Queue already-encoded frames as one message (no codec, no signer)."""
        await trio.lowlevel.checkpoint_if_cancelled()
        while True:
            if self._socket.closed:
                raise trio.ClosedResourceError("outbox is closed")
            try:
                # copy=False: pyzmq still copies frames under its copy threshold
                # (64 KiB) and hands larger ones to ZeroMQ without copying.
                # A multipart message is atomic: once the first frame is
                # accepted, the rest are too, so Again can only come first.
                self._socket.send_multipart(frames, zmq.NOBLOCK, copy=False)
                break
            except zmq.Again:
                await self._wait_for(zmq.POLLOUT)
        await trio.lowlevel.cancel_shielded_checkpoint()

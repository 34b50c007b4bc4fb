"""The gate of an engine inbox: what a received frame must pass to become a message.

Every engine mailbox (`mailbox.py`) hands each received multipart message to
its `Gate` before anything else sees it:

    frames --size--> --proof (link_auth.Verifier)--> --codec--> --role policy--> message
              |               |                          |             |
           oversize    unauthenticated / replayed    undecodable    forbidden

A frame that fails a check is dropped: counted by reason, logged with its
peer (the claimed role and ZeroMQ's peer address, which over ipc:// holds
the sender's uid and pid) at most once per peer and reason every
`LOG_INTERVAL_S`, and the actor carries on. WHY rate-limited: a flood of
garbage must not become a flood of log lines.

The counts reach the api as `FramesRejected` (lifetime totals, sent by the
mailbox at most once a second while they change) and /metrics as
`trillium:engine_rejected_frames_total{actor,reason}`.

State: the totals per reason, and when each (peer, reason) was last logged.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from trillium.actors.codec import Codec, CodecError
from trillium.actors.link_auth import AuthError, Verifier
from trillium.actors.protocol.rejections import REJECT_REASONS, FramesRejected
from trillium.actors.protocol.senders import may_send

log = logging.getLogger(__name__)

LOG_INTERVAL_S = 60.0
# WHY a bound: peers are keyed by address (and pid); a flood from many
# short-lived processes must not grow the table without limit.
_MAX_LOGGED_PEERS = 1024


class Gate:
    def __init__(self, receiver: str, codec: Codec, verifier: Verifier, max_message_bytes: int,
                 clock=time.monotonic) -> None:
        self.receiver = receiver
        self._codec = codec
        self._verifier = verifier
        self._max_message_bytes = max_message_bytes
        self._clock = clock
        self._totals = dict.fromkeys(REJECT_REASONS, 0)
        self._logged: dict[tuple[str, str], tuple[float, int]] = {}  # -> (last logged, dropped since)
        self.num_rejected = 0  # all reasons; grows on every rejection

    def admit(self, frames: Sequence[Any], peer: str | Callable[[], str] = "") -> Any | None:
        """The decoded message, or None when the frames were rejected. `peer`: the
        sender's address, or a function giving it (read only for a rejection)."""
        size = sum(memoryview(frame).nbytes for frame in frames)
        if size > self._max_message_bytes:
            return self._reject("oversize", peer, None, f"{size} bytes > cap {self._max_message_bytes}")
        try:
            role, body = self._verifier.verify(frames)
        except AuthError as exc:
            return self._reject(exc.reason, peer, exc.claimed_role, str(exc))
        try:
            message = self._codec.decode(body)
        except CodecError as exc:
            return self._reject("undecodable", peer, role, str(exc)[:200])
        if not may_send(self.receiver, role, type(message)):
            return self._reject("forbidden", peer, role, f"{role} may not send {type(message).__name__}")
        return message

    def report(self) -> FramesRejected:
        return FramesRejected(self.receiver, tuple(self._totals.items()))

    def _reject(self, reason: str, peer: str | Callable[[], str], role: str | None, detail: str) -> None:
        peer = peer() if callable(peer) else peer
        self._totals[reason] += 1
        self.num_rejected += 1
        key = (f"{role or '?'}@{peer or '?'}", reason)
        now = self._clock()
        last = self._logged.get(key)
        if last is not None and now - last[0] < LOG_INTERVAL_S:
            self._logged[key] = (last[0], last[1] + 1)
            return None
        if len(self._logged) >= _MAX_LOGGED_PEERS:
            self._logged.clear()
        suppressed = f" ({last[1]} more since the last report)" if last is not None and last[1] else ""
        log.warning("%s: dropped a frame from %s (claimed role %s): %s: %s%s; logged once per %.0f s per peer",
                    self.receiver, peer or "an unknown peer", role or "none", reason, detail, suppressed,
                    LOG_INTERVAL_S)
        self._logged[key] = (now, 0)
        return None

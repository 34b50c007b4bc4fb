"""any engine actor -> api: how many frames its inbox dropped, by reason.

Pattern: PUSH (scheduler, executor, detokenizer) -> PULL (api inbox, the
api binds). Sent by an actor's mailbox at most once a second while its
counts change (`actors/gate.py`); the api exports them as
`trillium:engine_rejected_frames_total{actor,reason}`.
"""

from __future__ import annotations

import attrs

# Why a frame was dropped (the metric's `reason` label):
#   unauthenticated  no link proof, or one that does not verify (no / another run's secret)
#   replayed         a valid proof seen before (a frame captured and sent again)
#   forbidden        the sender's role may not send that message type here (protocol/senders.py)
#   undecodable      the codec could not decode the message
#   oversize         the message's frames add up to more than the receiver's cap
REJECT_REASONS = ("unauthenticated", "replayed", "forbidden", "undecodable", "oversize")


@attrs.frozen
class FramesRejected:
    """Lifetime totals of `actor`'s inbox, one (reason, count) per reason in REJECT_REASONS."""

    actor: str
    totals: tuple[tuple[str, int], ...]


MESSAGES = (FramesRejected,)

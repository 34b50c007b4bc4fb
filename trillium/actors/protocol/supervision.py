"""Lifecycle messages any actor understands.

Pattern: PUSH to the actor's inbox. `Shutdown` makes the actor return.
"""

from __future__ import annotations

import attrs


@attrs.frozen
class Shutdown:
    reason: str = ""


@attrs.frozen
class Ping:
    token: int
    reply_to: str  # address of the sender's inbox


@attrs.frozen
class Pong:
    token: int
    actor: str


MESSAGES = (Shutdown, Ping, Pong)

"""Proof of membership on every engine link: an HMAC over each envelope.

Every message between the engine's processes carries one extra frame in
front of the codec's frames, the *proof*::

    b"TRL1" | len(role) (1 byte) | role (ascii) | sender id (8 bytes) |
    counter (8 bytes, big-endian) | HMAC-SHA256 (32 bytes)

The MAC covers the proof's prefix and every frame (each prefixed with its
8-byte length), under a key derived from the run's secret and the sender's
role (``HMAC(secret, "trillium-link-role:" + role)``). A receiver checks the
MAC under the key of the role the proof claims, then that the counter
grows per (role, sender id): a frame replayed from a captured tcp:// stream
is refused. The verified role is the sender's identity: the receiver's role
policy (``protocol/senders.py``) decides from it which message types it
may send.

The secret (32 random bytes) is made once per ``trillium serve`` and handed
to each child on its stdin with its actor spec (never argv, never the
environment, which other same-user processes can read in /proc), so a
same-user process that finds the socket path but not the secret can
connect, but every frame it sends is dropped and counted.

WHY HMAC and not ZeroMQ CURVE (measured by ``bench/link_auth.py`` on the
2-core dev box, one-way ipc:// send+receive per message):

    link    300 B    128 KiB
    plain   ~41 us   ~62 us
    hmac    ~52 us   ~300 us   (sign + verify on the actor's own thread)
    curve   ~64 us   ~560 us   (encrypt + decrypt in ZeroMQ's I/O threads)

HMAC costs less per message at both sizes, needs no ZAP authenticator
thread in every process, keeps the sender's identity inside the message (so
the role policy is a pure function of the envelope, unit-testable without
sockets), and works the same on inproc://, ipc:// and tcp://. What CURVE
would add, confidentiality on tcp://, is not part of this threat model: the
links carry token ids and weights, not credentials (see README "Security
model"); use a private network or a tunnel for tcp:// between hosts.
NOTE: a peer without the secret can still make ZeroMQ buffer one frame up
to the inbox's ``ZMQ_MAXMSGSIZE`` before the MAC is checked.

State: the per-role keys (derived once), and per Signer its random sender
id and counter; per Verifier the last counter seen per (role, sender id).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from collections.abc import Sequence
from typing import Any

import attrs

__all__ = ["PROOF_MAGIC", "AuthError", "LinkKey", "Signer", "Verifier"]

PROOF_MAGIC = b"TRL1"
SECRET_BYTES = 32
_MAC_BYTES = 32
_COUNTER = struct.Struct(">Q")


class AuthError(Exception):
    """A frame without valid proof; ``reason`` is the metric label."""

    def __init__(self, reason: str, detail: str, claimed_role: str | None = None) -> None:
        super().__init__(detail)
        self.reason = reason
        self.claimed_role = claimed_role


@attrs.frozen(repr=False)
class LinkKey:
    """The run's secret. ``repr`` never shows it."""

    secret: bytes

    def __attrs_post_init__(self) -> None:
        if len(self.secret) != SECRET_BYTES:
            raise ValueError(f"a link secret is {SECRET_BYTES} bytes, got {len(self.secret)}")

    @staticmethod
    def generate() -> LinkKey:
        return LinkKey(os.urandom(SECRET_BYTES))

    def role_key(self, role: str) -> bytes:
        return hmac.digest(self.secret, b"trillium-link-role:" + role.encode(), "sha256")

    def __repr__(self) -> str:
        return "LinkKey(<secret>)"


# Frames up to this size are MACed in one call over a joined copy. WHY: one
# hmac.digest call costs about a third of hmac.copy + update per frame for
# the small per-step envelopes, and copying a few KiB is cheaper than that.
_JOIN_MAX_BYTES = 16 * 1024


def _mac(key: bytes, base: Any, prefix: bytes, frames: Sequence[Any]) -> bytes:
    parts = [prefix]
    total = 0
    for frame in frames:
        size = memoryview(frame).nbytes
        total += size
        parts.append(_COUNTER.pack(size))
        parts.append(frame)
    if total <= _JOIN_MAX_BYTES:
        return hmac.digest(key, b"".join(parts), "sha256")
    h = base.copy()  # WHY copy: the keyed inner/outer state is computed once per role
    for part in parts:
        h.update(part)
    return h.digest()


class Signer:
    """Signs the frames of one sender (one Outbox): its role, a random id, a counter."""

    def __init__(self, key: LinkKey, role: str) -> None:
        role_bytes = role.encode("ascii")
        self._key = key.role_key(role)
        self._base = hmac.new(self._key, digestmod=hashlib.sha256)
        self._head = PROOF_MAGIC + bytes([len(role_bytes)]) + role_bytes + os.urandom(8)
        self._counter = 0

    def sign(self, frames: list[Any]) -> list[Any]:
        self._counter += 1
        prefix = self._head + _COUNTER.pack(self._counter)
        return [prefix + _mac(self._key, self._base, prefix, frames), *frames]


class Verifier:
    """Checks proofs for one receiver (one Inbox); returns the sender's role."""

    def __init__(self, key: LinkKey, roles: Sequence[str]) -> None:
        self._keys = {role: key.role_key(role) for role in roles}
        self._bases = {role: hmac.new(k, digestmod=hashlib.sha256) for role, k in self._keys.items()}
        self._last_counter: dict[bytes, int] = {}

    def verify(self, frames: Sequence[Any]) -> tuple[str, Sequence[Any]]:
        """(role, the codec's frames); raises AuthError."""
        if len(frames) < 2:
            raise AuthError("unauthenticated", f"{len(frames)} frame(s), no proof and message")
        proof = bytes(frames[0])
        if not proof.startswith(PROOF_MAGIC) or len(proof) < len(PROOF_MAGIC) + 1:
            raise AuthError("unauthenticated", "first frame is not a link proof")
        role_len = proof[len(PROOF_MAGIC)]
        role_end = len(PROOF_MAGIC) + 1 + role_len
        if len(proof) != role_end + 8 + _COUNTER.size + _MAC_BYTES:
            raise AuthError("unauthenticated", "link proof has the wrong length")
        role = proof[len(PROOF_MAGIC) + 1 : role_end].decode("ascii", errors="replace")
        role_key = self._keys.get(role)
        if role_key is None:
            raise AuthError("unauthenticated", f"unknown sender role {role!r}", role)
        prefix, mac = proof[:-_MAC_BYTES], proof[-_MAC_BYTES:]
        if not hmac.compare_digest(mac, _mac(role_key, self._bases[role], prefix, frames[1:])):
            raise AuthError("unauthenticated", "bad MAC (no or another run's secret)", role)
        sender = proof[len(PROOF_MAGIC) : role_end + 8]
        (counter,) = _COUNTER.unpack_from(proof, role_end + 8)
        if counter <= self._last_counter.get(sender, 0):
            raise AuthError("replayed", f"counter {counter} already seen from this sender", role)
        self._last_counter[sender] = counter
        return role, frames[1:]

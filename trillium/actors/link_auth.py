"""Proof of membership on every engine link: a keyed MAC over each envelope.

Every message between the engine's processes carries one extra frame in
front of the codec's frames, the *proof*::

    b"TRL1" | len(role) (1 byte) | role (ascii) | sender id (8 bytes) |
    counter (8 bytes, big-endian) | MAC (32 bytes)

The MAC covers the proof's prefix and every frame (each prefixed with its
8-byte length), under keys derived from the run's secret and the sender's
role (``HMAC(secret, "trillium-link-role:" + role)``, then one key per
algorithm): keyed BLAKE2b for messages up to 16 KiB, HMAC-SHA256 above
(see `_BLAKE2B_MAX_BYTES`). A receiver checks the
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

WHY a MAC per envelope and not ZeroMQ CURVE. Measured by
``bench/link_auth.py`` (one-way ipc:// send + receive; CPU us per message,
all threads, best of 5 rounds; the 2-core dev box under a load of ~14, so
only the ratios mean much):

    link    300 B    128 KiB
    plain   15       52
    mac     31       386      (sign + verify on the actor's own thread)
    curve   19       348      (encrypt + decrypt in ZeroMQ's I/O threads)

CURVE costs less CPU: ~3.5 us over plain per small message against ~16 us
here (Python overhead around the MAC), and about 10% less on 128 KiB. We
still chose the MAC, for what it buys beyond cost:

- the sender's role is inside the message, so the sender policy
  (``protocol/senders.py``) is a pure function of the envelope, unit-tested
  without sockets; with CURVE the role would come from the ZAP handler's
  User-Id metadata, which needs an authenticator thread in every process;
- one mechanism on inproc:// (``trillium.LLM``, the actor tests), ipc:// and
  tcp://: ZeroMQ applies no security mechanism to inproc://, so CURVE would
  leave the in-process engine without sender identities;
- the absolute cost is small: ~5 engine messages per step, ~100 us of CPU
  per step spread over four processes, against steps of milliseconds.

What CURVE would add, and the MAC does not: confidentiality on tcp://, and
refusing a stranger at the handshake, before ZeroMQ buffers any of its
frames. The links carry token ids and weights, not credentials (README
"Security model"): run tcp:// between hosts on a private network or a
tunnel. If the CPU per message ever matters, CURVE fits behind the same
seam (``links.py`` builds every socket).
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


# Messages up to this size (all frames) are MACed with keyed BLAKE2b, larger
# ones with HMAC-SHA256. WHY (measured on the dev box, 360 B): BLAKE2b from a
# copied keyed state ~3.7 us, HMAC-SHA256 from a copied state ~7.4 us,
# hmac.digest() ~18 us (OpenSSL sets the MAC up on every call); on 128 KiB
# SHA-256 (SHA-NI) runs about twice as fast as BLAKE2b.
_BLAKE2B_MAX_BYTES = 16 * 1024


class _RoleMac:
    """The MAC of one role's messages, from keyed states computed once."""

    def __init__(self, key: LinkKey, role: str) -> None:
        role_key = key.role_key(role)
        self._small = hashlib.blake2b(key=hmac.digest(role_key, b"blake2b", "sha256"), digest_size=_MAC_BYTES)
        self._large = hmac.new(hmac.digest(role_key, b"hmac-sha256", "sha256"), digestmod=hashlib.sha256)

    def digest(self, prefix: bytes, frames: Sequence[Any]) -> bytes:
        sizes = [memoryview(frame).nbytes for frame in frames]
        h = (self._small if sum(sizes) <= _BLAKE2B_MAX_BYTES else self._large).copy()
        h.update(prefix)
        for size, frame in zip(sizes, frames):
            h.update(_COUNTER.pack(size))
            h.update(frame)
        return h.digest()


class Signer:
    """Signs the frames of one sender (one Outbox): its role, a random id, a counter."""

    def __init__(self, key: LinkKey, role: str) -> None:
        role_bytes = role.encode("ascii")
        self._mac = _RoleMac(key, role)
        self._head = PROOF_MAGIC + bytes([len(role_bytes)]) + role_bytes + os.urandom(8)
        self._counter = 0

    def sign(self, frames: list[Any]) -> list[Any]:
        self._counter += 1
        prefix = self._head + _COUNTER.pack(self._counter)
        return [prefix + self._mac.digest(prefix, frames), *frames]


class Verifier:
    """Checks proofs for one receiver (one Inbox); returns the sender's role."""

    def __init__(self, key: LinkKey, roles: Sequence[str]) -> None:
        self._macs = {role: _RoleMac(key, role) for role in roles}
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
        mac_of = self._macs.get(role)
        if mac_of is None:
            raise AuthError("unauthenticated", f"unknown sender role {role!r}", role)
        prefix, mac = proof[:-_MAC_BYTES], proof[-_MAC_BYTES:]
        if not hmac.compare_digest(mac, mac_of.digest(prefix, frames[1:])):
            raise AuthError("unauthenticated", "bad MAC (no or another run's secret)", role)
        sender = proof[len(PROOF_MAGIC) : role_end + 8]
        (counter,) = _COUNTER.unpack_from(proof, role_end + 8)
        if counter <= self._last_counter.get(sender, 0):
            raise AuthError("replayed", f"counter {counter} already seen from this sender", role)
        self._last_counter[sender] = counter
        return role, frames[1:]

"""An engine process's links: its own mailbox and its outboxes to the others.

`Links(config, role)` is the only way the engine's processes open sockets
to each other (scheduler, executor, detokenizer actors and the api's
EngineClient). Every outbox signs as `role` with the run's link key
(`link_auth.py`); the mailbox binds `role`'s address with the gate
(`gate.py`: size cap, proof, codec, sender policy of `protocol/senders.py`)
and, for every role but the api, reports its rejections to the api.

INVARIANT: no engine link opens without the run's secret (`ActorConfig`
always carries one; a config without it is refused here, tcp:// included),
and ipc:// sockets live in a private 0700 directory (`assembly.Addresses`).
"""

from __future__ import annotations

from trillium.actors.assembly import ActorConfig, engine_codec
from trillium.actors.codec import Codec
from trillium.actors.gate import Gate
from trillium.actors.link_auth import Signer, Verifier
from trillium.actors.liveness import PongSender
from trillium.actors.mailbox import Mailbox
from trillium.actors.protocol.senders import MAX_MESSAGE_BYTES, ROLES
from trillium.actors.transport import Inbox, Outbox


class LinkConfigError(ValueError):
    """The actor config cannot make authenticated links."""


class Links:
    def __init__(self, config: ActorConfig, role: str, codec: Codec | None = None) -> None:
        if role not in ROLES:
            raise LinkConfigError(f"unknown engine role {role!r}; roles: {', '.join(ROLES)}")
        key = config.link_key()
        if key is None:
            raise LinkConfigError(
                "the actor config carries no link secret: engine links (ipc://, tcp://) are not opened "
                "without proof of membership"
            )
        self._config = config
        self._key = key
        self.role = role
        self.codec = codec or engine_codec()

    def address(self, role: str) -> str:
        return getattr(self._config.addresses, role)

    def outbox(self, peer: str) -> Outbox:
        return Outbox.connect(self.address(peer), self.codec, signer=Signer(self._key, self.role),
                              max_message_bytes=MAX_MESSAGE_BYTES[peer])

    def mailbox(self, max_buffered: int = 4096) -> Mailbox:
        cap = MAX_MESSAGE_BYTES[self.role]
        inbox = Inbox.bind(self.address(self.role), self.codec, max_message_bytes=cap)
        gate = Gate(self.role, self.codec, Verifier(self._key, ROLES), cap)
        report_to = pongs = None
        if self.role != "api":
            report_to = self.outbox("api")
            pongs = PongSender(self.role, self.address("api"), lambda: self.outbox("api"))
        return Mailbox(inbox, gate, report_to, max_buffered, pongs)

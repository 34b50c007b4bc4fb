"""Tiny actors for the runtime's own tests (tests/actors/).

They live inside the package so that ``python -m trillium.actors.supervisor``
children can import them. Config is a msgpack map of addresses; messages are
:class:`Ping` (with a hop count) and :class:`Pong`.
"""

from __future__ import annotations

import os

import attrs
import msgpack
import trio

from trillium.actors.codec import Codec
from trillium.actors.transport import Inbox, Outbox


@attrs.frozen
class Ping:
    seq: int
    hops: int = 0


@attrs.frozen
class Pong:
    seq: int
    hops: int
    pid: int


PING_CODEC = Codec([Ping, Pong])


def make_config(**addresses: str) -> bytes:
    return msgpack.packb(addresses, use_bin_type=True)


def _read_config(config: bytes | None) -> dict[str, str]:
    return msgpack.unpackb(config or msgpack.packb({}), raw=False)


async def forwarder(config: bytes | None, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Ping on ``inbox`` -> same Ping, one more hop, to ``outbox``."""
    addresses = _read_config(config)
    with (
        Inbox.bind(addresses["inbox"], PING_CODEC) as inbox,
        Outbox.connect(addresses["outbox"], PING_CODEC) as outbox,
    ):
        task_status.started()
        while True:
            ping = await inbox.receive()
            await outbox.send(Ping(ping.seq, ping.hops + 1))


async def ponger(config: bytes | None, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Ping on ``inbox`` -> Pong to ``outbox``."""
    addresses = _read_config(config)
    with (
        Inbox.bind(addresses["inbox"], PING_CODEC) as inbox,
        Outbox.connect(addresses["outbox"], PING_CODEC) as outbox,
    ):
        task_status.started()
        while True:
            ping = await inbox.receive()
            await outbox.send(Pong(ping.seq, ping.hops + 1, os.getpid()))


async def idle(config: bytes | None, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    task_status.started()
    await trio.sleep_forever()


async def fail_after_start(config: bytes | None, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    task_status.started()
    await trio.sleep(0.05)
    raise RuntimeError("boom after start")


async def fail_before_start(config: bytes | None, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    raise RuntimeError("boom before start")


async def return_after_start(config: bytes | None, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    task_status.started()


async def stubborn(config: bytes | None, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Ignores cancellation (and so SIGTERM): only SIGKILL stops it."""
    task_status.started()
    with trio.CancelScope(shield=True):
        await trio.sleep_forever()

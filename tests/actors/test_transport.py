"""Transport under trio: ordering, large frames, idle periods, restarts, HWM, cancellation."""

from __future__ import annotations

import itertools
import os
import tempfile

import attrs
import numpy as np
import pytest
import torch
import trio

from trillium.actors.codec import Codec
from trillium.actors.transport import Inbox, Outbox, fresh_ipc_address


@attrs.frozen
class Seq:
    seq: int
    token_ids: list[int] = attrs.field(factory=list)


@attrs.frozen
class Blob:
    seq: int
    data: torch.Tensor
    array: np.ndarray


CODEC = Codec([Seq, Blob])
_names = itertools.count()
# One short-lived dir for this module's ipc sockets (paths must stay < 107 bytes).
_IPC_DIR = tempfile.TemporaryDirectory(prefix="trl-test-")


def ipc_address() -> str:
    return fresh_ipc_address(directory=_IPC_DIR.name)


def new_address(scheme: str) -> str:
    if scheme == "inproc":
        return f"inproc://test-{next(_names)}"
    if scheme == "ipc":
        return ipc_address()
    return "tcp://127.0.0.1:*"


def open_pair(scheme: str, **options) -> tuple[Inbox, Outbox]:
    inbox = Inbox.bind(new_address(scheme), CODEC, **options)
    return inbox, Outbox.connect(inbox.address, CODEC, **options)


SCHEMES = ["inproc", "ipc", "tcp"]


@pytest.mark.parametrize("scheme", ["inproc", "ipc"])
async def test_ten_thousand_messages_arrive_in_order(scheme):
    inbox, outbox = open_pair(scheme)
    num_messages = 10_000
    with inbox, outbox:

        async def produce():
            for seq in range(num_messages):
                await outbox.send(Seq(seq, [seq, seq + 1]))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(produce)
            for expected in range(num_messages):
                message = await inbox.receive()
                assert message == Seq(expected, [expected, expected + 1])


@pytest.mark.parametrize("scheme", SCHEMES)
async def test_large_tensor_frames_arrive_intact(scheme):
    inbox, outbox = open_pair(scheme)
    data = torch.randn(4 * 1024 * 1024)  # 16 MiB
    array = np.arange(1 << 20, dtype=np.int64)  # 8 MiB
    with inbox, outbox:
        for seq in range(2):
            await outbox.send(Blob(seq, data.to(torch.bfloat16) if seq else data, array))
        first, second = await inbox.receive(), await inbox.receive()
    assert torch.equal(first.data, data)
    assert second.data.dtype == torch.bfloat16
    assert torch.equal(second.data, data.to(torch.bfloat16))
    assert np.array_equal(first.array, array)


@pytest.mark.parametrize("scheme", SCHEMES)
async def test_traffic_resumes_after_idle_pause(scheme):
    inbox, outbox = open_pair(scheme)
    with inbox, outbox:
        await outbox.send(Seq(0))
        assert (await inbox.receive()).seq == 0
        with trio.move_on_after(0.3) as idle:
            await inbox.receive()  # nothing comes: we must wait, not spin or fail
        assert idle.cancelled_caught
        await trio.sleep(0.2)
        for seq in range(1, 4):
            await outbox.send(Seq(seq))
        assert [(await inbox.receive()).seq for _ in range(3)] == [1, 2, 3]


async def test_receiver_waiting_before_the_send_is_woken():
    inbox, outbox = open_pair("ipc")
    with inbox, outbox:
        async with trio.open_nursery() as nursery:
            received = []

            async def receive_one():
                received.append(await inbox.receive())

            nursery.start_soon(receive_one)
            await trio.sleep(0.1)
            await outbox.send(Seq(42))
        assert received == [Seq(42)]


@pytest.mark.parametrize("scheme", ["ipc", "tcp"])
async def test_receiver_restart_at_same_address(scheme):
    inbox = Inbox.bind(new_address(scheme), CODEC)
    address = inbox.address
    with Outbox.connect(address, CODEC) as outbox:
        for seq in range(5):
            await outbox.send(Seq(seq))
        assert [(await inbox.receive()).seq for _ in range(5)] == list(range(5))
        inbox.close()
        await trio.sleep(0.1)  # let the PUSH side notice the disconnect

        with Inbox.bind(address, CODEC) as restarted:
            # Messages written in the instant before the drop may be lost; the
            # stream after the restart must flow, in order, to the last one.
            received = []
            async with trio.open_nursery() as nursery:

                async def produce():
                    for seq in range(5, 105):
                        await outbox.send(Seq(seq))

                nursery.start_soon(produce)
                with trio.fail_after(10):
                    while not received or received[-1] != 104:
                        received.append((await restarted.receive()).seq)
            assert received == sorted(received)
            assert len(received) >= 90


async def test_send_waits_at_hwm_without_blocking_trio():
    address = ipc_address()
    with Outbox.connect(address, CODEC, hwm_messages=10) as outbox:
        sent = 0
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                ticks += 1
                await trio.sleep(0.01)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ticker)
            with trio.move_on_after(0.5) as blocked:
                for seq in range(1000):
                    await outbox.send(Seq(seq))
                    sent += 1
            assert blocked.cancelled_caught  # nobody bound: the queue filled up
            assert 1 <= sent < 1000
            assert ticks > 5  # the loop kept running while send waited

            with Inbox.bind(address, CODEC) as inbox:
                # The queued messages drain, and sending resumes.
                for seq in range(sent, sent + 50):
                    await outbox.send(Seq(seq))
                seqs = [(await inbox.receive()).seq for _ in range(sent + 50)]
            nursery.cancel_scope.cancel()
    assert seqs == list(range(sent + 50))


async def test_blocked_receive_is_cancellable():
    inbox, outbox = open_pair("inproc")
    with inbox, outbox:
        with trio.move_on_after(0.1) as scope:
            await inbox.receive()
        assert scope.cancelled_caught
        # The inbox still works after the cancelled wait.
        await outbox.send(Seq(1))
        assert (await inbox.receive()).seq == 1


async def test_closing_wakes_a_waiting_receiver():
    inbox, outbox = open_pair("ipc")
    outbox.close()
    errors = []

    async def receive():
        try:
            await inbox.receive()
        except trio.ClosedResourceError as exc:
            errors.append(exc)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(receive)
        await trio.sleep(0.05)
        inbox.close()
    assert len(errors) == 1
    with pytest.raises(trio.ClosedResourceError):
        await inbox.receive()


async def test_many_open_close_cycles_do_not_leak_fd_registrations():
    # A closed socket's FD number is reused by the next one; trio must not
    # still have the old one registered (notify_closing before close).
    for seq in range(50):
        inbox, outbox = open_pair("ipc")
        with inbox, outbox:
            with trio.move_on_after(0.001):
                await inbox.receive()
            await outbox.send(Seq(seq))
            assert (await inbox.receive()).seq == seq


def test_fresh_ipc_address_is_unique():
    first, second = fresh_ipc_address(), fresh_ipc_address()
    assert first != second
    for address in (first, second):
        os.rmdir(os.path.dirname(address.removeprefix("ipc://")))
    assert ipc_address() != ipc_address()
    assert ipc_address().startswith(f"ipc://{_IPC_DIR.name}/actor-")


async def test_receive_nowait():
    inbox, outbox = open_pair("inproc")
    with inbox, outbox:
        with pytest.raises(trio.WouldBlock):
            inbox.receive_nowait()
        await outbox.send(Seq(3))
        with trio.fail_after(5):
            while True:
                try:
                    assert inbox.receive_nowait() == Seq(3)
                    break
                except trio.WouldBlock:
                    await trio.sleep(0.001)


def test_bind_error_is_an_os_error():
    with Inbox.bind("inproc://taken-once", CODEC):
        with pytest.raises(OSError, match="taken-once"):
            Inbox.bind("inproc://taken-once", CODEC)

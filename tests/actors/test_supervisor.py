"""Supervisor: actors in one nursery and in child processes, failures, no orphans."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from functools import partial

import pytest
import trio

from trillium.actors._testing_actors import PING_CODEC, Ping, Pong, make_config
from trillium.actors.supervisor import (
    ActorFailed,
    ActorSpec,
    run_in_process,
    run_in_subprocesses,
)
from trillium.actors.transport import Inbox, Outbox, fresh_ipc_address

ACTORS = "trillium.actors._testing_actors"
_IPC_DIR = tempfile.TemporaryDirectory(prefix="trl-test-")


def pid_alive(pid: int) -> bool:
    """True for a running process; a zombie (exited, not reaped) counts as dead."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def ping_pong_specs(new_address) -> tuple[list[ActorSpec], str, str]:
    """forward (entry -> middle) then pong (middle -> exit)."""
    entry, middle, exit_ = new_address(), new_address(), new_address()
    specs = [
        ActorSpec("pong", f"{ACTORS}:ponger", make_config(inbox=middle, outbox=exit_)),
        ActorSpec("forward", f"{ACTORS}:forwarder", make_config(inbox=entry, outbox=middle)),
    ]
    return specs, entry, exit_


async def exchange_pings(entry: str, exit_: str, num_pings: int = 20) -> list[Pong]:
    with Inbox.bind(exit_, PING_CODEC) as replies, Outbox.connect(entry, PING_CODEC) as requests:
        with trio.fail_after(30):
            for seq in range(num_pings):
                await requests.send(Ping(seq))
            return [await replies.receive() for _ in range(num_pings)]


# --- in process -----------------------------------------------------------------


async def test_in_process_ping_pong():
    names = iter(range(1000))
    specs, entry, exit_ = ping_pong_specs(lambda: f"inproc://sup-{next(names)}")
    async with trio.open_nursery() as nursery:
        supervision = await nursery.start(run_in_process, specs)
        assert supervision.alive == {"pong": True, "forward": True}
        assert supervision.healthy
        pongs = await exchange_pings(entry, exit_)
        nursery.cancel_scope.cancel()
    assert [(p.seq, p.hops, p.pid) for p in pongs] == [(i, 2, os.getpid()) for i in range(20)]
    assert supervision.alive == {"pong": False, "forward": False}


class StartedCapture:
    """A task_status for awaiting a supervisor directly (no nursery to wrap errors)."""

    value = None

    def started(self, value=None) -> None:
        self.value = value


async def test_in_process_failure_names_the_actor_and_cancels_siblings():
    specs = [
        ActorSpec("steady", f"{ACTORS}:idle"),
        ActorSpec("crasher", f"{ACTORS}:fail_after_start"),
    ]
    capture = StartedCapture()
    with pytest.raises(ActorFailed) as info:
        await run_in_process(specs, task_status=capture)
    assert info.value.name == "crasher"
    assert isinstance(info.value.cause, RuntimeError)
    assert "boom after start" in str(info.value)
    assert capture.value.alive == {"steady": False, "crasher": False}


async def test_in_process_failure_before_start():
    specs = [
        ActorSpec("first", f"{ACTORS}:idle"),
        ActorSpec("broken", f"{ACTORS}:fail_before_start"),
        ActorSpec("never", f"{ACTORS}:idle"),
    ]
    with pytest.raises(ActorFailed, match="broken") as info:
        await run_in_process(specs)
    assert "boom before start" in str(info.value)


async def test_in_process_actor_that_returns_is_a_failure():
    specs = [
        ActorSpec("idle", f"{ACTORS}:idle"),
        ActorSpec("quitter", f"{ACTORS}:return_after_start"),
    ]
    with pytest.raises(ActorFailed, match="quitter"):
        await run_in_process(specs)


async def test_bad_target_and_duplicate_names():
    with pytest.raises(ActorFailed, match="ghost"):
        await run_in_process([ActorSpec("ghost", "trillium.actors._testing_actors:missing")])
    with pytest.raises(ValueError, match="unique"):
        await run_in_process([ActorSpec("a", f"{ACTORS}:idle"), ActorSpec("a", f"{ACTORS}:idle")])


# --- subprocesses -----------------------------------------------------------------


async def test_subprocess_actors_exchange_messages_over_ipc():
    specs, entry, exit_ = ping_pong_specs(lambda: fresh_ipc_address(directory=_IPC_DIR.name))
    async with trio.open_nursery() as nursery:
        supervision = await nursery.start(run_in_subprocesses, specs)
        assert supervision.healthy
        pids = dict(supervision.pids)
        assert all(pid_alive(pid) for pid in pids.values())
        pongs = await exchange_pings(entry, exit_)
        nursery.cancel_scope.cancel()
    assert [(p.seq, p.hops) for p in pongs] == [(i, 2) for i in range(20)]
    assert {p.pid for p in pongs} == {pids["pong"]}
    assert supervision.alive == {"pong": False, "forward": False}
    # Cancellation terminated and reaped every child.
    assert not any(pid_alive(pid) for pid in pids.values())


async def test_killed_child_fails_the_group_and_leaves_no_process():
    specs = [ActorSpec(name, f"{ACTORS}:idle") for name in ("a", "victim", "c")]
    pids: dict[str, int] = {}
    with pytest.RaisesGroup(ActorFailed) as info:
        async with trio.open_nursery() as nursery:
            supervision = await nursery.start(run_in_subprocesses, specs)
            pids = dict(supervision.pids)
            os.kill(pids["victim"], signal.SIGKILL)
            with trio.fail_after(30):
                await trio.sleep_forever()
    failure = info.value.exceptions[0]
    assert failure.name == "victim"
    assert failure.exit_code == -signal.SIGKILL
    assert not supervision.healthy
    assert len(pids) == 3
    assert not any(pid_alive(pid) for pid in pids.values())


async def test_child_failure_reports_exit_code_and_stderr():
    specs = [ActorSpec("ok", f"{ACTORS}:idle"), ActorSpec("crasher", f"{ACTORS}:fail_after_start")]
    with pytest.raises(ActorFailed) as info:
        await run_in_subprocesses(specs)
    assert info.value.name == "crasher"
    assert info.value.exit_code == 1
    assert "boom after start" in info.value.stderr_tail


async def test_child_that_never_starts():
    with pytest.raises(ActorFailed, match="before it was ready") as info:
        await run_in_subprocesses([ActorSpec("broken", f"{ACTORS}:fail_before_start")])
    assert "boom before start" in info.value.stderr_tail


PARENT_SCRIPT = """
import json, trio
from trillium.actors.supervisor import ActorSpec, run_in_subprocesses

async def main():
    async with trio.open_nursery() as nursery:
        specs = [ActorSpec(n, "trillium.actors._testing_actors:idle") for n in ("x", "y")]
        supervision = await nursery.start(run_in_subprocesses, specs)
        print(json.dumps(list(supervision.pids.values())), flush=True)

trio.run(main)
"""


async def test_children_die_when_the_parent_is_sigkilled():
    parent = await trio.lowlevel.open_process(
        [sys.executable, "-c", PARENT_SCRIPT], stdout=subprocess.PIPE
    )
    try:
        line = b""
        with trio.fail_after(60):
            while not line.endswith(b"\n"):
                chunk = await parent.stdout.receive_some()
                assert chunk, "parent exited before starting its children"
                line += chunk
        child_pids = json.loads(line)
        assert len(child_pids) == 2 and all(pid_alive(pid) for pid in child_pids)
        parent.kill()
        await parent.wait()
        with trio.fail_after(20):
            while any(pid_alive(pid) for pid in child_pids):
                await trio.sleep(0.05)
    finally:
        parent.kill()
        await parent.wait()
        await parent.stdout.aclose()


async def test_child_ignoring_sigterm_is_killed_after_the_grace_period():
    specs = [ActorSpec("stubborn", f"{ACTORS}:stubborn")]
    async with trio.open_nursery() as nursery:
        supervision = await nursery.start(
            partial(run_in_subprocesses, specs, grace_period_s=0.3)
        )
        pid = supervision.pids["stubborn"]
        nursery.cancel_scope.cancel()
    assert not pid_alive(pid)
    assert supervision.alive == {"stubborn": False}

"""Runs actors with structured concurrency, in this process or one process each.

An actor is named by an :class:`ActorSpec`; its target is
``async def run(config: bytes | None, *, task_status=trio.TASK_STATUS_IGNORED)``
that calls ``task_status.started()`` once its sockets are bound and then runs
until cancelled. Actors are services: one that stops, by raising or by
returning, takes its siblings down and surfaces as one :class:`ActorFailed`.
Shutdown is the caller cancelling the supervisor (a cancel scope, usually
with a deadline).

- :func:`run_in_process` runs every actor as a task of one nursery
  (``trillium.LLM``, tests).
- :func:`run_in_subprocesses` runs each actor in its own
  ``python -m trillium.actors.supervisor`` child (``trillium serve``).

In process the actors start in the order given, each awaited until started
(inproc:// peers find each other that way); as subprocesses they start
together, each importing and loading at once. Either then calls
``task_status.started(supervision)`` with a :class:`Supervision` whose
``alive`` map feeds ``/health``.

Child protocol (no pickle): the parent writes a 4-byte big-endian length and
a msgpack map ``{name, target, config}`` to the child's stdin and keeps stdin
open. The child moves its stdout to a private control fd (fd 1 then points at
stderr, so actor prints cannot corrupt it) and writes ``ready`` there after
``started()``. The child exits when its actor ends, on SIGTERM (graceful
cancel) or when stdin reaches EOF, i.e. the parent died, even by SIGKILL.
NOTE: ``PR_SET_PDEATHSIG`` is not used: trio spawns children from a worker
thread, and that signal fires when the spawning *thread* exits.

NOTE on size (~400 lines): the parent's supervision and the child's entry
(`main`, reading its spec from stdin) are the two ends of one protocol and
change together.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import struct
import subprocess
import sys
import traceback
from collections.abc import Awaitable, Callable, Mapping, Sequence
from functools import partial

import attrs
import msgpack
import trio

__all__ = [
    "ActorFailed",
    "ActorSpec",
    "Supervision",
    "run_in_process",
    "run_in_subprocesses",
]

ActorTarget = Callable[..., Awaitable[None]]

_READY_LINE = b"ready\n"
_STDERR_TAIL_BYTES = 8192
# WHY: after the parent dies the stdin EOF fires at once; polling the parent
# pid is the fallback for a parent that forked and left the pipe open.
_PARENT_POLL_S = 1.0


@attrs.frozen
class ActorSpec:
    """One actor: a unique ``name``, a ``"package.module:function"`` target and opaque config."""

    name: str
    target: str
    # repr=False: the engine's config holds the run's link secret (assembly.py).
    config: bytes | None = attrs.field(default=None, repr=False)


class ActorFailed(Exception):
    """An actor raised, returned, or its process exited; its siblings were stopped."""

    def __init__(
        self,
        name: str,
        cause: BaseException | str | None = None,
        *,
        exit_code: int | None = None,
        stderr_tail: str = "",
    ) -> None:
        self.name = name
        self.cause = cause
        self.exit_code = exit_code
        self.stderr_tail = stderr_tail
        parts = [f"actor {name!r} failed"]
        if cause is not None:
            parts.append(f": {cause!r}" if isinstance(cause, BaseException) else f": {cause}")
        if exit_code is not None:
            parts.append(f" (exit code {exit_code})")
        if stderr_tail:
            parts.append(f"\n--- stderr tail ---\n{stderr_tail}")
        super().__init__("".join(parts))


@attrs.define
class Supervision:
    """Live view of a running actor group, handed out by ``task_status.started``."""

    alive: dict[str, bool]
    pids: dict[str, int] = attrs.field(factory=dict)

    @property
    def healthy(self) -> bool:
        return bool(self.alive) and all(self.alive.values())


def resolve_target(target: str) -> ActorTarget:
    """Import ``"package.module:function"``."""
    module_name, sep, function_name = target.partition(":")
    if not sep or not module_name or not function_name:
        raise ValueError(f"actor target must be 'package.module:function', got {target!r}")
    return getattr(importlib.import_module(module_name), function_name)


def _check_unique(specs: Sequence[ActorSpec]) -> None:
    names = [spec.name for spec in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"actor names must be unique: {names}")


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in _leaves(inner)]
    return [exc]


def _first_failure(exc: BaseException) -> ActorFailed | None:
    """The first ActorFailed in ``exc``, unless something else (a KeyboardInterrupt) rides along."""
    leaves = _leaves(exc)
    failures = [leaf for leaf in leaves if isinstance(leaf, ActorFailed)]
    others = [leaf for leaf in leaves if not isinstance(leaf, ActorFailed | trio.Cancelled)]
    return failures[0] if failures and not others else None


async def _supervise_group(
    specs: Sequence[ActorSpec],
    run_one: Callable[..., Awaitable[None]],
    supervision: Supervision,
    task_status: trio.TaskStatus[Supervision],
    *,
    together: bool = False,
) -> None:
    """Start every actor (in order, or `together`), report `supervision` once all are ready, run them."""
    try:
        async with trio.open_nursery() as nursery:
            if together:
                async with trio.open_nursery() as starting:
                    for spec in specs:
                        starting.start_soon(partial(nursery.start, run_one, spec, supervision))
            else:
                for spec in specs:
                    await nursery.start(run_one, spec, supervision)
            task_status.started(supervision)
    except BaseException as exc:
        failure = _first_failure(exc)
        if failure is None:
            raise
        # One flat error for the caller; its __cause__ (if any) is the actor's.
        failure.__suppress_context__ = True
        raise failure


# --- in process ---------------------------------------------------------------


async def run_in_process(
    specs: Sequence[ActorSpec],
    *,
    task_status: trio.TaskStatus[Supervision] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run every actor as a task here; raise :class:`ActorFailed` when one stops."""
    _check_unique(specs)
    supervision = Supervision(alive={spec.name: False for spec in specs})
    await _supervise_group(specs, _run_actor_task, supervision, task_status)


async def _run_actor_task(
    spec: ActorSpec, supervision: Supervision, *, task_status: trio.TaskStatus[None]
) -> None:
    try:
        target = resolve_target(spec.target)
        readiness = _MarkAliveOnStart(spec.name, supervision, task_status)
        await target(spec.config, task_status=readiness)
    except Exception as exc:
        raise ActorFailed(spec.name, exc) from exc
    finally:
        supervision.alive[spec.name] = False
    raise ActorFailed(spec.name, "returned; an actor runs until it is cancelled")


@attrs.define
class _MarkAliveOnStart:
    """The task_status handed to an in-process actor: marks it alive, then passes readiness on."""

    name: str
    supervision: Supervision
    task_status: trio.TaskStatus[None]

    def started(self, value: object = None) -> None:
        self.supervision.alive[self.name] = True
        self.task_status.started()


# --- one process per actor ---------------------------------------------------


async def run_in_subprocesses(
    specs: Sequence[ActorSpec],
    *,
    task_status: trio.TaskStatus[Supervision] = trio.TASK_STATUS_IGNORED,
    env: Mapping[str, str] | None = None,
    drop_env: Sequence[str] = (),
    grace_period_s: float = 5.0,
) -> None:
    """Run each actor in a child process; raise :class:`ActorFailed` when one exits.

    ``env`` adds variables to the children's environment, ``drop_env`` names
    variables they must not inherit (secrets the actors never need). Leaving
    (failure or cancellation) sends SIGTERM to every child still running,
    SIGKILL after ``grace_period_s``, and reaps them all.
    """
    _check_unique(specs)
    supervision = Supervision(alive={spec.name: False for spec in specs})
    child_env = {key: value for key, value in os.environ.items() if key not in drop_env}
    child_env.update(env or {})
    # The child must import this very package, even from an uninstalled checkout.
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    child_env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [package_root, child_env.get("PYTHONPATH")])
    )

    async def run_one(spec: ActorSpec, supervision: Supervision, *, task_status) -> None:
        await _run_child(spec, supervision, child_env, grace_period_s, task_status)

    # WHY together: each child spends seconds importing torch and loading the tokenizer
    # before it is ready; one after another that is most of a server's start. Over
    # ipc:// the order does not matter: an Outbox connects before its peer binds and
    # its messages wait in the queue, and no actor sends before the api does.
    await _supervise_group(specs, run_one, supervision, task_status, together=True)


async def _run_child(
    spec: ActorSpec,
    supervision: Supervision,
    env: Mapping[str, str],
    grace_period_s: float,
    task_status: trio.TaskStatus[None],
) -> None:
    process = await trio.lowlevel.open_process(
        [sys.executable, "-m", "trillium.actors.supervisor"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    supervision.pids[spec.name] = process.pid
    tail = _StderrTail()
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(tail.pump, process.stderr)
            payload = msgpack.packb(attrs.asdict(spec), use_bin_type=True)
            with contextlib.suppress(trio.BrokenResourceError):  # died at once: see below
                await process.stdin.send_all(struct.pack(">I", len(payload)) + payload)
            ready = await _read_ready(process.stdout)
            if ready:
                supervision.alive[spec.name] = True
                task_status.started()
            exit_code = await process.wait()
            supervision.alive[spec.name] = False
            # Give the pump a moment to read the last lines (the traceback).
            with trio.move_on_after(1.0):
                await tail.done.wait()
            nursery.cancel_scope.cancel()
        stage = "exited" if ready else "exited before it was ready"
        raise ActorFailed(spec.name, stage, exit_code=exit_code, stderr_tail=tail.text())
    finally:
        supervision.alive[spec.name] = False
        with trio.CancelScope(shield=True):
            await _stop_process(process, grace_period_s)


async def _read_ready(stdout: trio.abc.ReceiveStream) -> bool:
    received = b""
    while not received.endswith(b"\n"):
        chunk = await stdout.receive_some(64)
        if not chunk:
            return False
        received += chunk
    return received == _READY_LINE


async def _stop_process(process: trio.Process, grace_period_s: float) -> None:
    """SIGTERM, then SIGKILL after the grace period; always reaps the child."""
    if process.returncode is None:
        process.terminate()
        with trio.move_on_after(grace_period_s):
            await process.wait()
        if process.returncode is None:
            process.kill()
            await process.wait()
    for stream in (process.stdin, process.stdout, process.stderr):
        if stream is not None:
            await stream.aclose()


class _StderrTail:
    """Forwards a child's stderr to ours and keeps its last bytes for ActorFailed."""

    def __init__(self) -> None:
        self._tail = bytearray()
        self.done = trio.Event()

    async def pump(self, stream: trio.abc.ReceiveStream) -> None:
        try:
            while chunk := await stream.receive_some(65536):
                self._tail += chunk
                del self._tail[:-_STDERR_TAIL_BYTES]
                _write_stderr(chunk)
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            pass
        finally:
            self.done.set()

    def text(self) -> str:
        return self._tail.decode(errors="replace").strip()


def _write_stderr(chunk: bytes) -> None:
    # NOTE: a plain blocking write: log lines are small, and a stalled stderr
    # reader would stall the child (its pipe filling up) just the same.
    try:
        buffer = getattr(sys.stderr, "buffer", None)
        if buffer is not None:
            buffer.write(chunk)
        else:
            sys.stderr.write(chunk.decode(errors="replace"))
        sys.stderr.flush()
    except (OSError, ValueError):
        pass  # our own stderr is gone; the tail still reaches ActorFailed


# --- child side ---------------------------------------------------------------


def _read_spec(fd: int) -> ActorSpec:
    def read_exactly(num_bytes: int) -> bytes:
        data = b""
        while len(data) < num_bytes:
            chunk = os.read(fd, num_bytes - len(data))
            if not chunk:
                raise SystemExit("supervisor closed stdin before sending the actor spec")
            data += chunk
        return data

    (length,) = struct.unpack(">I", read_exactly(4))
    fields = msgpack.unpackb(read_exactly(length), raw=False)
    return ActorSpec(**fields)


async def _child_main(spec: ActorSpec, control_fd: int, parent_pid: int) -> None:
    target = resolve_target(spec.target)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_cancel_on_parent_exit, nursery.cancel_scope, parent_pid)
        nursery.start_soon(_cancel_on_sigterm, nursery.cancel_scope)

        async def run_target(*, task_status: trio.TaskStatus[None]) -> None:
            await target(spec.config, task_status=task_status)
            nursery.cancel_scope.cancel()

        await nursery.start(run_target)
        os.write(control_fd, _READY_LINE)


async def _cancel_on_parent_exit(scope: trio.CancelScope, parent_pid: int) -> None:
    async def stdin_eof() -> None:
        while True:
            await trio.lowlevel.wait_readable(0)
            if not os.read(0, 4096):
                return

    async def parent_gone() -> None:
        while os.getppid() == parent_pid:
            await trio.sleep(_PARENT_POLL_S)

    async with trio.open_nursery() as nursery:
        for watch in (stdin_eof, parent_gone):

            async def watch_then_cancel(watch=watch) -> None:
                await watch()
                nursery.cancel_scope.cancel()

            nursery.start_soon(watch_then_cancel)
    scope.cancel()


async def _cancel_on_sigterm(scope: trio.CancelScope) -> None:
    with trio.open_signal_receiver(signal.SIGTERM) as signals:
        async for _ in signals:
            scope.cancel()
            return


def main() -> None:
    """Entry point of a child process (``python -m trillium.actors.supervisor``)."""
    # Ctrl-C reaches the whole process group; the parent alone handles it and
    # stops the children in order.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent_pid = os.getppid()
    control_fd = os.dup(1)
    os.dup2(2, 1)
    spec = _read_spec(0)
    from trillium.observability import logs

    logs.configure_from_env(spec.name)
    from trillium.fast_exit import exit_now

    try:
        trio.run(_child_main, spec, control_fd, parent_pid)
    except SystemExit as exc:
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
        exit_now(exc.code if isinstance(exc.code, int) else 1)
    except BaseException:
        traceback.print_exc()  # the parent keeps the tail for ActorFailed
        exit_now(1)
    # The actor closed what it owns; skip the interpreter's teardown (fast_exit.py says why).
    exit_now(0)


if __name__ == "__main__":
    main()

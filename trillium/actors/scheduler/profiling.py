"""StartProfile / StopProfile across the engine's actors (pure bookkeeping).

The scheduler profiles its own loop (`observability.profiling.LoopProfiler`)
and forwards the command to the other actors named in it: the executor (as
a job, between two steps: torch.profiler) and the detokenizer (its own
LoopProfiler). `ProfileCoordinator` keeps the session (which actors, until
when) and gathers their answers: the api gets one reply, after the last
actor answered, listing every file written.

A session ends by StopProfile, or by itself at its deadline: each actor
then stops on its own clock and keeps its files for the next StopProfile;
a new StartProfile is allowed once the deadline has passed.
"""

from __future__ import annotations

import attrs

from trillium.actors.protocol.admin import ControlError, ControlReply, StartProfile, StopProfile
from trillium.observability.profiling import LoopProfiler, NotProfiling

PROFILED_ACTORS = ("executor", "scheduler", "detokenizer")


@attrs.define
class Gather:
    """One profile command's answers, by actor."""

    command_id: str
    waiting: set[str]  # actors not answered yet
    files: list[str] = attrs.Factory(list)
    errors: list[str] = attrs.Factory(list)
    status: int = 200

    def add(self, actor: str, reply: ControlReply) -> None:
        self.waiting.discard(actor)
        self.files.extend(reply.data.get("files", ()))
        if not reply.ok:
            self.status = max(self.status, reply.status)
            self.errors.append(f"{actor}: {reply.message}")


@attrs.define
class _Session:
    actors: tuple[str, ...]
    deadline: float


class ProfileCoordinator:
    def __init__(self, profiler: LoopProfiler) -> None:
        self.profiler = profiler  # the scheduler's own
        self.gather: Gather | None = None  # the command waiting for answers
        self._session: _Session | None = None

    @property
    def active(self) -> bool:
        return self._session is not None

    def start(self, msg: StartProfile, now: float) -> Gather:
        """Start our own profile; the Gather says whom to forward to."""
        actors = tuple(dict.fromkeys(msg.actors))
        if not actors or not set(actors) <= set(PROFILED_ACTORS):
            raise ControlError(400, f"actors must be a non-empty subset of {list(PROFILED_ACTORS)}")
        if msg.max_duration_s <= 0:
            raise ControlError(400, f"max_duration_s must be > 0, got {msg.max_duration_s}")
        if self._session is not None and now < self._session.deadline:
            raise ControlError(409, "a profile is already running: stop it first")
        if "scheduler" in actors:
            try:
                self.profiler.start(msg.profile_dir, now, msg.max_duration_s, python_profile=not msg.timeline)
            except OSError as exc:
                raise ControlError(400, f"cannot use profile_dir {msg.profile_dir!r}: {exc}") from None
        self._session = _Session(actors, now + msg.max_duration_s)
        return self._gather_for(msg, actors, [])

    def stop(self, msg: StopProfile) -> Gather:
        """Stop our own profile (its files go first in the Gather)."""
        if self._session is None:
            raise ControlError(409, "no profile is running: start one first")
        actors, self._session = self._session.actors, None
        files: list[str] = []
        if "scheduler" in actors:
            try:
                files = self.profiler.stop()
            except NotProfiling:
                pass  # a later session left the scheduler out: nothing of ours
        return self._gather_for(msg, actors, files)

    def answer(self, command_id: str, actor: str, reply: ControlReply) -> Gather | None:
        """Record an actor's answer; the Gather once all are in, else None.
        ValueError for an answer to no pending command."""
        gather = self.gather
        if gather is None or gather.command_id != command_id or actor not in gather.waiting:
            raise ValueError(f"unexpected {actor} reply {reply.command_id}")
        gather.add(actor, reply)
        if gather.waiting:
            return None
        self.gather = None
        return gather

    def _gather_for(self, msg, actors: tuple[str, ...], files: list[str]) -> Gather:
        gather = Gather(msg.command_id, {a for a in actors if a != "scheduler"}, files)
        self.gather = gather if gather.waiting else None
        return gather

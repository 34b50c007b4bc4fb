"""Liveness: every actor answers pings; the api watches the pongs and the engine's step progress.

"Process alive" (the supervisor's view) misses a stopped or wedged actor:
a SIGSTOPped executor, a step that never returns, a detokenizer stuck in a
loop. Two halves of one protocol (`Ping` / `Pong`, protocol/supervision.py):

- `PongSender`, in each engine actor: its `Mailbox` pump answers a `Ping`
  with `Pong(token, actor)` to the api inbox it was given. WHY the pump
  and not the actor's loop: the pump keeps running while the loop awaits a
  long torch step or control job, so a late pong means the process (or its
  trio loop) is frozen, not merely busy. A `Ping` whose `reply_to` is not
  the api inbox is dropped: a pong never goes to an address a message chose.
- `StallDetector` (api, pure): from the ping send times, the last pong of
  each actor and the last step progress (a `SchedulerStats` or
  `RequestOutputs` reaching the api), it names the stalled actor:
    * an actor that left a ping unanswered for `stall_timeout_s`;
    * else, with every ping answered, engine requests queued and the engine
      in a stepping state (serving, draining), no progress for
      `stall_timeout_s`: the executor
      when requests were running (its step did not come back), else the
      scheduler (it did not schedule).
  It counts stall onsets per actor (the `trillium:engine_stalls_total`
  metric) and clears when the actor answers / progress resumes.
- `watch_engine` (api, trio task): pings every actor each interval on its
  own sockets (never racing the client's sends), ticks the detector, and on
  each onset calls `on_stall(stall)` (`trillium serve` fails the open
  streams with an error) and aborts the requests it returns; /health says
  503 naming the actor while the stall lasts.

State: the detector's per-actor first unanswered ping and stall counts.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence

import attrs
import trio

from trillium.actors.protocol.requests import AbortRequest
from trillium.actors.protocol.supervision import Ping, Pong
from trillium.actors.transport import Outbox

log = logging.getLogger(__name__)

ENGINE_ACTORS = ("executor", "detokenizer", "scheduler")


class PongSender:
    """An actor's answer to pings: `Pong(token, actor)` to the api inbox, connected on first use."""

    def __init__(self, actor: str, api_address: str, connect: Callable[[], Outbox]) -> None:
        self.actor = actor
        self._address = api_address
        self._connect = connect  # a signed outbox to the api (links.Links.outbox("api"))
        self._outbox: Outbox | None = None

    async def answer(self, ping: Ping) -> None:
        if ping.reply_to != self._address:
            log.warning("%s: dropped a Ping asking for a reply to %r", self.actor, ping.reply_to)
            return
        if self._outbox is None:
            self._outbox = self._connect()
        # WHY move_on: a frozen api must not wedge this actor's inbox pump.
        with trio.move_on_after(1.0):
            await self._outbox.send(Pong(token=ping.token, actor=self.actor))

    def close(self) -> None:
        if self._outbox is not None:
            self._outbox.close()


@attrs.frozen
class Stall:
    actor: str
    reason: str

    def __str__(self) -> str:
        return f"engine stalled: {self.actor} {self.reason}"


class StallDetector:
    """Pure: which actor is stalled, from ping times, pongs and step progress (trio clock seconds)."""

    def __init__(self, actors: Sequence[str], stall_timeout_s: float) -> None:
        self.stall_timeout_s = stall_timeout_s
        self._first_unanswered: dict[str, float | None] = {actor: None for actor in actors}
        self._progress_s = -math.inf  # last progress, or when work became due
        self._watching_since_s = -math.inf  # progress before this is start-up, not a stall
        self._latched: tuple[float, Stall] | None = None  # (onset, stall): latched until progress
        self.stall: Stall | None = None
        self.num_stalls: dict[str, int] = {actor: 0 for actor in actors}

    @property
    def actors(self) -> tuple[str, ...]:
        return tuple(self._first_unanswered)

    def watching_from(self, now: float) -> None:
        """The watch begins at `now`: earlier progress times count as `now`.

        WHY: the actors start together, and the scheduler reports its first stats
        while the executor is still loading; the step clock must not have run
        since then when the first request comes in."""
        self._watching_since_s = now

    def pinged(self, now: float, last_pong_s: Mapping[str, float]) -> None:
        """A ping went to every actor at `now`."""
        for actor, first in self._first_unanswered.items():
            if first is None or last_pong_s.get(actor, -math.inf) >= first:
                self._first_unanswered[actor] = now

    def check(self, now: float, *, last_pong_s: Mapping[str, float], last_progress_s: float,
              num_queued: int, steppable: bool, num_running: int) -> Stall | None:
        """The stall now (None: healthy); a new onset bumps `num_stalls`. Call once per tick."""
        stall = self._ping_stall(now, last_pong_s)
        if stall is None and (self._latched is not None or not self._awaiting_pong(last_pong_s)):
            stall = self._step_stall(now, last_progress_s, num_queued, steppable, num_running)
        if stall is not None and (self.stall is None or self.stall.actor != stall.actor):
            self.num_stalls[stall.actor] = self.num_stalls.get(stall.actor, 0) + 1
        self.stall = stall
        return stall

    def _awaiting_pong(self, last_pong_s: Mapping[str, float]) -> bool:
        """Some actor has a ping out that it has not answered yet.

        WHY a step stall waits for it: a frozen scheduler stops the steps too, and
        the step clock can run out before the ping one does; naming the executor
        then would be wrong. An actor that answers pings while the steps stop is
        the step stall's case."""
        return any(first is not None and last_pong_s.get(actor, -math.inf) < first
                   for actor, first in self._first_unanswered.items())

    def _ping_stall(self, now: float, last_pong_s: Mapping[str, float]) -> Stall | None:
        for actor, first in self._first_unanswered.items():
            if first is None or last_pong_s.get(actor, -math.inf) >= first:
                continue
            if now - first > self.stall_timeout_s:
                return Stall(actor, f"did not answer a ping for {now - first:.1f} s")
        return None

    def _step_stall(self, now: float, last_progress_s: float, num_queued: int, steppable: bool,
                    num_running: int) -> Stall | None:
        if self._latched is not None and last_progress_s <= self._latched[0]:
            # INVARIANT: a step stall lasts until the engine shows progress, even once its
            # requests were failed and aborted (a hung step answers no abort either).
            return self._latched[1]
        self._latched = None
        if not num_queued or not steppable:
            self._progress_s = now  # nothing is due: the clock starts when work is
            return None
        self._progress_s = max(self._progress_s, last_progress_s, self._watching_since_s)
        idle_s = now - self._progress_s
        if idle_s <= self.stall_timeout_s:
            return None
        actor = "executor" if num_running else "scheduler"
        what = "step did not come back" if num_running else "no step was scheduled"
        stall = Stall(actor, f"made no progress for {idle_s:.1f} s with {num_queued} requests queued ({what})")
        self._latched = (now, stall)
        return stall


async def watch_engine(client, detector: StallDetector, connect: Callable[[str], Outbox], *,
                       ping_interval_s: float, steppable: Callable[[], bool],
                       on_stall: Callable[[Stall], Sequence[str]],
                       active: Callable[[], bool] = lambda: True) -> None:
    """Ping each actor (`connect(name)`: a signed outbox to its inbox) every interval; at each onset call
    `on_stall`, and abort the engine requests it returns (the streams it failed).
    While `active()` is false (an actor died: the supervisor's failure path owns the
    streams, and the survivors go quiet as they stop) nothing is judged."""
    outboxes = {actor: connect(actor) for actor in detector.actors}
    detector.watching_from(trio.current_time())
    token = 0
    try:
        while True:
            token += 1
            for outbox in outboxes.values():
                with trio.move_on_after(ping_interval_s):  # a full socket (frozen peer) is a late pong anyway
                    await outbox.send(Ping(token=token, reply_to=client.config.addresses.api))
            detector.pinged(trio.current_time(), client.last_pong_s)
            await trio.sleep(ping_interval_s)
            if not active():
                continue
            before = detector.stall
            stats = client.last_stats
            stall = detector.check(
                trio.current_time(), last_pong_s=client.last_pong_s, last_progress_s=client.last_progress_s,
                num_queued=client.num_active_requests, steppable=steppable(),
                num_running=stats.num_running if stats is not None else 0,
            )
            if stall is not None and (before is None or before.actor != stall.actor):
                log.error("%s", stall)
                aborted = on_stall(stall)
                if aborted:  # on our own socket: the client's may be waiting on a frozen scheduler
                    with trio.move_on_after(ping_interval_s):
                        await outboxes["scheduler"].send(AbortRequest(request_ids=tuple(aborted)))
            elif stall is None and before is not None:
                log.warning("engine recovered: %s answers and steps again", before.actor)
    finally:
        for outbox in outboxes.values():
            outbox.close()

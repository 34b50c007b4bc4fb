"""Control commands applied to the engine: the work behind each transition.

`EngineControl` is pure and synchronous, like the scheduler core it drives.
The scheduler loop (loop.py) hands it every lifecycle command
(protocol/admin.py) and every `ControlReply` from the executor or
detokenizer, and carries out the effects it returns, in order:

    ControlReply        -> api (the loop sends fresh SchedulerStats first)
    ToExecutor(message) -> executor
    ToDetokenizer(msg)  -> detokenizer

The idea: commands that change the engine take turns on one lane. A
command is first checked against the transition table in the current state
(409 at once if refused there). Then, if another command holds the lane
(it waits for the executor, a drain, or the end of the step in flight), it
queues, and is checked again and run when its turn comes, so every handler
sees a settled state. Exceptions: questions and scheduler-only chores
(GetEngineInfo, AbortRequests, ResetPrefixCache, SetWeightVersion) skip the lane, and Resume
or Pause(abort | keep) during a drain cut the drain short instead of
waiting for it (a Resume during a weight update's drain is answered at
once: there is no pause to undo).

One drain for every command that waits for requests: a wait-mode Pause or
Sleep, and a weight update sent while serving with `drain_timeout_s` (the
api's). Each sets a `_Drain` (what it waits for, what follows) and goes to
DRAINING; `executor_idle` sees it done and runs what follows. An update's
drain has a deadline: the actor wakes at `deadline` and calls
`deadline_passed`, which aborts what is left.

INVARIANT: the executor has at most one message outstanding (two steps with
--async-scheduling, never a job beside a step: `may_step_ahead`). A job (the
holder's executor work) is sent only from `executor_idle`, which the loop
calls only when no step is in flight, and no step is scheduled while a job
is pending (`may_step`). So sleep, wake and weight swaps run strictly
between two steps: no forward ever sees mixed weights or freed memory.
The one message outside that rule is an InitWeightsUpdateGroup: it takes
its turn on the lane but neither holds it nor becomes a job. It goes out
at once (`_joining`); the executor starts the rendezvous on a thread of
its own and answers when the trainer has joined or the timeout passed,
while steps and other commands go on (WHY: a rendezvous waits for another
process, up to its timeout; holding the executor for it froze every step).
The join touches nothing a step uses; the transfers over the group are an
UpdateWeightsFromDistributed job like any other.

NOTE on size (~645 lines): one class, because the lane, the job slot, the
drain and the state are one piece of state; each handler is a few lines
and they read in the order of the protocol. Profile bookkeeping lives in
profiling.py, the table in engine_state.py.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable
from functools import partial
from typing import Any

import attrs

from trillium.actors.protocol import admin as lc
from trillium.actors.protocol.admin import ControlError, ControlReply
from trillium.actors.protocol.outputs import SchedulerStats
from trillium.actors.protocol.vocabulary import ALL_WAKE_TAGS, EngineState, PauseMode, WakeTag
from trillium.actors.scheduler.engine_state import (
    RETURN,
    Op,
    next_state,
    next_weight_version,
    not_allowed_message,
    op_of,
)
from trillium.actors.scheduler.profiling import ProfileCoordinator
from trillium.observability.profiling import LoopProfiler

log = logging.getLogger(__name__)

S = EngineState
_OFF_LANE = (lc.GetEngineInfo, lc.AbortRequests, lc.ResetPrefixCache, lc.SetWeightVersion)


@attrs.frozen
class ToExecutor:
    message: Any


@attrs.frozen
class ToDetokenizer:
    message: Any


Effect = ControlReply | ToExecutor | ToDetokenizer


@attrs.define
class _Job:
    """Executor work of the lane holder: `prepare` runs when it is sent and
    returns the message to send (the built one, completed)."""

    message: Any
    done: Callable[[ControlReply], list[Effect]]
    prepare: Callable[[Any], Any] | None = None
    sent: bool = False


@attrs.define
class _Drain:
    """The drain in progress (state DRAINING) and what follows it.

    A wait-mode Pause / Sleep waits for the started requests (new ones wait
    in the queue). A weight update waits for every request the engine holds
    (WHY: a response reports the weight version current at its admission;
    the data plane refuses new ones meanwhile), at most until `deadline`,
    when the rest are aborted; a Resume does not cancel it (there is no
    pause to undo: the update just runs once drained)."""

    then: Callable[[EngineState], list[Effect]]  # called with the state to return to
    for_update: bool = False
    deadline: float = math.inf


def forwarded_id(command_id: str, actor: str) -> str:
    return f"{command_id}@{actor}"


def _pause_mode(mode: Any) -> PauseMode:
    """A command's mode as the enum; 400 naming the choices otherwise."""
    try:
        return PauseMode(mode)
    except ValueError:
        choices = tuple(m.value for m in PauseMode)
        raise ControlError(400, f"mode must be one of {choices}, got {mode!r}") from None


def _wake_tags(tags: Any) -> tuple[WakeTag, ...]:
    """A WakeUp's tags as enums; 400 unless a non-empty subset of WakeTag."""
    try:
        parsed = tuple(WakeTag(tag) for tag in tags)
    except ValueError:
        parsed = ()
    if not parsed:
        choices = [tag.value for tag in WakeTag]
        raise ControlError(400, f"tags must be a non-empty subset of {choices}, got {[str(t) for t in tags]}")
    return parsed


class EngineControl:
    def __init__(self, core, engine, profiler: LoopProfiler | None = None) -> None:
        self.core = core
        self.engine = engine  # EngineConfig: sizes and model path for lc.GetEngineInfo
        self.profiler = profiler or LoopProfiler("scheduler")
        self.profiling = ProfileCoordinator(self.profiler)
        self.state = S.SERVING
        self.weight_version = "0"
        self.model_path = engine.model
        # Speculative decoding's draft (draft model / EAGLE head): its own version, and what the
        # last weight update did to it (the executor's reply, speculative/draft_weights.py).
        self.draft_weight_version = "0"
        self.draft_model_path = engine.speculative_config.model
        self.draft_last_update: dict | None = None
        self.sleep_level = 0
        self.asleep: tuple[WakeTag, ...] = ()
        self.update_group: str | None = None
        self.mailbox_depth = 0  # set by the actor shell at each drain; reported in stats
        self._saved: dict[EngineState, EngineState] = {}  # where RETURN leads, by state
        self._queue: deque[Any] = deque()  # commands waiting for the lane
        self._holder: Any = None  # the command holding the lane
        self._job: _Job | None = None
        self._at_idle: list[Callable[[], list[Effect]]] = []  # run once no step is out
        self._drain: _Drain | None = None
        self._joining: lc.InitWeightsUpdateGroup | None = None  # out on the executor, not a job
        self._handlers: dict[type, Callable[[Any, float], list[Effect]]] = {
            lc.Pause: self._pause, lc.Resume: self._resume, lc.Sleep: self._sleep, lc.WakeUp: self._wake_up,
            lc.UpdateWeightsFromDisk: self._update, lc.UpdateWeightsFromTensors: self._update,
            lc.UpdateWeightsFromDistributed: self._update, lc.InitWeightsUpdateGroup: self._init_group,
            lc.DestroyWeightsUpdateGroup: self._destroy_group, lc.StartProfile: self._start_profile,
            lc.StopProfile: self._stop_profile, lc.GetEngineInfo: self._get_info,
            lc.AbortRequests: self._abort_requests, lc.ResetPrefixCache: self._reset_prefix_cache,
            lc.LoadLoRAAdapter: self._load_lora, lc.UnloadLoRAAdapter: self._unload_lora,
            lc.SetWeightVersion: self._set_weight_version,
        }

    COMMANDS = (
        lc.Pause, lc.Resume, lc.Sleep, lc.WakeUp, lc.UpdateWeightsFromDisk, lc.UpdateWeightsFromTensors,
        lc.UpdateWeightsFromDistributed, lc.InitWeightsUpdateGroup, lc.DestroyWeightsUpdateGroup,
        lc.StartProfile, lc.StopProfile, lc.LoadLoRAAdapter, lc.UnloadLoRAAdapter, *_OFF_LANE,
    )

    # -- views ------------------------------------------------------------

    @property
    def may_step(self) -> bool:
        return self.state in (S.SERVING, S.DRAINING) and self._job is None

    @property
    def may_step_ahead(self) -> bool:
        """--async-scheduling may send a second step while one runs: serving, and no command
        waits for the executor to go idle (WHY: with a step always ahead it never would;
        in_flight.py). A command arriving stops the planning ahead: the steps out drain first."""
        return (self.state is S.SERVING and self._job is None and self._holder is None
                and not self._queue and not self._at_idle)

    @property
    def executor_busy(self) -> bool:
        """A job is out on the executor (its reply is awaited)."""
        return self._job is not None and self._job.sent

    @property
    def profile_deadline(self) -> float:
        return self.profiler.deadline

    @property
    def deadline(self) -> float:
        """When the actor must call `deadline_passed`: the profile's end, an update drain's timeout."""
        drain = self._drain.deadline if self._drain is not None else math.inf
        return min(self.profiler.deadline, drain)

    def stats(self) -> SchedulerStats:
        return self.core.stats(engine_state=self.state, weight_version=self.weight_version,
                               mailbox_depth=self.mailbox_depth)

    def info(self) -> dict[str, Any]:
        core, engine = self.core, self.engine
        return {
            "state": self.state.value,
            "weight_version": self.weight_version,
            "is_sleeping": self.sleep_level > 0,
            "sleep_level": self.sleep_level,
            "asleep": list(self.asleep),
            "kv_usage": core.kv_usage,
            "num_running": core.num_running,
            "num_waiting": core.num_waiting,
            "num_free_blocks": core.num_free_blocks,
            "num_blocks": engine.num_blocks,
            "block_size": engine.block_size,
            "max_model_len": engine.max_model_len,
            "model_path": self.model_path,
            "served_model_name": engine.served_model_name,
            "dtype": engine.dtype,
            "device": engine.device,
            "weights_update_group": self.update_group,
            "weights_update_group_forming": self._joining.group_name if self._joining is not None else None,
            "profiling": self.profiling.active,
            "speculative": None if not engine.speculative_config.enabled else {
                "method": engine.speculative_config.method, "draft_model_path": self.draft_model_path or None,
                "draft_weight_version": self.draft_weight_version, "last_update": self.draft_last_update},
        }

    # -- inputs -------------------------------------------------------------

    def command(self, message: Any, now: float) -> list[Effect]:
        """A command from the api."""
        if isinstance(message, _OFF_LANE):
            return self._run(message, now)
        op = op_of(message)
        if next_state(self.state, op) is None:
            return [ControlError(409, not_allowed_message(self.state, op)).reply(message.command_id, self.info())]
        if self.state is S.DRAINING and op is Op.RESUME and self._drain.for_update:
            return [self._finish(message, "already serving: draining for a weight update")]
        if self.state is S.DRAINING and op in (Op.PAUSE, Op.RESUME):
            try:
                return self._cut_drain(message) + self._pump(now)
            except ControlError as exc:  # a bad mode: refused before anything changed
                return [exc.reply(message.command_id, self.info())]
        self._queue.append(message)
        return self._pump(now)

    def answer(self, reply: ControlReply, now: float) -> list[Effect]:
        """A ControlReply from the executor or the detokenizer."""
        command_id, _, actor = reply.command_id.rpartition("@")
        if actor == "detokenizer":
            return self._gathered(command_id, actor, reply) + self._pump(now)
        joining = self._joining
        if joining is not None and reply.command_id == forwarded_id(joining.command_id, "executor"):
            self._joining = None
            return self._group_changed(joining, joining.group_name, reply) + self._pump(now)
        job = self._job
        if job is None or not job.sent or job.message.command_id != reply.command_id:
            log.error("scheduler: unexpected executor reply %s", reply.command_id)
            return []
        self._job = None
        return job.done(reply) + self._pump(now)

    def executor_idle(self, now: float) -> list[Effect]:
        """No step and no job is out: finish drains and pauses, send the next job."""
        effects: list[Effect] = []
        while True:
            count = len(effects)
            if self.state is S.DRAINING and self._drained():
                self._apply(Op.DRAINED)
                drain, self._drain = self._drain, None
                effects += drain.then(S.SERVING)
            calls, self._at_idle = self._at_idle, []
            for call in calls:
                effects += call()
            effects += self._pump(now)
            if self._job is not None and not self._job.sent:
                if self._job.prepare is not None:
                    self._job.message = self._job.prepare(self._job.message)
                self._job.sent = True
                effects.append(ToExecutor(self._job.message))
                return effects
            if len(effects) == count:
                return effects

    def profile_expired(self, now: float) -> None:
        self.profiler.expire(now)

    def deadline_passed(self, now: float) -> None:
        """`deadline` came: stop the profile, or abort what an update drain still waits for
        (their abort deltas go out before the update: the actor flushes them first)."""
        self.profile_expired(now)
        drain = self._drain
        if drain is not None and now >= drain.deadline:
            drain.deadline = math.inf
            ids = self.core.request_ids()
            # WHY abort rather than update under them: they would go on sampling from the new weights.
            log.warning("weight update: %d requests still in flight after the drain timeout; aborting them",
                        len(ids))
            self.core.abort(ids)

    # -- the lane -------------------------------------------------------------

    def _pump(self, now: float) -> list[Effect]:
        effects: list[Effect] = []
        while self._holder is None and self._queue:
            effects += self._run(self._queue.popleft(), now)
        return effects

    def _run(self, message: Any, now: float) -> list[Effect]:
        try:
            return self._handlers[type(message)](message, now)
        except ControlError as exc:
            self._release(message)
            return [exc.reply(message.command_id, self.info())]

    def _start_drain(self, drain: _Drain) -> None:
        self._drain = drain  # first: _apply reads what the drain admits
        self._apply(Op.DRAIN)

    def _drained(self) -> bool:
        if self._drain.for_update:
            return not self.core.request_ids()
        return not self.core.has_started_requests()

    def _cut_drain(self, message: lc.Pause | lc.Resume) -> list[Effect]:
        """lc.Resume, or lc.Pause(abort | keep), while a wait-mode lc.Pause / lc.Sleep
        (or, for a pause, a weight update) drains."""
        mode = _pause_mode(message.mode) if isinstance(message, lc.Pause) else None
        holder, then = self._holder, self._drain.then
        self._drain = None
        if isinstance(message, lc.Resume):
            self._apply(Op.RESUME)
            self._release(holder)
            cancelled = ControlError(409, f"{type(holder).__name__} (mode wait) cancelled by resume")
            return [cancelled.reply(holder.command_id, self.info()), self._finish(message, "serving")]
        self._apply(Op.PAUSE)
        aborted = self._abort_all() if mode is PauseMode.ABORT else 0
        # The drain's own command carries on from PAUSED (a sleep sleeps, an
        # update updates); both answer once the step in flight is done.
        self._at_idle.append(lambda: then(S.PAUSED))
        self._at_idle.append(lambda: self._paused(message, mode, aborted))
        return []

    def _hold(self, message: Any, job: _Job | None = None) -> None:
        self._holder = message
        self._job = job

    def _release(self, message: Any) -> None:
        if self._holder is message:
            self._holder = None

    def _finish(self, message: Any, text: str, data: dict | None = None) -> ControlReply:
        self._release(message)
        return ControlReply(message.command_id, 200, text, {**self.info(), **(data or {})})

    def _failed(self, message: Any, reply: ControlReply) -> ControlReply:
        """An executor failure, passed on with its status."""
        self._release(message)
        return ControlReply(message.command_id, reply.status, reply.message, {**self.info(), **reply.data})

    # -- states -------------------------------------------------------------

    def _check(self, op: Op):
        target = next_state(self.state, op)
        if target is None:
            raise ControlError(409, not_allowed_message(self.state, op))
        return target

    def _apply(self, op: Op) -> None:
        target = self._check(op)
        if target is RETURN:
            target = self._saved.pop(self.state)
        elif target is not self.state:
            self._saved[target] = self.state
        self.state = target
        # An update's drain admits every request it waits for (_Drain).
        update_drain = self._drain is not None and self._drain.for_update
        self.core.set_admission(started_only=target is S.DRAINING and not update_drain)

    def _abort_all(self) -> int:
        ids = self.core.request_ids()
        self.core.abort(ids)
        return len(ids)

    # -- pause / resume -------------------------------------------------------

    def _pause(self, msg: lc.Pause, now: float) -> list[Effect]:
        mode = _pause_mode(msg.mode)
        if mode is PauseMode.WAIT:
            if self._check(Op.DRAIN) is self.state:
                return [self._finish(msg, f"already {self.state.value}")]
            self._start_drain(_Drain(lambda _: [self._finish(msg, "paused: the started requests finished")]))
            self._hold(msg)
            return []
        self._apply(Op.PAUSE)
        aborted = self._abort_all() if mode is PauseMode.ABORT else 0
        # WHY wait for idle: "paused" promises that no step is running.
        self._hold(msg)
        self._at_idle.append(lambda: self._paused(msg, mode, aborted))
        return []

    def _paused(self, msg: lc.Pause, mode: PauseMode, aborted: int) -> list[Effect]:
        # retract: between steps, every running request goes back to the queue
        # (its blocks freed, recomputed after the resume), as SGLang retracts.
        retracted = self.core.preempt_running() if mode is PauseMode.RETRACT else 0
        return [self._finish(msg, f"paused ({mode})", {"num_aborted": aborted, "num_retracted": retracted})]

    def _resume(self, msg: lc.Resume, now: float) -> list[Effect]:
        before = self.state
        self._apply(Op.RESUME)
        return [self._finish(msg, "already serving" if before is S.SERVING else "serving")]

    # -- sleep / wake ---------------------------------------------------------

    def _sleep(self, msg: lc.Sleep, now: float) -> list[Effect]:
        if msg.level not in (1, 2):
            raise ControlError(400, f"level must be 1 or 2, got {msg.level}")
        mode = _pause_mode(msg.mode)
        self._check(Op.SLEEP)
        before = self.state
        self._hold(msg)
        if mode is PauseMode.WAIT and before is S.SERVING:
            # Drained: wake back to SERVING; cut short by a pause: to PAUSED.
            self._start_drain(_Drain(lambda return_to: self._begin_sleep(msg, return_to)))
            return []
        aborted = self._abort_all() if mode is PauseMode.ABORT else 0
        return self._begin_sleep(msg, before, aborted)

    def _begin_sleep(self, msg: lc.Sleep, return_to: EngineState, aborted: int = 0) -> list[Effect]:
        self._apply(Op.SLEEP)
        self._saved[S.SLEEPING] = return_to  # after a wait-sleep: SERVING, not PAUSED
        self.sleep_level = msg.level
        forwarded = lc.Sleep(forwarded_id(msg.command_id, "executor"), msg.level, PauseMode(msg.mode))
        self._job = _Job(forwarded, partial(self._slept, msg, aborted), prepare=self._forget_kv)
        return []

    def _forget_kv(self, forwarded: lc.Sleep) -> lc.Sleep:
        """The KV content is about to be freed: running requests recompute
        after the wake, and no device prefix-cache entry may point into it.
        With --sleep-keep-prefix-cache a level-1 sleep first spills the cached
        blocks to the host tier (kept); the copies travel in the Sleep and the
        executor runs them before it frees the cache."""
        self.core.preempt_running()
        if not self._keeps_prefix_cache(forwarded.level):
            # The disk tier stays: the weights that computed its blocks are unchanged.
            self.core.reset_prefix_cache(keep_disk=True)
            return forwarded
        # The disk operations go too (host evictions written out, reads of
        # loading requests): the executor runs them first.
        return attrs.evolve(forwarded, keep_prefix_cache=True, kv=self.core.spill_prefix_cache())

    def _keeps_prefix_cache(self, level: int) -> bool:
        return self.engine.sleep_keep_prefix_cache and level == 1 and self.core.can_keep_prefix_cache

    def _slept(self, msg: lc.Sleep, aborted: int, reply: ControlReply) -> list[Effect]:
        if not reply.ok:
            if self._keeps_prefix_cache(msg.level):
                self.core.drop_kept_prefix_cache()
            self.state = self._saved.pop(S.SLEEPING)
            self.core.set_admission(started_only=False)
            self.sleep_level = 0
            return [self._failed(msg, reply)]
        self.asleep = tuple(WakeTag(tag) for tag in reply.data.get("asleep", ALL_WAKE_TAGS))
        return [self._finish(msg, f"sleeping at level {msg.level}", {**reply.data, "num_aborted": aborted})]

    def _wake_up(self, msg: lc.WakeUp, now: float) -> list[Effect]:
        tags = _wake_tags(msg.tags)
        self._check(Op.WAKE_UP)
        if self.state is not S.SLEEPING:
            return [self._finish(msg, f"already awake ({self.state.value})")]
        forwarded = lc.WakeUp(forwarded_id(msg.command_id, "executor"), tags)
        self._hold(msg, _Job(forwarded, partial(self._woken, msg)))
        return []

    def _woken(self, msg: lc.WakeUp, reply: ControlReply) -> list[Effect]:
        if not reply.ok:
            return [self._failed(msg, reply)]
        self.asleep = tuple(WakeTag(tag) for tag in reply.data.get("asleep", ()))
        if not self.asleep:
            self._apply(Op.WOKEN)
            self.sleep_level = 0
            return [self._finish(msg, f"awake ({self.state.value})", reply.data)]
        return [self._finish(msg, f"still asleep: {list(self.asleep)}", reply.data)]

    # -- weights ----------------------------------------------------------------

    def _update(self, msg, now: float) -> list[Effect]:
        if isinstance(msg, lc.UpdateWeightsFromDistributed):
            self._check_group_name(msg.group_name)
        self._check(Op.UPDATE_WEIGHTS)
        self._hold(msg)
        num_requests = len(self.core.request_ids())
        if msg.drain_timeout_s is not None and self.state is S.SERVING and num_requests:
            # WHY only from SERVING: a paused engine is not drained; the operator
            # chose what happens to its requests (keep: they resume on the new weights).
            log.info("weight update: waiting for %d requests in flight", num_requests)
            self._start_drain(_Drain(partial(self._begin_update, msg), for_update=True,
                                     deadline=now + msg.drain_timeout_s))
            return []
        return self._begin_update(msg, None)

    def _begin_update(self, msg, return_to: EngineState | None) -> list[Effect]:
        self._apply(Op.UPDATE_WEIGHTS)
        if return_to is not None:
            self._saved[S.UPDATING_WEIGHTS] = return_to  # after a drain: SERVING, not PAUSED
        forwarded = attrs.evolve(msg, command_id=forwarded_id(msg.command_id, "executor"))
        self._hold(msg, _Job(forwarded, partial(self._updated, msg)))
        return []

    def _updated(self, msg, reply: ControlReply) -> list[Effect]:
        self._apply(Op.UPDATE_DONE)
        if not reply.ok:
            if reply.data.get("group_closed"):
                self.update_group = None
            return [self._failed(msg, reply)]  # the executor kept the old weights
        self.draft_last_update = reply.data.get("draft")
        if getattr(msg, "draft_model_only", False):
            return self._draft_updated(msg, reply)
        self.weight_version = msg.weight_version or next_weight_version(self.weight_version)
        if msg.flush_cache:
            self.core.reset_prefix_cache(weight_version=self.weight_version)
        else:
            # WHY even unflushed: blocks computed by the new weights must not land in
            # the files a restart (which loads the checkpoint again) would read.
            self.core.reset_disk_tier(self.weight_version)
        if isinstance(msg, lc.UpdateWeightsFromDisk):
            self.model_path = msg.model_path
        return [self._finish(msg, f"weights updated (version {self.weight_version})", reply.data)]

    def _draft_updated(self, msg, reply: ControlReply) -> list[Effect]:
        """The draft's own weights changed: its version moves; the target's and its KV do not."""
        self.draft_weight_version = msg.weight_version or next_weight_version(self.draft_weight_version)
        if msg.flush_cache:  # asked for; the target's prefix cache is still valid (kept version)
            self.core.reset_prefix_cache(weight_version=self.weight_version)
        if isinstance(msg, lc.UpdateWeightsFromDisk):
            self.draft_model_path = msg.model_path
        data = {**reply.data, "draft_weight_version": self.draft_weight_version}
        return [self._finish(msg, f"draft weights updated (version {self.draft_weight_version})", data)]

    def _init_group(self, msg: lc.InitWeightsUpdateGroup, now: float) -> list[Effect]:
        self._check(Op.UPDATE_GROUP)
        if self.update_group is not None:
            raise ControlError(409, f"weights update group {self.update_group!r} is open: destroy it first")
        if self._joining is not None:
            raise ControlError(409, f"weights update group {self._joining.group_name!r} is being formed")
        # Not held, not a job: the executor joins off its step path (see the INVARIANT above).
        self._joining = msg
        return [ToExecutor(attrs.evolve(msg, command_id=forwarded_id(msg.command_id, "executor")))]

    def _destroy_group(self, msg: lc.DestroyWeightsUpdateGroup, now: float) -> list[Effect]:
        self._check(Op.UPDATE_GROUP)
        self._check_group_name(msg.group_name)
        forwarded = attrs.evolve(msg, command_id=forwarded_id(msg.command_id, "executor"))
        self._hold(msg, _Job(forwarded, partial(self._group_changed, msg, None)))
        return []

    def _check_group_name(self, group_name: str | None) -> None:
        """409 unless a group is open and (when the command names one, as SGLang's do) it is that one."""
        if self.update_group is None:
            forming = f" ({self._joining.group_name!r} is still being formed)" if self._joining is not None else ""
            raise ControlError(409, f"no weights update group is open{forming}: send init_weights_update_group first")
        if group_name is not None and group_name != self.update_group:
            raise ControlError(409, f"weights update group {group_name!r} is not open (open: {self.update_group!r})")

    def _group_changed(self, msg, group: str | None, reply: ControlReply) -> list[Effect]:
        if not reply.ok:
            return [self._failed(msg, reply)]
        self.update_group = group
        text = f"weights update group {group!r} is open" if group else "weights update group destroyed"
        return [self._finish(msg, text, reply.data)]

    # -- LoRA adapters --------------------------------------------------------------

    def _load_lora(self, msg: lc.LoadLoRAAdapter, now: float) -> list[Effect]:
        self._check(Op.LORA)
        if not self.core.config.max_loras:
            raise ControlError(400, "LoRA is not enabled: start the server with --enable-lora")
        if msg.lora_id < 1 or msg.lora_id in self.core.lora_ids:
            raise ControlError(409, f"LoRA adapter id {msg.lora_id} is already loaded")
        forwarded = attrs.evolve(msg, command_id=forwarded_id(msg.command_id, "executor"))
        self._hold(msg, _Job(forwarded, partial(self._lora_changed, msg)))
        return []

    def _unload_lora(self, msg: lc.UnloadLoRAAdapter, now: float) -> list[Effect]:
        self._check(Op.LORA)
        if msg.lora_id not in self.core.lora_ids:
            raise ControlError(404, f"LoRA adapter id {msg.lora_id} is not loaded")
        users = self.core.num_requests_using_lora(msg.lora_id)
        if users:
            raise ControlError(409, f"{users} requests still use LoRA adapter id {msg.lora_id}")
        forwarded = attrs.evolve(msg, command_id=forwarded_id(msg.command_id, "executor"))
        self._hold(msg, _Job(forwarded, partial(self._lora_changed, msg)))
        return []

    def _lora_changed(self, msg, reply: ControlReply) -> list[Effect]:
        if not reply.ok:
            return [self._failed(msg, reply)]
        if isinstance(msg, lc.LoadLoRAAdapter):
            self.core.lora_ids.add(msg.lora_id)
            text = f"LoRA adapter {msg.lora_name!r} loaded"
        else:
            self.core.lora_ids.discard(msg.lora_id)
            text = f"LoRA adapter id {msg.lora_id} unloaded"
        return [self._finish(msg, text, reply.data)]

    # -- profiling (bookkeeping in scheduler/profiling.py) -------------------------

    def _start_profile(self, msg: lc.StartProfile, now: float) -> list[Effect]:
        self._check(Op.PROFILE)
        return self._forward_profile(msg, self.profiling.start(msg, now))

    def _stop_profile(self, msg: lc.StopProfile, now: float) -> list[Effect]:
        self._check(Op.PROFILE)
        return self._forward_profile(msg, self.profiling.stop(msg))

    def _forward_profile(self, msg, gather) -> list[Effect]:
        if not gather.waiting:
            return [self._finish(msg, "ok", {"files": gather.files})]
        self._hold(msg)
        effects: list[Effect] = []
        if "detokenizer" in gather.waiting:
            effects.append(ToDetokenizer(attrs.evolve(msg, command_id=forwarded_id(msg.command_id, "detokenizer"))))
        if "executor" in gather.waiting:
            forwarded = attrs.evolve(msg, command_id=forwarded_id(msg.command_id, "executor"))
            self._job = _Job(forwarded, partial(self._gathered, msg.command_id, "executor"))
        return effects

    def _gathered(self, command_id: str, actor: str, reply: ControlReply) -> list[Effect]:
        try:
            gather = self.profiling.answer(command_id, actor, reply)
        except ValueError as exc:
            log.error("scheduler: %s", exc)
            return []
        if gather is None:
            return []
        msg = self._holder
        if gather.status != 200:
            self._release(msg)
            return [ControlReply(command_id, gather.status, "; ".join(gather.errors), {"files": gather.files})]
        return [self._finish(msg, "ok", {"files": gather.files})]

    # -- off the lane ---------------------------------------------------------------

    def _get_info(self, msg: lc.GetEngineInfo, now: float) -> list[Effect]:
        return [ControlReply(msg.command_id, 200, self.state.value, self.info())]

    def _abort_requests(self, msg: lc.AbortRequests, now: float) -> list[Effect]:
        self._check(Op.ABORT_REQUESTS)
        if msg.request_ids is None:
            ids = self.core.request_ids()
        else:
            ids = [rid for rid in msg.request_ids if self.core.get_request(rid) is not None]
        self.core.abort(ids)
        return [ControlReply(msg.command_id, 200, f"aborted {len(ids)}", {**self.info(), "num_aborted": len(ids)})]

    def _set_weight_version(self, msg: lc.SetWeightVersion, now: float) -> list[Effect]:
        # NOTE: the disk KV tier keeps its directory: its blocks were computed by
        # these same weights, only their name changes.
        self.weight_version = msg.weight_version
        return [ControlReply(msg.command_id, 200, f"weight version {msg.weight_version!r}", self.info())]

    def _reset_prefix_cache(self, msg: lc.ResetPrefixCache, now: float) -> list[Effect]:
        self._check(Op.RESET_PREFIX_CACHE)
        dropped = self.core.reset_prefix_cache()
        return [ControlReply(msg.command_id, 200, f"dropped {dropped}", {**self.info(), "num_dropped": dropped})]

"""Engine lifecycle: one transition table (pure; no trio, no torch).

The engine is in exactly one `EngineState` (the protocol's enum,
`protocol/vocabulary.py`: the api and the data plane read it too). Every
control command is first reduced to an `Op` and looked up in
`TRANSITIONS[state][op]`: the entry is the next state, or `RETURN` (back
to the state saved on entering the current one), and a missing entry means
"not allowed now" (HTTP 409 naming the state). `scheduler/control.py` does
the work each transition implies.

    SERVING ──pause──────────────> PAUSED ──resume──> SERVING
       │ ──pause(wait)──> DRAINING ──drained──> PAUSED
       │ ──sleep──> SLEEPING ──wake_up (all tags awake)──> RETURN
       └──update_weights──> UPDATING_WEIGHTS ──update_done──> RETURN
    (PAUSED and SLEEPING may update weights too; see the table.)

The one drain: a wait-mode pause, a wait-mode sleep and a weight update
sent while serving (with `drain_timeout_s`) all go SERVING ──drain──>
DRAINING ──drained──> PAUSED; the sleep and the update then carry on from
PAUSED and RETURN to SERVING.

What each state means for requests:

    serving           admit and step
    draining          step the requests the drain waits for: the started ones
                      (pause, sleep: new ones wait) or every one (an update)
    paused            no steps; requests (frozen or new) wait in the queue
    sleeping          no steps; KV cache (and maybe weights) released
    updating_weights  no steps; the executor is swapping weights

The data plane answers 503 + Retry-After in every state but serving and
draining; offline callers simply wait.

Guards the table cannot express (they depend on arguments, not on state)
live in control.py: a wait-mode pause from SERVING becomes DRAIN; a wake
that leaves a tag asleep stays SLEEPING; waking weights discarded by a
level-2 sleep needs a weight update first (the executor answers 409).
"""

from __future__ import annotations

import enum
import re
from typing import Any, Final

from trillium.actors.protocol import admin as msg
from trillium.actors.protocol.vocabulary import EngineState, PauseMode

__all__ = ["RETURN", "TRANSITIONS", "EngineState", "Op", "next_state", "next_weight_version",
           "not_allowed_message", "op_of"]


class Op(enum.Enum):
    """A command, as far as the state machine is concerned."""

    PAUSE = "pause"  # Pause(abort | keep): stop stepping now
    DRAIN = "drain"  # Pause(wait), Sleep(wait), a serving update: finish requests first
    DRAINED = "drained"  # internal: the last request a drain waits for ended
    RESUME = "resume"
    SLEEP = "sleep"
    WAKE_UP = "wake_up"
    WOKEN = "woken"  # internal: the executor reports nothing asleep any more
    UPDATE_WEIGHTS = "update_weights"  # from disk, tensors or distributed
    UPDATE_DONE = "update_done"  # internal: the executor answered the update
    UPDATE_GROUP = "update_group"  # init / destroy the weights update group
    PROFILE = "profile"  # start / stop profile
    RESET_PREFIX_CACHE = "reset_prefix_cache"
    ABORT_REQUESTS = "abort_requests"
    GET_INFO = "get_info"
    LORA = "lora"  # load / unload a LoRA adapter


class _Return:
    def __repr__(self) -> str:
        return "RETURN"


RETURN: Final = _Return()
"""Table entry: back to the state saved when the current state was entered."""

S, O = EngineState, Op
# Ops every state accepts and that leave it unchanged: they touch only the
# scheduler's own bookkeeping, never the executor.
_ANYTIME = (O.RESET_PREFIX_CACHE, O.ABORT_REQUESTS, O.GET_INFO)


def _row(state: EngineState, **entries) -> dict[Op, EngineState | _Return]:
    row = {op: state for op in _ANYTIME}
    row.update({Op[name.upper()]: target for name, target in entries.items()})
    return row


TRANSITIONS: dict[EngineState, dict[Op, EngineState | _Return]] = {
    S.SERVING: _row(
        S.SERVING,
        pause=S.PAUSED, drain=S.DRAINING, resume=S.SERVING, sleep=S.SLEEPING,
        wake_up=S.SERVING,  # already awake: a no-op
        update_weights=S.UPDATING_WEIGHTS, update_group=S.SERVING, profile=S.SERVING, lora=S.SERVING,
    ),
    S.PAUSED: _row(
        S.PAUSED,
        pause=S.PAUSED,  # abort mode aborts what a keep-pause froze
        drain=S.PAUSED,  # nothing steps while paused: already drained
        resume=S.SERVING, sleep=S.SLEEPING, wake_up=S.PAUSED,
        update_weights=S.UPDATING_WEIGHTS, update_group=S.PAUSED, profile=S.PAUSED, lora=S.PAUSED,
    ),
    S.DRAINING: _row(
        S.DRAINING,
        pause=S.PAUSED,  # abort / keep end the drain at once
        drain=S.DRAINING, drained=S.PAUSED, resume=S.SERVING, wake_up=S.DRAINING,
        update_group=S.DRAINING, profile=S.DRAINING, lora=S.DRAINING,
        # WHY no sleep / update_weights: requests are still stepping; pause first.
    ),
    S.SLEEPING: _row(
        S.SLEEPING,
        wake_up=S.SLEEPING,  # the executor's answer decides (WOKEN)
        woken=RETURN,
        # WHY allowed: after a level-2 sleep an update is what refills the weights.
        update_weights=S.UPDATING_WEIGHTS,
        update_group=S.SLEEPING, profile=S.SLEEPING,
    ),
    S.UPDATING_WEIGHTS: _row(
        S.UPDATING_WEIGHTS,
        update_done=RETURN,
        # WHY nothing else: the executor is busy with the update; one at a time.
    ),
}
del S, O


def next_state(state: EngineState, op: Op) -> EngineState | _Return | None:
    """The table's entry; None when `op` is not allowed in `state`."""
    return TRANSITIONS[state].get(op)


_WHY_NOT = {
    EngineState.DRAINING: "wait for the pause to finish draining, or resume",
    EngineState.SLEEPING: "wake it up first",
    EngineState.UPDATING_WEIGHTS: "a weight update is in progress; retry when it ends",
    EngineState.PAUSED: "resume it first",
    EngineState.SERVING: "",
}


def not_allowed_message(state: EngineState, op: Op) -> str:
    """The 409 text: names the state, says what would make the command possible."""
    hint = _WHY_NOT.get(state, "")
    text = f"{op.value} is not allowed while the engine is {state.value}"
    return f"{text}: {hint}" if hint else text


_TRAILING_NUMBER = re.compile(r"^(.*?)(\d+)$")


def next_weight_version(previous: str) -> str:
    """The default version after an update: "7" -> "8", "step-9" -> "step-10",
    a version without a trailing number gets ".1" ("abc" -> "abc.1")."""
    match = _TRAILING_NUMBER.match(previous)
    if match is None:
        return f"{previous}.1"
    prefix, number = match.groups()
    return f"{prefix}{int(number) + 1}"


_OPS = {
    msg.Resume: Op.RESUME, msg.Sleep: Op.SLEEP, msg.WakeUp: Op.WAKE_UP,
    msg.UpdateWeightsFromDisk: Op.UPDATE_WEIGHTS, msg.UpdateWeightsFromTensors: Op.UPDATE_WEIGHTS,
    msg.UpdateWeightsFromDistributed: Op.UPDATE_WEIGHTS,
    msg.InitWeightsUpdateGroup: Op.UPDATE_GROUP, msg.DestroyWeightsUpdateGroup: Op.UPDATE_GROUP,
    msg.StartProfile: Op.PROFILE, msg.StopProfile: Op.PROFILE,
    msg.ResetPrefixCache: Op.RESET_PREFIX_CACHE, msg.AbortRequests: Op.ABORT_REQUESTS,
    msg.GetEngineInfo: Op.GET_INFO,
    msg.LoadLoRAAdapter: Op.LORA, msg.UnloadLoRAAdapter: Op.LORA,
}


def op_of(command: Any) -> Op:
    """The Op of an api command (protocol/admin.py). A wait-mode Pause
    drains; a wait-mode Sleep is a SLEEP that control.py drains first."""
    if isinstance(command, msg.Pause):
        return Op.DRAIN if command.mode == PauseMode.WAIT else Op.PAUSE
    return _OPS[type(command)]

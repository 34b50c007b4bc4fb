"""Who may send what to whom: the engine's sender policy, one table.

Each engine process has a *role* (its actor's name; the HTTP process is
"api"). Every frame names its sender's role in its link proof
(`actors/link_auth.py`), checked before anything is decoded; this table then
says which message types a receiver accepts from each role. A message type
a role may not send to that receiver is dropped and counted as
"forbidden", like any other rejected frame (`actors/gate.py`).

    receiver      sender        messages
    scheduler     api           AddRequest, AbortRequest, the lifecycle commands, Shutdown, Ping
                  detokenizer   FinishRequest, ControlReply (forwarded profile commands)
                  executor      BatchResult, AheadTokens, ExecutorFailed, ControlReply
    executor      scheduler     ExecuteBatch, forwarded lifecycle commands, Shutdown
                  api           Shutdown, Ping
    detokenizer   scheduler     TokenDeltas, StartProfile, StopProfile, Shutdown
                  api           Shutdown, Ping
    api           scheduler     SchedulerStats, ControlReply, FramesRejected, Pong
                  detokenizer   RequestOutputs, FramesRejected, Pong
                  executor      FramesRejected, Pong

Ping / Pong: the api's stall watchdog (actors/liveness.py); each actor's
mailbox answers an admitted Ping itself.

WHY only the api sends lifecycle commands to the scheduler: they are the
control plane's (admin token, path allow-lists); a forwarded command reaches
the executor from the scheduler alone, between two steps.

`MAX_MESSAGE_BYTES`: the cap on one received message (all its frames) per
receiver, also set as ``ZMQ_MAXMSGSIZE`` on its socket. The scheduler and
executor take weight uploads (UpdateWeightsFromTensors carries a whole
safetensors file), so their cap follows the control plane's body limit;
the api and detokenizer receive text, token ids and logprobs only.
"""

from __future__ import annotations

from trillium.actors.protocol import admin, execute, outputs, requests, supervision
from trillium.actors.protocol.rejections import FramesRejected

__all__ = ["MAX_MESSAGE_BYTES", "ROLES", "may_send", "sender_of"]

ROLES = ("api", "scheduler", "executor", "detokenizer")

_LIFECYCLE_COMMANDS = tuple(m for m in admin.MESSAGES if m is not admin.ControlReply)
# The commands the scheduler forwards to the executor (scheduler/control.py ToExecutor).
_EXECUTOR_COMMANDS = (
    admin.Sleep, admin.WakeUp, admin.UpdateWeightsFromDisk, admin.UpdateWeightsFromTensors,
    admin.UpdateWeightsFromDistributed, admin.InitWeightsUpdateGroup, admin.DestroyWeightsUpdateGroup,
    admin.StartProfile, admin.StopProfile, admin.LoadLoRAAdapter, admin.UnloadLoRAAdapter,
)  # fmt: skip

_ALLOWED: dict[str, dict[str, frozenset[type]]] = {
    "scheduler": {
        "api": frozenset(
            {requests.AddRequest, requests.AbortRequest, supervision.Shutdown, supervision.Ping,
             *_LIFECYCLE_COMMANDS}
        ),
        "detokenizer": frozenset({requests.FinishRequest, admin.ControlReply}),
        "executor": frozenset({execute.BatchResult, execute.AheadTokens, execute.ExecutorFailed,
                               admin.ControlReply}),
    },
    "executor": {
        "scheduler": frozenset({execute.ExecuteBatch, supervision.Shutdown, *_EXECUTOR_COMMANDS}),
        "api": frozenset({supervision.Shutdown, supervision.Ping}),
    },
    "detokenizer": {
        "scheduler": frozenset(
            {outputs.TokenDeltas, admin.StartProfile, admin.StopProfile, supervision.Shutdown}
        ),
        "api": frozenset({supervision.Shutdown, supervision.Ping}),
    },
    "api": {
        "scheduler": frozenset({outputs.SchedulerStats, admin.ControlReply, FramesRejected, supervision.Pong}),
        "detokenizer": frozenset({outputs.RequestOutputs, FramesRejected, supervision.Pong}),
        "executor": frozenset({FramesRejected, supervision.Pong}),
    },
}

# WHY 64 GiB + 1 MiB: the control plane's default body limit for a
# safetensors upload (control_plane/context.py DEFAULT_MAX_BODY_BYTES) plus
# room for the envelope. 1 GiB: the prompt logprobs of a full 128 K context
# with 20 top entries are ~60 MiB, and one step's TokenDeltas may carry
# several requests' first deltas. NOTE: a sender refuses (CodecError) a
# message over its receiver's cap.
_UPLOAD_BYTES = 64 * 2**30 + 2**20
MAX_MESSAGE_BYTES: dict[str, int] = {
    "scheduler": _UPLOAD_BYTES,
    "executor": _UPLOAD_BYTES,
    "detokenizer": 2**30,
    "api": 2**30,
}


def may_send(receiver: str, sender: str, message_type: type) -> bool:
    return message_type in _ALLOWED.get(receiver, {}).get(sender, ())


def sender_of(receiver: str, message_type: type) -> str:
    """The role that sends `message_type` to `receiver` (tests that play peers use it)."""
    for sender, types in _ALLOWED[receiver].items():
        if message_type in types:
            return sender
    raise KeyError(f"no role may send {message_type.__name__} to the {receiver}")

"""Control-plane commands under data parallelism: one command, every replica, one reply.

`fan_out(replicas, command, timeout_s)` sends the command to every serving
replica at once (each over its own EngineClient: its own sockets and link
secret), awaits all the replies and merges them into one `ControlReply`,
so the admin routes (control_plane/) do not know replicas exist.

Rules, per command (protocol/admin.py):

- every command goes to every serving replica; StartProfile gets a
  `replica-<i>` subdirectory of its profile_dir per replica, and the merged
  StopProfile reply lists every replica's files.
- all ok: replica 0's reply, with `data["replicas"]` = each replica's outcome
  (status, message, state, weight_version; all of its data for GetEngineInfo).
- some fail: the first failure's status; the message names each replica's
  outcome. A LoRA load that some replicas took is unloaded from them again
  (the adapter is on no replica). A weight update (disk, tensors, a version
  rename) that some replicas took leaves two versions on the server: then
  every replica is paused (mode keep) and the reply says so; `Resume` is a 409
  while the replicas' versions differ: the operator sends the update again
  (it reaches every replica), then resumes.
- the distributed update group (init / update / destroy) is refused with a
  400 under data parallelism: each replica's executor would need its own
  ranks in the trainer's group (SGLang's rank offsets), which is not built.

WHY a weight update is one version: the admin route closes admission for
the whole server (EngineStatus.closing) before the command reaches any
replica and reopens it after the last one answered; each replica drains the
requests it holds on the old weights first (scheduler/control.py). So no
request admitted after the call returned meets the old weights, and none
admitted before it meets the new ones (unless the engine was paused in mode
keep, as with one replica).
"""

from __future__ import annotations

import os

import attrs
import trio

from trillium.actors.protocol import admin as cmd
from trillium.actors.protocol.admin import ControlReply

WEIGHT_UPDATES = (cmd.UpdateWeightsFromDisk, cmd.UpdateWeightsFromTensors, cmd.SetWeightVersion)
GROUP_COMMANDS = (cmd.InitWeightsUpdateGroup, cmd.UpdateWeightsFromDistributed, cmd.DestroyWeightsUpdateGroup)


def refusal(command, num_replicas: int) -> ControlReply | None:
    """The reply for a command that is not served under data parallelism, else None."""
    if isinstance(command, GROUP_COMMANDS):
        return ControlReply(command.command_id, 400, (
            f"{type(command).__name__}: the distributed weight-update group is not supported with "
            f"--data-parallel-size {num_replicas} (each replica would need its own ranks in the trainer's "
            "group); push weights with /update_weights_from_disk or /update_weights_from_tensor, or serve "
            "with --data-parallel-size 1"))
    return None


def version_conflict(command, versions: dict[int, str]) -> ControlReply | None:
    """Resume while the replicas serve different weight versions: a 409 naming them."""
    if isinstance(command, cmd.Resume) and len(set(versions.values())) > 1:
        return ControlReply(command.command_id, 409, (
            f"replicas serve different weight versions ({_describe(versions)}) after a failed weight "
            "update: send the update again (it reaches every replica), then resume"),
            data={"state": "paused"})
    return None


def per_replica(command, replica: int):
    """The command as replica `replica` gets it."""
    if isinstance(command, cmd.StartProfile):
        return attrs.evolve(command, profile_dir=os.path.join(command.profile_dir, f"replica-{replica}"))
    return command


async def fan_out(clients: dict[int, object], command, timeout_s: float) -> dict[int, ControlReply]:
    """Send `command` to every client at once; {replica: its reply}."""
    replies: dict[int, ControlReply] = {}

    async def one(index: int, client) -> None:
        replies[index] = await client.control(per_replica(command, index), timeout_s)

    async with trio.open_nursery() as nursery:
        for index, client in clients.items():
            nursery.start_soon(one, index, client)
    return dict(sorted(replies.items()))


def merge(command, replies: dict[int, ControlReply]) -> ControlReply:
    """One reply for the route: see the module docstring."""
    first = next(iter(replies.values()))
    data = {**first.data, "replicas": [_replica_data(command, i, r) for i, r in replies.items()]}
    if isinstance(command, cmd.StopProfile):
        data["files"] = [f for r in replies.values() for f in r.data.get("files", [])]
    failed = {i: r for i, r in replies.items() if not r.ok}
    if not failed:
        return attrs.evolve(first, data=data)
    worst = next(iter(failed.values()))
    outcomes = "; ".join(f"replica {i}: {r.message or 'ok'}" if not r.ok else f"replica {i}: ok"
                         for i, r in replies.items())
    return ControlReply(command.command_id, worst.status, outcomes, data={**worst.data, "replicas": data["replicas"]})


def _replica_data(command, replica: int, reply: ControlReply) -> dict:
    """What the merged reply lists of one replica: all of GetEngineInfo's, the outcome of the rest."""
    if isinstance(command, cmd.GetEngineInfo):
        return {"replica": replica, "status": reply.status, **reply.data}
    keep = ("state", "weight_version", "files")
    return {"replica": replica, "status": reply.status, "message": reply.message,
            **{key: reply.data[key] for key in keep if key in reply.data}}


def versions_of(replies: dict[int, ControlReply]) -> dict[int, str]:
    return {i: str(r.data.get("weight_version")) for i, r in replies.items() if "weight_version" in r.data}


def _describe(versions: dict[int, str]) -> str:
    return ", ".join(f"replica {i}: {v!r}" for i, v in sorted(versions.items()))


def split_update_message(merged: ControlReply, versions: dict[int, str]) -> ControlReply:
    """The reply of a weight update some replicas took and some did not (they are paused now)."""
    message = (f"{merged.message}. The replicas now hold different weight versions ({_describe(versions)}): "
               "every replica is paused (mode keep) so none serves a mix; send the update again, then /resume")
    return attrs.evolve(merged, message=message, data={**merged.data, "state": "paused"})

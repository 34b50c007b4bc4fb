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
- the distributed update group: every rank of every replica joins the
  trainer's one group. Replica i of N (T tensor-parallel ranks each) gets
  the init with rank_offset + i * T, so its rank r is rank_offset + i * T + r:
  the layout slime gives N SGLang engines of T GPUs (THUDM/slime,
  slime/backends/megatron_utils/update_weight/update_weight_from_distributed.py:
  engine i at rank_offset i * T + 1, world_size N * T + 1). SGLang itself
  refuses the group with dp_size > 1 (sgl-project/sglang,
  python/sglang/srt/managers/tokenizer_manager.py asserts dp_size == 1); here
  a trainer sized for the whole server (world_size >= rank_offset + N * T,
  else a 400 naming the ranks) broadcasts each tensor once and every replica
  receives it. The init needs every replica serving (503 otherwise: the group
  could never form). `UpdateWeightsFromDistributed` is a weight update like
  the others (one version, split handling below).

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

WEIGHT_UPDATES = (cmd.UpdateWeightsFromDisk, cmd.UpdateWeightsFromTensors, cmd.SetWeightVersion,
                  cmd.UpdateWeightsFromDistributed)


def refusal(command, num_replicas: int, ranks_per_replica: int, failed: dict[int, str]) -> ControlReply | None:
    """The reply for a command that cannot be served as sent under data parallelism, else None."""
    if not isinstance(command, cmd.InitWeightsUpdateGroup):
        return None
    needed = num_replicas * ranks_per_replica
    last = command.rank_offset + needed - 1
    if last >= command.world_size:
        return ControlReply(command.command_id, 400, (
            f"world_size {command.world_size} leaves no room for the {needed} ranks of "
            f"--data-parallel-size {num_replicas} x --tensor-parallel-size {ranks_per_replica} from rank_offset "
            f"{command.rank_offset} (ranks {command.rank_offset}..{last} join; the trainer's world_size is "
            f"{command.rank_offset + needed})"))
    if failed:
        return ControlReply(command.command_id, 503, (
            "the weight-update group needs every replica's ranks, and "
            + "; ".join(f"replica {i}: {why}" for i, why in sorted(failed.items()))))
    return None


def version_conflict(command, versions: dict[int, str]) -> ControlReply | None:
    """Resume while the replicas serve different weight versions: a 409 naming them."""
    if isinstance(command, cmd.Resume) and len(set(versions.values())) > 1:
        return ControlReply(command.command_id, 409, (
            f"replicas serve different weight versions ({_describe(versions)}) after a failed weight "
            "update: send the update again (it reaches every replica), then resume"),
            data={"state": "paused"})
    return None


def per_replica(command, replica: int, ranks_per_replica: int = 1):
    """The command as replica `replica` gets it."""
    if isinstance(command, cmd.StartProfile):
        return attrs.evolve(command, profile_dir=os.path.join(command.profile_dir, f"replica-{replica}"))
    if isinstance(command, cmd.InitWeightsUpdateGroup):
        return attrs.evolve(command, rank_offset=command.rank_offset + replica * ranks_per_replica)
    return command


async def fan_out(clients: dict[int, object], command, timeout_s: float,
                  ranks_per_replica: int = 1) -> dict[int, ControlReply]:
    """Send `command` to every client at once; {replica: its reply}."""
    replies: dict[int, ControlReply] = {}

    async def one(index: int, client) -> None:
        replies[index] = await client.control(per_replica(command, index, ranks_per_replica), timeout_s)

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

"""Tensor parallelism in the executor: every step and command reaches every rank once.

    rank 0 (executor/actor.py)     RankFanout.step(batch) / .command(msg, handle); OneRank without TP
    ranks 1.. (`run`, own process) receive -> execute / handle -> receive ...

WHY a broadcast from rank 0 over torch.distributed (not a ZeroMQ fan-out
from the scheduler): the scheduler, the protocol, the links and the block
pool stay as they are for one rank (one executor inbox, one `BatchResult`,
one block id space), and the ranks' order of steps is rank 0's by
construction: nothing can reach rank 1 before, after or without rank 0.
The cost is one re-encode of the message by the engine codec (no pickle)
and one gloo broadcast (two for a message over 16 KiB) on the step group
(`distributed/tp_group.py`); bench/scale_tp.py measures it per step (p50
0.6 ms for a 32-request decode step on the loaded 2-core CI box, where
every hand-off between processes waits for a core; vLLM's shared-memory
ring with busy polling would be faster and burn a core per rank).

What travels: `[tokens][codec frames...]` as one byte string. `tokens` are
the ids rank 0 sampled since the last broadcast, in its order: the other
ranks never sample (`compute_logits` gathers the vocab shards to rank 0), so
they append these to their copies of the requests before the next step
(`ExecutorCore.apply_sampled`). No frames: stop. The one frame HEARTBEAT:
answer `all_ok` (more than one host: an idle rank 0 checks every
HEARTBEAT_S that the other hosts' ranks are alive; a headless node's rank
returns on stop, which ends its process with 0).

Commands under TP:
- fanned out, run on every rank, answered once: Sleep, WakeUp (sleep/wake on
  every rank), UpdateWeightsFromDisk, UpdateWeightsFromTensors,
  UpdateWeightsFromDistributed (each rank slices the full tensors:
  `TpShard.shard`), DestroyWeightsUpdateGroup, LoadLoRAAdapter and
  UnloadLoRAAdapter (every rank reads the adapter and keeps its shard:
  lora/tensor_parallel.py). A rank that fails makes the reply a 500 naming it.
- InitWeightsUpdateGroup: every rank joins the trainer's group, rank r at
  `rank_offset + r` (SGLang's convention: the trainer counts world_size =
  1 + tp_size; under --data-parallel-size the api has already moved
  rank_offset by replica * tp_size: data_parallel/control.py); rank 0
  answers when its join ends. A world_size that leaves
  no room for every rank is a 400.
- StartProfile / StopProfile: run on every rank, each rank's trace is its
  own file (`executor-rank<r>-<pid>-<stamp>`, `profiling.TorchProfiler`),
  and rank 0 answers with every rank's files: the ranks' outcomes travel as
  JSON blobs in one all-gather on the step group (`gather_outcomes`). A
  follower's profile that outlives max_duration_s ends at the next message
  it receives (it has no clock of its own while idle); the next StopProfile
  hands out its file either way.
"""

from __future__ import annotations

import json
import logging
import math
import struct
from collections.abc import Awaitable, Callable
from functools import partial

import attrs

import numpy as np
import trio

from trillium.actors.protocol.admin import (
    ControlReply,
    DestroyWeightsUpdateGroup,
    InitWeightsUpdateGroup,
    LoadLoRAAdapter,
    Sleep,
    StartProfile,
    StopProfile,
    UnloadLoRAAdapter,
    UpdateWeightsFromDisk,
    UpdateWeightsFromDistributed,
    UpdateWeightsFromTensors,
    WakeUp,
)
from trillium.actors.protocol.execute import ExecuteBatch
from trillium.distributed.nodes import local_rank

log = logging.getLogger(__name__)

# More than one host: an idle rank 0 checks every this often that every rank still answers
# (a host that died closes its connections: the check fails at once; one that hangs: after
# --tp-collective-timeout-s). Its broadcast is this one frame, never a codec message.
HEARTBEAT_S = 2.0
HEARTBEAT = b"trillium-tp-heartbeat"

FANNED_OUT = (Sleep, WakeUp, UpdateWeightsFromDisk, UpdateWeightsFromTensors, UpdateWeightsFromDistributed,
              DestroyWeightsUpdateGroup, LoadLoRAAdapter, UnloadLoRAAdapter)
# Run on every rank; the reply lists every rank's files (each rank writes its own trace).
PER_RANK_FILES = (StartProfile, StopProfile)


def gather_outcomes(tp, reply: ControlReply) -> list[dict]:
    """Every rank's {status, message, files} for one command, on every rank (JSON: no pickle)."""
    mine = {"status": reply.status, "message": reply.message, "files": [str(f) for f in reply.data.get("files", [])]}
    return [json.loads(blob) for blob in tp.all_gather_blobs(json.dumps(mine).encode())]


def merge_outcomes(message, reply: ControlReply, outcomes: list[dict]) -> ControlReply:
    """Rank 0's reply with every rank's files; a 500 naming the ranks that failed where rank 0 did not."""
    if reply.status != 200:
        return reply
    failed = {rank: o["message"] for rank, o in enumerate(outcomes) if rank > 0 and o["status"] != 200}
    if failed:
        return ControlReply(message.command_id, 500, f"{type(message).__name__} failed on tensor-parallel "
                            f"rank(s) {sorted(failed)} after it succeeded on rank 0: {failed}")
    files = [path for outcome in outcomes for path in outcome["files"]]
    return ControlReply(message.command_id, reply.status, reply.message, {**reply.data, "files": files})


def pack(tokens: np.ndarray, frames) -> bytes:
    """[count][len, bytes]*: frame 0 the tokens (int32), then the codec's frames."""
    parts = [np.ascontiguousarray(tokens, dtype=np.int32).tobytes(), *(bytes(f) for f in frames)]
    out = [struct.pack("<I", len(parts))]
    for part in parts:
        out.append(struct.pack("<Q", len(part)))
        out.append(part)
    return b"".join(out)


def unpack(payload: bytes) -> tuple[np.ndarray, list[bytes]]:
    view = memoryview(payload)
    (count,) = struct.unpack_from("<I", view, 0)
    offset, parts = 4, []
    for _ in range(count):
        (length,) = struct.unpack_from("<Q", view, offset)
        offset += 8
        parts.append(bytes(view[offset : offset + length]))
        offset += length
    return np.frombuffer(parts[0], dtype=np.int32), parts[1:]


class OneRank:
    """No tensor parallelism: run here, nothing to reach."""

    heartbeat_s = math.inf  # no rank on another host to watch

    def __init__(self, core) -> None:
        self.core = core

    def heartbeat(self) -> None:
        pass

    def step(self, batch: ExecuteBatch):
        return self.core.execute(batch)

    async def command(self, message, handle: Callable[[object], Awaitable[ControlReply | None]], torch_thread):
        return await handle(message)

    def stop(self) -> None:
        pass


class RankFanout(OneRank):
    """Rank 0 of a tensor-parallel group: broadcast, then run the same thing here."""

    def __init__(self, core, codec) -> None:
        super().__init__(core)
        self.codec = codec
        self.size = core.tp.size
        # More than one host: no supervisor here watches the other hosts' ranks (distributed/nodes.py).
        if core.config.tp_nnodes > 1:
            self.heartbeat_s = HEARTBEAT_S

    def _broadcast(self, message, frames=None) -> None:
        tokens, self.core.last_sampled = self.core.last_sampled, np.zeros(0, np.int32)
        if frames is None:
            frames = () if message is None else self.codec.encode(message)
        self.core.tp.broadcast_bytes(pack(tokens, frames))

    def heartbeat(self) -> None:
        """Every rank answers within the collective timeout, or this raises (the engine then stops)."""
        self._broadcast(None, frames=[HEARTBEAT])
        self.core.tp.all_ok(True, timeout_s=self.core.config.tp_collective_timeout_s)

    def step(self, batch: ExecuteBatch):
        self._broadcast(batch)
        return self.core.execute(batch)

    async def command(self, message, handle, torch_thread):
        if isinstance(message, InitWeightsUpdateGroup):
            if message.rank_offset + self.size > message.world_size:
                return ControlReply(message.command_id, 400,
                                    f"world_size {message.world_size} leaves no room for the {self.size} "
                                    f"tensor-parallel ranks from rank_offset {message.rank_offset} (ranks "
                                    f"{message.rank_offset}..{message.rank_offset + self.size - 1} join)")
            await torch_thread.run(self._broadcast, message)
            return await handle(message)  # every rank joins; rank 0 answers when its join ends
        if isinstance(message, PER_RANK_FILES):
            await torch_thread.run(self._broadcast, message)
            reply = await handle(message)
            outcomes = await torch_thread.run(gather_outcomes, self.core.tp, reply)
            return merge_outcomes(message, reply, outcomes)
        if not isinstance(message, FANNED_OUT):
            return await handle(message)
        await torch_thread.run(self._broadcast, message)
        reply = await handle(message)
        oks = await torch_thread.run(self.core.tp.all_ok, reply.status == 200)
        failed = [rank for rank, ok in enumerate(oks) if not ok and rank > 0]
        if failed and reply.status == 200:
            return ControlReply(message.command_id, 500,
                                f"{type(message).__name__} failed on tensor-parallel rank(s) {failed} (see their "
                                "log) after it succeeded on rank 0; the ranks may now differ: restart the server")
        return reply

    def stop(self) -> None:
        """Tell the other ranks to leave (shutdown)."""
        try:
            self._broadcast(None)
        except Exception:  # a rank already gone: nothing left to tell
            log.info("tensor-parallel stop: a rank is already gone")


async def run(config: bytes | None, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """A rank past the first (its own process, no ZeroMQ inbox): follow rank 0's broadcasts."""
    from trillium.actors.assembly import ActorConfig, engine_codec
    from trillium.actors.executor.control import ExecutorControl
    from trillium.actors.executor.core import ExecutorCore
    from trillium.actors.torch_thread import TorchThread

    cfg = ActorConfig.from_bytes(config)
    torch_thread = TorchThread(f"trillium-executor-rank{cfg.tp_rank}")
    core = await torch_thread.run(ExecutorCore, cfg.engine, cfg.tp_rank, cfg.link_key())
    control = ExecutorControl(core, torch_thread)
    codec = engine_codec()
    try:
        async with trio.open_nursery() as nursery:
            control.start(nursery, partial(_log_reply, cfg.tp_rank, "InitWeightsUpdateGroup"))
            task_status.started()
            await _follow(cfg.tp_rank, core, control, torch_thread, codec)
    finally:
        await control.aclose()
        torch_thread.close()


async def _follow(rank: int, core, control, torch_thread, codec) -> None:
    """Receive, then execute or handle, until cancelled."""
    while True:
        # WHY a thread of its own, abandoned on cancel: the wait has no end while the server idles.
        payload = await trio.to_thread.run_sync(core.tp.broadcast_bytes, None, abandon_on_cancel=True)
        tokens, frames = unpack(payload)
        await torch_thread.run(core.apply_sampled, tokens)
        if control.profile_deadline <= trio.current_time():  # a profile past max_duration_s: write it now
            await control.expire_profile()
        if frames == [HEARTBEAT]:
            await torch_thread.run(core.tp.all_ok, True)
            continue
        if not frames:  # rank 0 is shutting down: so is this process's supervisor
            log.info("tensor-parallel rank %d: rank 0 stopped", rank)
            if local_rank(rank, core.tp.size, core.config.tp_nnodes) != rank:
                # WHY return: on a headless node no api will stop this process; the actor's end
                # exits it with 0, which tells its supervisor (distributed/headless.py) that the
                # head node ended the engine.
                return
            await trio.sleep_forever()
        message = codec.decode(frames)
        if isinstance(message, ExecuteBatch):
            await torch_thread.run(core.execute, message)
            continue
        if isinstance(message, InitWeightsUpdateGroup):  # joins in the background; no vote
            reply = await control.handle(attrs.evolve(message, rank_offset=message.rank_offset + rank))
            if reply is not None:
                await _log_reply(rank, "InitWeightsUpdateGroup", reply)
            continue
        reply = await control.handle(message)
        if isinstance(message, PER_RANK_FILES):
            await torch_thread.run(gather_outcomes, core.tp, reply)
            continue
        if reply.status != 200:
            await _log_reply(rank, type(message).__name__, reply)
        await torch_thread.run(core.tp.all_ok, reply.status == 200)


async def _log_reply(rank: int, command: str, reply: ControlReply) -> None:
    """A rank past the first answers nobody: its outcome goes to the log (and rank 0's vote)."""
    if reply.status == 200:
        log.info("tensor-parallel rank %d: %s done", rank, command)
    else:
        log.error("tensor-parallel rank %d: %s failed: %s %s", rank, command, reply.status, reply.message)

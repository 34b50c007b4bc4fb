"""`ReplicaClient`: N engine replicas behind the one client the HTTP planes use.

`trillium serve --data-parallel-size N` builds one `EngineClient` per
replica (each with its own ipc:// sockets, its own link secret and its own
scheduler, executor and detokenizer processes) and hands the planes this
object instead: it has the EngineClient surface they call (`generate`,
`submit`, `abort`, `control`, `last_stats`, listeners, counts).

- requests: `router.ReplicaRouter` picks the replica (load with prefix
  affinity); every choice of an n > 1 request goes to the same replica
  (siblings share the prompt's blocks). Request ids are unique across
  replicas (checked here); `abort` goes to the owning replica.
- control commands: `control.fan_out` / `merge` (every serving replica, one
  reply, one weight version; see that module).
- stats: each replica's SchedulerStats goes to `stats_listeners` as it
  comes (events counted once); `last_stats` is an aggregate (sums of the
  gauges and totals, the mean KV usage, events empty) rebuilt on every
  message, so `EngineStatus` sees one engine. Its `engine_state` is the
  first replica's that is not serving (admission closes when any replica
  cannot serve), its `weight_version` the replicas' one, or their versions
  joined by "|" when they differ.
- failure: `replica_failed(i, reason)` takes replica i out of routing and
  of the command fan-out and ends its open streams with EngineFailed; the
  others keep serving (trillium serve decides; see server.py).

State: owner replica and token count of every unfinished engine request.
Everything runs on the api's trio loop: no locks.
"""

from __future__ import annotations

import contextlib
import functools

import attrs
import trio

from trillium.actors.protocol.admin import ControlReply, Pause
from trillium.actors.protocol.vocabulary import EngineState, PauseMode
from trillium.data_parallel import control as dp_control
from trillium.data_parallel.router import ReplicaRouter

_SUMMED = ("num_running", "num_waiting", "num_preempted_total", "num_free_blocks", "prefix_cache_queries_total",
           "prefix_cache_hits_total", "num_scheduled_tokens", "num_swapped_out_total", "num_swapped_in_total",
           "mailbox_depth")


class ReplicaClient:
    def __init__(self, replicas: list, router: ReplicaRouter) -> None:
        self.replicas = replicas
        self.router = router
        self.config = replicas[0].config
        self.stats_listeners: list = []
        self.finish_listeners: list = []
        self.last_stats = None
        self.failed: dict[int, str] = {}  # replica -> why it stopped serving
        self._owner: dict[str, tuple[int, int]] = {}  # engine request id -> (replica, routed tokens)
        for index, client in enumerate(replicas):
            client.stats_listeners.append(functools.partial(self._on_stats, index))
            client.finish_listeners.append(functools.partial(self._on_finish, index))

    # -- the EngineClient surface --

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            for client in self.replicas:
                await nursery.start(client.run)
            task_status.started()

    def close(self) -> None:
        for client in self.replicas:
            client.close()

    @property
    def live(self) -> list[int]:
        return [i for i in range(len(self.replicas)) if i not in self.failed]

    @property
    def mailbox_depth(self) -> int:
        return sum(client.mailbox_depth for client in self.replicas)

    @property
    def num_active_requests(self) -> int:
        return len(self._owner)

    def active_request_ids(self) -> list[str]:
        return list(self._owner)

    def requests_using_lora(self, lora_id: int) -> list[str]:
        return [rid for client in self.replicas for rid in client.requests_using_lora(lora_id)]

    def rejected_frames(self) -> dict[str, dict[str, int]]:
        return {f"{actor}@{i}": totals for i, client in enumerate(self.replicas)
                for actor, totals in client.rejected_frames().items()}

    def fail_all(self, reason: str, *, commands: bool = False) -> list[str]:
        ids = [rid for client in self.replicas for rid in client.fail_all(reason, commands=commands)]
        for rid in ids:
            self._forget(rid)
        return ids

    async def generate(self, request_id, prompt_token_ids, params, eos_token_ids, *, lora_id: int = 0,
                       cache_salt: str | None = None, **kwargs) -> list:
        ids = (request_id,) if params.n == 1 else tuple(f"{request_id}-{i}" for i in range(params.n))
        replica = self._route(ids, prompt_token_ids, params, lora_id, cache_salt)
        with self._unrouted_on_error(ids):
            return await self.replicas[replica].generate(request_id, prompt_token_ids, params, eos_token_ids,
                                                         lora_id=lora_id, cache_salt=cache_salt, **kwargs)

    async def submit(self, request_id, prompt_token_ids, params, eos_token_ids, *, lora_id: int = 0,
                     cache_salt: str | None = None, choice_ids=None, **kwargs):
        ids = choice_ids or (request_id,)
        replica = self._route(ids, prompt_token_ids, params, lora_id, cache_salt)
        with self._unrouted_on_error(ids):
            return await self.replicas[replica].submit(request_id, prompt_token_ids, params, eos_token_ids,
                                                       lora_id=lora_id, cache_salt=cache_salt,
                                                       choice_ids=choice_ids, **kwargs)

    async def abort(self, request_ids: list[str]) -> None:
        by_replica: dict[int, list[str]] = {}
        for rid in request_ids:
            owner = self._owner.get(rid)
            for replica in (owner[0],) if owner is not None else self.live:
                by_replica.setdefault(replica, []).append(rid)
        for replica, ids in by_replica.items():
            await self.replicas[replica].abort(ids)

    async def control(self, command, timeout_s: float = 300.0) -> ControlReply:
        live = self.live
        ranks = self.config.engine.tensor_parallel_size
        refused = dp_control.refusal(command, len(self.replicas), ranks, self.failed) or dp_control.version_conflict(
            command, {i: self.replicas[i].last_stats.weight_version for i in live
                      if self.replicas[i].last_stats is not None})
        if refused is not None:
            return refused
        if not live:
            return ControlReply(command.command_id, 503, "no replica is serving: " + self._failures())
        replies = await dp_control.fan_out({i: self.replicas[i] for i in live}, command, timeout_s, ranks)
        merged = dp_control.merge(command, replies)
        if merged.ok or len(replies) == 1:
            return merged
        took = [i for i, reply in replies.items() if reply.ok]
        if isinstance(command, dp_control.WEIGHT_UPDATES) and took:
            versions = {i: str(self.replicas[i].last_stats.weight_version) for i in replies
                        if self.replicas[i].last_stats is not None}
            await dp_control.fan_out({i: self.replicas[i] for i in replies},
                                     Pause(command.command_id + "-split", PauseMode.KEEP), timeout_s)
            return dp_control.split_update_message(merged, {**versions, **dp_control.versions_of(replies)})
        if isinstance(command, dp_control.cmd.LoadLoRAAdapter) and took:
            undo = dp_control.cmd.UnloadLoRAAdapter(command.command_id + "-undo", command.lora_id)
            await dp_control.fan_out({i: self.replicas[i] for i in took}, undo, timeout_s)
        return merged

    async def shutdown_engine(self) -> None:
        for client in self.replicas:
            await client.shutdown_engine()

    # -- data parallelism --

    def replica_failed(self, replica: int, reason: str) -> list[str]:
        """Replica `replica` stopped: route around it, end its open streams; their ids."""
        self.failed[replica] = reason
        return self.fail_replica_streams(replica, reason, commands=True)

    def fail_replica_streams(self, replica: int, reason: str, *, commands: bool = False) -> list[str]:
        """End replica `replica`'s open streams with EngineFailed (a stall: it may recover); their ids."""
        ids = self.replicas[replica].fail_all(reason, commands=commands)
        for rid in ids:
            self._forget(rid)
        return ids

    def replica_info(self) -> list[dict]:
        """Per replica: what /server_info lists."""
        info = []
        for i, client in enumerate(self.replicas):
            stats = client.last_stats
            info.append({
                "replica": i, "serving": i not in self.failed, "failure": self.failed.get(i),
                "engine_state": str(stats.engine_state) if stats else str(EngineState.SERVING),
                "weight_version": stats.weight_version if stats else "0",
                "num_running": stats.num_running if stats else 0, "num_waiting": stats.num_waiting if stats else 0,
                "kv_cache_usage": stats.kv_usage if stats else 0.0,
                "num_routed_requests": self.router.num_routed[i], "pending_tokens": self.router.pending_tokens[i],
                "device": client.config.engine.device,
                # another host's replica (data_parallel/remote.py): where its scheduler listens
                "remote": client.config.addresses.scheduler if client.config.addresses.scheduler.startswith(
                    "tcp://") else None,
            })
        return info

    def _route(self, ids, prompt, params, lora_id: int, cache_salt) -> int:
        taken = [rid for rid in ids if rid in self._owner]
        if taken:
            raise ValueError(f"request id {taken[0]!r} is already in use")
        live = self.live
        if not live:
            from trillium.actors.client import EngineFailed

            raise EngineFailed("no replica is serving: " + self._failures())
        replica, hashes = self.router.choose(prompt, (lora_id, cache_salt), live)
        self.router.remember(hashes, replica)
        tokens = len(prompt) + (params.max_tokens or 0)
        for rid in ids:
            self._owner[rid] = (replica, tokens)
            self.router.started(replica, tokens)
        return replica

    @contextlib.contextmanager
    def _unrouted_on_error(self, ids):
        """A request that did not reach its replica holds no load there."""
        try:
            yield
        except BaseException:
            for rid in ids:
                self._forget(rid)
            raise

    def _forget(self, request_id: str) -> None:
        owner = self._owner.pop(request_id, None)
        if owner is not None:
            self.router.finished(*owner)

    def _on_finish(self, replica: int, delta) -> None:
        self._forget(delta.request_id)
        for listener in self.finish_listeners:
            listener(delta)

    def _on_stats(self, replica: int, stats) -> None:
        self.router.observe_kv_usage(replica, stats.kv_usage)
        self.last_stats = self._aggregate(stats)
        for listener in self.stats_listeners:
            listener(stats)

    def _aggregate(self, latest):
        stats = [self.replicas[i].last_stats for i in self.live] or [latest]
        stats = [s if s is not None else latest for s in stats]
        versions = sorted({s.weight_version for s in stats})
        not_serving = [s.engine_state for s in stats if s.engine_state != EngineState.SERVING]
        return attrs.evolve(
            latest, **{field: sum(getattr(s, field) for s in stats) for field in _SUMMED},
            kv_usage=sum(s.kv_usage for s in stats) / len(stats), step_id=max(s.step_id for s in stats),
            engine_state=not_serving[0] if not_serving else EngineState.SERVING,
            weight_version="|".join(versions), finished=(), ttfts_s=(), itls_s=(), num_prompt_tokens=0,
            num_generation_tokens=0, step_tokens=(), step_durations_s=(), num_lora_swap_ins=0, kv_load_s=())

    def _failures(self) -> str:
        return "; ".join(f"replica {i}: {why}" for i, why in sorted(self.failed.items()))

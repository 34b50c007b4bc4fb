"""The processes of `trillium serve --data-parallel-size N`: N engine replicas, one api.

    trillium serve (api)   HTTP planes, tokenizer, ReplicaClient (router + fan-out)
      ├─ replica 0         <ipc dir>/r0/{scheduler,executor,detokenizer,api}, link secret 0
      │    ├─ executor     device cuda:0 (CPU: 1/N of the cores)
      │    ├─ detokenizer
      │    └─ scheduler
      └─ replica 1 ...     <ipc dir>/r1/..., link secret 1, cuda:1

With `--tensor-parallel-size T` each replica is a tensor-parallel engine:
executor (rank 0) and executor-rank1..T-1, on devices cuda:i*T .. i*T+T-1,
in a torch.distributed group of its own (its own store port). Commands reach
a replica's rank 0, which fans them out to its ranks (executor/tp_fanout.py).

`replica_configs` gives each replica its own ActorConfig: its own ipc://
addresses under a 0700 subdirectory of the server's ipc dir, a fresh link
secret (a frame signed for one replica is refused by every other), and its
own device. `ReplicaProcesses` supervises the replicas' actor groups (one
`server._EngineProcesses` each, started together) and decides what a
failure means:

    an actor of replica i dies -> replica i's actors are stopped (its group),
    its open streams end with an error naming it, pending commands get a 503,
    the router and the command fan-out skip it, /server_info shows it not
    serving; the other replicas keep serving. When the last replica is gone
    the server stops as a one-engine server does (exit code 1).

/health is 200 while every replica still serving is healthy (a stalled
one turns it 503, as with one engine) and at least one serves.
"""

from __future__ import annotations

import logging
import os

import attrs
import trio

from trillium.actors.assembly import ActorConfig, Addresses, free_loopback_ports
from trillium.actors.supervisor import Supervision
from trillium.config import EngineConfig

log = logging.getLogger("trillium.serve")


def replica_device(device: str, offset: int) -> str:
    """cuda -> cuda:<offset>, cuda:<k> -> cuda:<k + offset>; other devices are shared."""
    if device == "cuda":
        return f"cuda:{offset}"
    if device.startswith("cuda:"):
        return f"cuda:{int(device.split(':', 1)[1]) + offset}"
    return device


def replica_configs(engine: EngineConfig, ipc_dir: str, num_replicas: int) -> list[ActorConfig]:
    """One ActorConfig per replica (one replica: the server's ipc dir itself, as without DP)."""
    if num_replicas == 1:
        return [ActorConfig(engine, Addresses.ipc(ipc_dir))]
    # Tensor parallelism inside a replica (when the engine has it): replica i's ranks take the devices
    # from i * tp on (each rank r then adds r), and every rank of every replica shares the cores.
    ranks = engine.tensor_parallel_size
    threads = engine.num_threads
    if not threads and not engine.device.startswith("cuda"):
        threads = max(1, (os.cpu_count() or 1) // (num_replicas * ranks))  # WHY: not every core each
    # Each replica's ranks form their own torch.distributed group, on their own store port
    # (a port already set in the config, P: replica i on P + i).
    ports = [0] * num_replicas
    if ranks > 1:
        ports = ([engine.tp_master_port + i for i in range(num_replicas)] if engine.tp_master_port
                 else free_loopback_ports(num_replicas))
    configs = []
    for replica in range(num_replicas):
        directory = os.path.join(ipc_dir, f"r{replica}")
        os.mkdir(directory, 0o700)
        config = attrs.evolve(engine, device=replica_device(engine.device, replica * ranks), num_threads=threads,
                              tp_master_port=ports[replica])
        configs.append(ActorConfig(config, Addresses.ipc(directory)))  # a fresh link secret each
    return configs


class ReplicaProcesses:
    """The `_EngineProcesses` surface server.py uses, over N replicas (see the module docstring)."""

    def __init__(self, replicas: list, client, shutdown: trio.Event) -> None:
        self.replicas = replicas  # server._EngineProcesses, one per replica, built with on_failure=
        self._client = client  # data_parallel.client.ReplicaClient
        self._shutdown = shutdown
        self.failure = None

    @property
    def supervision(self) -> Supervision:
        alive, pids = {}, {}
        for index, replica in enumerate(self.replicas):
            alive.update({f"{name}@{index}": up for name, up in replica.supervision.alive.items()})
            pids.update({f"{name}@{index}": pid for name, pid in replica.supervision.pids.items()})
        return Supervision(alive=alive, pids=pids)

    @supervision.setter
    def supervision(self, value) -> None:  # WHY: server.py assigns what supervise() started with
        pass

    def replica_failed(self, index: int, exc) -> None:
        reason = f"replica {index}: engine actor {exc.name!r} failed"
        self._client.replica_failed(index, reason)
        if self._client.live:
            log.error("%s; %d replica(s) keep serving", reason, len(self._client.live))
            return
        self.failure = exc
        log.error("%s; no replica left: shutting down", reason)
        self._shutdown.set()

    def health(self) -> tuple[bool, object]:
        detail = {}
        ok = bool(self._client.live)
        for index, replica in enumerate(self.replicas):
            if index in self._client.failed:
                detail[f"replica {index}"] = self._client.failed[index]
                continue
            healthy, what = replica.health()
            ok = ok and healthy
            detail.update({f"{k}@{index}": v for k, v in what.items()} if isinstance(what, dict)
                          else {f"replica {index}": what})
        return ok, detail

    async def supervise(self, *, task_status) -> None:
        async with trio.open_nursery() as nursery:
            async def start(replica) -> None:
                replica.supervision = await nursery.start(replica.supervise)

            async with trio.open_nursery() as starting:  # WHY together: each replica loads for seconds
                for replica in self.replicas:
                    starting.start_soon(start, replica)
            task_status.started(self.supervision)

    def watch(self, nursery: trio.Nursery, steppable) -> None:
        for replica in self.replicas:
            replica.watch(nursery, steppable)

"""`trillium serve --headless --data-parallel-start-rank R ...`: a host that runs only data-parallel replicas.

    run_headless_replicas(engine, start_rank, local_size, api_host, rpc_port, secret) -> exit code

Replicas R..R+K-1 (K = --data-parallel-size-local) each run their scheduler,
executor and detokenizer here, as one process each under this process's
supervisor (as `trillium serve` runs them on the api host), their inboxes bound on
tcp://H:<free port> (H: this host's address on the route to the api host). First
one Hello (signed with the deployment secret) tells the api host at tcp://A:P
where they will listen (data_parallel/remote.py), so both hosts load at once.
Each replica's links use its own secret derived from the deployment's.

How it ends:
- the api host stops or dies: the tcp:// connection to a replica's api inbox drops
  (`remote.LinkWatch`, ZeroMQ heartbeats); this process stops its replicas, exit 0;
- an actor here dies: this process stops every replica here and exits 1; the api
  host sees the tcp:// links drop and fails these replicas' requests;
- SIGTERM / Ctrl-C: the actors are stopped, exit 0.
"""

from __future__ import annotations

import logging
import os

import trio

from trillium.actors.assembly import ActorConfig, engine_specs
from trillium.actors.supervisor import ActorFailed, run_in_subprocesses
from trillium.data_parallel import remote
from trillium.distributed.headless import API_SECRET_ENV_VARS, stop_on_signal

log = logging.getLogger("trillium.serve")



def run_headless_replicas(engine, start_rank: int, local_size: int, api_host: str, rpc_port: int,
                          secret: str) -> int:
    host = remote.host_towards(api_host, rpc_port)
    replicas = {i: remote.headless_addresses(host, api_host, rpc_port, i)
                for i in range(start_rank, start_rank + local_size)}
    configs = {i: ActorConfig(engine, addresses, link_secret=remote.replica_secret(secret, i))
               for i, addresses in replicas.items()}  # WHY no tokenizer_backend_file: the api's is not here
    log.info("headless data-parallel host %s: replicas %s, joining tcp://%s:%d", host, list(replicas),
             api_host, rpc_port)
    return trio.run(_supervise, configs, api_host, rpc_port, secret, remote.fingerprint_of(engine))


async def _supervise(configs: dict, api_host: str, rpc_port: int, secret: str, fingerprint: bytes) -> int:
    outcome: list[int] = []
    pids: dict[int, dict] = {}
    async with trio.open_nursery() as nursery:

        async def replica(index: int, config, task_status) -> None:
            try:
                await run_in_subprocesses(engine_specs(config), task_status=task_status,
                                          drop_env=API_SECRET_ENV_VARS)
            except ActorFailed as exc:
                if exc.exit_code == 0:
                    log.info("headless host: replica %d stopped by the api host (%s exited)", index, exc.name)
                    outcome.append(0)
                else:
                    log.error("headless host: replica %d: %s", index, exc)
                    outcome.append(1)
            nursery.cancel_scope.cancel()  # WHY all: one host, one fate (the api sees every link drop)

        async def watch_api(index: int, address: str) -> None:
            with remote.LinkWatch(address) as watch:
                await watch.wait_lost()
            log.info("headless host: the api host's link for replica %d (%s) dropped: stopping", index, address)
            outcome.append(0)
            nursery.cancel_scope.cancel()

        nursery.start_soon(stop_on_signal, nursery.cancel_scope, outcome, "headless host: %s, stopping its replicas")
        # WHY the Hello first: the api host starts its own replicas once every remote one has joined;
        # it counts a replica as up when its scheduler (started last) accepts the connection.
        hello = remote.hello_frames(secret, fingerprint, {i: c.addresses for i, c in configs.items()},
                                    {i: {"headless": os.getpid()} for i in configs})
        outbox = await remote.send_hello(api_host, rpc_port, hello)
        for index, config in configs.items():
            supervision = await nursery.start(replica, index, config)
            pids[index] = dict(supervision.pids)
        for index, config in configs.items():
            nursery.start_soon(watch_api, index, config.addresses.api)
        log.info("headless host ready: %s", "; ".join(
            f"replica {i}: " + ", ".join(f"{n} pid {p}" for n, p in found.items()) for i, found in pids.items()))
        try:
            await trio.sleep_forever()
        finally:
            outbox.close()
    return outcome[0] if outcome else 1


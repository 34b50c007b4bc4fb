"""`trillium serve --headless`: a host that runs only its executor ranks (no api, no HTTP).

    run_headless(engine, node_rank, link_secret) -> exit code

The ranks of this node (`nodes.ranks_on_node`) run as `executor-rank<r>`
children under the same supervisor as on node 0 (`actors/supervisor.py`,
one process each, config and secret on their stdin). They join rank 0's
group at `--master-addr:--master-port`, prove the deployment secret
(`nodes.prove_membership`) and follow rank 0's step broadcasts.

How it ends:
- node 0 stops (SIGTERM, Ctrl-C): rank 0 broadcasts "stop", the ranks here
  exit 0 (`tp_fanout._follow`), and so does this process;
- node 0 dies: the ranks' wait on the broadcast fails (the connection
  closes) and they exit 1; this process exits 1 with the cause logged;
- a rank here dies: this process stops its other ranks and exits 1; node 0's
  next collective fails (a closed connection at once, else after
  `--tp-collective-timeout-s`), so its engine stops and the open requests
  end with an error, never a hang;
- SIGTERM / Ctrl-C here: the ranks are stopped (SIGTERM, then SIGKILL), exit 0
  (node 0 then stops as above).
"""

from __future__ import annotations

import logging
import signal

import trio

from trillium.actors.assembly import ActorConfig, Addresses, engine_specs
from trillium.actors.supervisor import ActorFailed, run_in_subprocesses

log = logging.getLogger("trillium.serve")

# The api's secrets: a headless host holds none, and its children inherit none.
API_SECRET_ENV_VARS = ("TRILLIUM_ADMIN_TOKEN", "TRILLIUM_API_KEY")


def run_headless(engine, node_rank: int, link_secret: str) -> int:
    # WHY inproc addresses: the ranks past the first open no ZeroMQ link (tp_fanout.run); the
    # ActorConfig only carries the engine config and the secret to them.
    config = ActorConfig(engine, Addresses.inproc(), link_secret=link_secret)
    specs = engine_specs(config, node_rank)
    log.info("headless node %d of %d: executor ranks %s, joining %s:%d", node_rank, engine.tp_nnodes,
             ", ".join(spec.name.removeprefix("executor-rank") for spec in specs), engine.tp_master_addr,
             engine.tp_master_port)
    return trio.run(_supervise, specs)


async def _supervise(specs) -> int:
    outcome: list[int] = []
    async with trio.open_nursery() as nursery:

        async def ranks() -> None:
            try:
                await run_in_subprocesses(specs, task_status=_LogReady(), drop_env=API_SECRET_ENV_VARS)
            except ActorFailed as exc:
                if exc.exit_code == 0:
                    log.info("headless node: the head node stopped the engine (%s exited)", exc.name)
                    outcome.append(0)
                else:
                    log.error("headless node: %s", exc)
                    outcome.append(1)
            nursery.cancel_scope.cancel()

        nursery.start_soon(stop_on_signal, nursery.cancel_scope, outcome, "headless node: %s, stopping its ranks")
        nursery.start_soon(ranks)
    return outcome[0] if outcome else 1


async def stop_on_signal(cancel_scope: trio.CancelScope, outcome: list[int], message: str) -> None:
    """A headless host's SIGTERM / Ctrl-C: log `message` (with the signal's name), record exit
    code 0 and cancel `cancel_scope`, which stops the host's children (also data_parallel/headless.py)."""
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            log.info(message, signal.Signals(signum).name)
            outcome.append(0)
            cancel_scope.cancel()
            return


class _LogReady:
    """The task_status of the ranks' supervision: log when every rank is up."""

    def started(self, supervision=None) -> None:
        log.info("headless node ready: %s", ", ".join(f"{n} pid {p}" for n, p in supervision.pids.items()))

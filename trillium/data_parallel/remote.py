"""Data-parallel replicas on other hosts: the join handshake, the tcp:// addresses, the link watch.

    api host   trillium serve --data-parallel-size N --data-parallel-size-local L
                 --data-parallel-address A --data-parallel-rpc-port P --link-secret-file S
               HTTP planes, ReplicaClient, replicas 0..L-1 (ipc://, as on one host), and:
                 JoinListener      tcp://A:P, waits for replicas L..N-1 to announce themselves,
                                   then keeps counting strangers for the server's life
                 replica i's api inbox   tcp://A:(P + i)
                 RemoteReplica     replica i's `_EngineProcesses`: no children here; it watches
                                   the tcp:// link to replica i's scheduler (heartbeats)
    headless   trillium serve --headless --data-parallel-size N --data-parallel-size-local K
                 --data-parallel-start-rank R --data-parallel-address A --data-parallel-rpc-port P
                 --link-secret-file S
               one Hello to tcp://A:P, then replicas R..R+K-1: scheduler, executor, detokenizer
               each, bound on tcp://H:<free ports> (H: this host's address towards A).

The shape is vLLM's multi-node data parallelism (vllm-project/vllm:
vllm/engine/arg_utils.py `--data-parallel-size-local`, `--data-parallel-start-rank`,
`--data-parallel-address`, `--data-parallel-rpc-port`; vllm/entrypoints/cli/serve.py
`run_headless`, which starts only the engines of a host and no api; vllm/v1/engine/utils.py
`launch_core_engines` / `wait_for_engine_startup`, where the api host binds a handshake
socket on the rpc port and every engine, local or headless, checks in before the api
serves; vllm/v1/engine/core_client.py, where the api then reaches each engine over its
own ZeroMQ sockets). What differs: vLLM's handshake is unauthenticated and its engines
connect out to sockets the api binds; here every actor keeps its own bound inbox (the
engine's links do not change), so the Hello tells the api where replica i's inboxes are.

THE SECRETS. Every frame across hosts carries the link proof (`actors/link_auth.py`).
The Hello is signed with the deployment secret (--link-secret-file) as role
`dp-headless`; replica i's links use HMAC(secret, "trillium-dp-replica:" | i), so
a frame signed for one replica is refused by every other (as the per-replica secrets
on one host are). A peer without the secret that reaches tcp://A:P or an api inbox
gets nothing: its frames are dropped and counted
(`trillium:engine_rejected_frames_total{actor="dp-join"|"api",...}`); a Hello that
does not verify joins nothing (unauthenticated / replayed), nor does a verified one
that announces another engine config or comes after the join (forbidden).

FAILURE. `RemoteReplica` keeps a ZeroMQ heartbeat on a socket to replica i's
scheduler inbox (`LinkWatch`): when the connection drops (the host died, its process
was killed) replica i fails exactly as a local replica whose actor died
(data_parallel/processes.py: its open requests end with an error naming it, the others
keep serving). A hang without a drop is the stall watchdog's (actors/liveness.py), as
on one host. The headless host watches its replicas' api inboxes the same way: when the
api host stops or dies, it stops its replicas.

State: the listener's joined replicas and rejection counts; per RemoteReplica its link watch.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import hmac
import json
import logging
import socket

import attrs
import trio
import zmq

from trillium.actors.assembly import Addresses
from trillium.actors.codec import Codec
from trillium.actors.link_auth import AuthError, LinkKey, Signer, Verifier
from trillium.actors.supervisor import ActorFailed, Supervision
from trillium.actors.transport import Inbox, Outbox
from trillium.server import _EngineProcesses

log = logging.getLogger("trillium.serve")

HELLO_ROLE = "dp-headless"
JOIN_ACTOR = "dp-join"  # the listener's label in engine_rejected_frames_total
_HELLO_MAX_BYTES = 64 * 1024
_HEARTBEAT_MS = 1000  # ZMQ_HEARTBEAT_IVL on the watch socket; the timeout is 3 of them
_JOIN_LOG_EVERY_S = 10.0


def replica_secret(deployment_secret: str, replica: int) -> str:
    """Replica `replica`'s link secret (hex), derived from the deployment's (hex)."""
    return hmac.digest(bytes.fromhex(deployment_secret), b"trillium-dp-replica:%d" % replica, "sha256").hex()


def api_inbox_address(api_host: str, rpc_port: int, replica: int) -> str:
    return f"tcp://{api_host}:{rpc_port + replica}"


def host_towards(api_host: str, port: int) -> str:
    """This host's address on the route to `api_host` (a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((api_host, port))
        return probe.getsockname()[0]


def free_ports(host: str, count: int) -> list[int]:
    """`count` distinct TCP ports free on `host` now (all bound at once, so none repeats)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) for _ in range(count)]
        for sock in socks:
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in socks]


def headless_addresses(host: str, api_host: str, rpc_port: int, replica: int) -> Addresses:
    """Replica `replica`'s inboxes on this (headless) host, and its api inbox on the api host."""
    scheduler, executor, detokenizer = (f"tcp://{host}:{port}" for port in free_ports(host, 3))
    return Addresses(scheduler, executor, detokenizer, api_inbox_address(api_host, rpc_port, replica))


# -- the Hello (headless -> api host, once, before its replicas start: both hosts load at once) --

def hello_frames(secret: str, fingerprint: bytes, replicas: dict[int, Addresses], pids: dict[int, dict]) -> list:
    body = {"fingerprint": fingerprint.hex(),
            "replicas": {str(i): {"addresses": attrs.asdict(a), "pids": pids.get(i, {})} for i, a in replicas.items()}}
    signer = Signer(LinkKey(bytes.fromhex(secret)), HELLO_ROLE)
    return signer.sign([json.dumps(body).encode()])


async def send_hello(api_host: str, rpc_port: int, frames: list) -> Outbox:
    """Queue the Hello towards tcp://A:P; the outbox stays open (closing it would drop it unsent)."""
    outbox = Outbox.connect(f"tcp://{api_host}:{rpc_port}", Codec([]))
    await outbox.send_frames(frames)
    return outbox


class JoinRefused(Exception):
    """A Hello that verified but cannot join (another engine config, a replica outside the range)."""


class JoinListener:
    """The api host's tcp://A:P: replicas `expected` check in; strangers are dropped and counted."""

    def __init__(self, api_host: str, rpc_port: int, secret: str, expected: range, fingerprint: bytes) -> None:
        self.address = f"tcp://{api_host}:{rpc_port}"
        self._api_host, self._rpc_port = api_host, rpc_port
        self._inbox = Inbox.bind(self.address, Codec([]), max_message_bytes=_HELLO_MAX_BYTES)
        self._verifier = Verifier(LinkKey(bytes.fromhex(secret)), (HELLO_ROLE,))
        self._expected = expected
        self._fingerprint = fingerprint
        self.joined: dict[int, dict] = {}  # replica -> {"addresses": Addresses, "pids": {...}, "peer": str}
        self.rejected: dict[str, int] = {}  # reason -> frames dropped

    async def wait_joined(self) -> dict[int, dict]:
        """Every expected replica's Hello (logs who is missing every few seconds)."""
        while len(self.joined) < len(self._expected):
            with trio.move_on_after(_JOIN_LOG_EVERY_S) as waited:
                await self._receive_one()
            if waited.cancelled_caught:
                missing = [i for i in self._expected if i not in self.joined]
                log.info("waiting for data-parallel replica(s) %s to join at %s (headless hosts)",
                         missing, self.address)
        return self.joined

    async def count_strangers(self) -> None:
        """After the join: every frame is refused (a late or repeated Hello joins nothing)."""
        while True:
            await self._receive_one(closed=True)

    def close(self) -> None:
        self._inbox.close()

    def rejected_frames(self) -> dict[str, dict[str, int]]:
        return {JOIN_ACTOR: dict(self.rejected)} if self.rejected else {}

    async def _receive_one(self, closed: bool = False) -> None:
        frames, peer = await self._inbox.receive_frames()
        try:
            _, body = self._verifier.verify(frames)
            if closed:
                raise JoinRefused("every replica has joined already")
            self._join(json.loads(bytes(body[0])), peer())
        except AuthError as exc:
            self._refuse(exc.reason, str(exc), peer())
        except (JoinRefused, ValueError, KeyError, TypeError, IndexError) as exc:
            self._refuse("forbidden", str(exc), peer())

    def _refuse(self, reason: str, detail: str, peer: str) -> None:
        self.rejected[reason] = self.rejected.get(reason, 0) + 1
        log.warning("data-parallel join at %s: frame from %s refused (%s): %s", self.address, peer or "?",
                    reason, detail)

    def _join(self, body: dict, peer: str) -> None:
        if not hmac.compare_digest(bytes.fromhex(body["fingerprint"]), self._fingerprint):
            raise JoinRefused("the headless host runs another engine config (model, --max-model-len, "
                              "--kv-cache-memory, --dtype, ...): give every host the same model and engine flags")
        announced = {int(i): entry for i, entry in body["replicas"].items()}
        wrong = [i for i in announced if i not in self._expected or i in self.joined]
        if wrong:
            raise JoinRefused(f"replica(s) {wrong}: not expected here (remote replicas {list(self._expected)}, "
                              f"joined {sorted(self.joined)})")
        addresses = {i: Addresses(**entry["addresses"]) for i, entry in announced.items()}
        for i, where in addresses.items():  # WHY: the api binds the api inbox the Hello names
            if where.api != api_inbox_address(self._api_host, self._rpc_port, i) or not all(
                    a.startswith("tcp://") for a in (where.scheduler, where.executor, where.detokenizer)):
                raise JoinRefused(f"replica {i}: addresses {where} are not this api host's layout "
                                  f"(api inbox {api_inbox_address(self._api_host, self._rpc_port, i)}, tcp://)")
        for i, entry in announced.items():
            self.joined[i] = {"addresses": addresses[i], "pids": dict(entry["pids"]), "peer": peer}
            log.info("data-parallel replica %d joined from %s (scheduler at %s)", i, peer,
                     self.joined[i]["addresses"].scheduler)


async def join_remote_replicas(engine_config, server_config) -> JoinListener | None:
    """`trillium serve`'s api host: wait until every remote replica announced itself; None without any."""
    local = server_config.data_parallel_size_local
    if local is None or local >= server_config.data_parallel_size:
        return None
    join = JoinListener(server_config.data_parallel_address, server_config.data_parallel_rpc_port,
                        server_config.link_secret, range(local, server_config.data_parallel_size),
                        fingerprint_of(engine_config))
    log.info("data-parallel replicas %d..%d run on other hosts: waiting for them at %s", local,
             server_config.data_parallel_size - 1, join.address)
    try:
        await join.wait_joined()
    except BaseException:
        join.close()
        raise
    return join


def replica_processes(index, config, replica, stall_s, shutdown, processes, client, join):
    """Replica `index`'s supervised processes: here (server._EngineProcesses), or on another host."""
    kwargs = dict(on_failure=functools.partial(processes.replica_failed, index),
                  fail_streams=functools.partial(client.fail_replica_streams, index))
    if join is None or index not in join.joined:
        return _EngineProcesses(config, replica, stall_s, shutdown, **kwargs)
    joined = join.joined[index]
    return RemoteReplica(config, replica, stall_s, shutdown, pids=joined["pids"], peer=joined["peer"], **kwargs)


def fingerprint_of(engine) -> bytes:
    """What the api host and every headless host must agree on (the TP membership proof's fingerprint)."""
    from trillium.distributed.nodes import config_fingerprint

    return hashlib.sha256(b"dp:" + config_fingerprint(engine)).digest()


class RemoteReplica(_EngineProcesses):
    """Replica i on a headless host, as the api's `ReplicaProcesses` sees it (see the module docstring).

    No children here: `supervise` is started once the replica's scheduler inbox
    accepts the connection, then watches it; when it drops, `on_failure`
    (ReplicaProcesses.replica_failed) takes the replica out."""

    def __init__(self, config, client, stall_timeout_s: float, shutdown, *, pids: dict, peer: str,
                 on_failure, fail_streams) -> None:
        super().__init__(config, client, stall_timeout_s, shutdown, on_failure=on_failure,
                         fail_streams=fail_streams)
        self.peer = peer
        self._pids = {name: int(pid) for name, pid in pids.items()}

    async def supervise(self, *, task_status) -> None:
        address = self._config.addresses.scheduler
        with LinkWatch(address) as watch:
            # WHY the connection is the readiness: the headless host announces its replica before it
            # starts it (so both hosts load at once); its scheduler, started last, binds when the rest is up.
            log.info("data-parallel replica on %s: waiting for its scheduler at %s", self.peer, address)
            await watch.wait_connected()
            self.supervision = Supervision(alive={name: True for name in _REMOTE_ACTORS}, pids=dict(self._pids))
            task_status.started(self.supervision)
            await watch.wait_lost()
        self.supervision = Supervision(alive={name: False for name in _REMOTE_ACTORS}, pids=dict(self._pids))
        exc = ActorFailed(f"scheduler at {address}", "the tcp:// link to the headless host dropped")
        self.failure = exc
        log.error("data-parallel replica on %s: %s", self.peer, exc)
        self._on_failure(exc)


_REMOTE_ACTORS = ("scheduler", "executor", "detokenizer")


class LinkWatch:
    """A PUSH socket to an inbox on the other host that sends nothing: ZeroMQ heartbeats and a monitor
    tell when its connection drops (a killed process at once, a dead host after 3 heartbeats). The api
    host watches each remote replica's scheduler inbox, a headless host each of its replicas' api inbox.
    NOTE: a drop before the first connection is not one (the peer may not listen yet)."""

    def __init__(self, address: str) -> None:
        self._socket = zmq.Context.instance().socket(zmq.PUSH)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.HEARTBEAT_IVL, _HEARTBEAT_MS)
        self._socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3 * _HEARTBEAT_MS)
        self._monitor = self._socket.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self._socket.connect(address)
        self._connected = False

    async def wait_connected(self) -> None:
        await self._next(zmq.EVENT_CONNECTED)
        self._connected = True

    async def wait_lost(self) -> None:
        if not self._connected:
            await self.wait_connected()
        await self._next(zmq.EVENT_DISCONNECTED)

    async def _next(self, wanted: int) -> None:
        from zmq.utils.monitor import recv_monitor_message

        while True:
            try:
                if recv_monitor_message(self._monitor, zmq.NOBLOCK)["event"] == wanted:
                    return
            except zmq.Again:
                await trio.sleep(0.2)  # WHY polled: a handful of events in a server's life

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self._socket.disable_monitor()
        self._monitor.close(linger=0)
        self._socket.close(linger=0)

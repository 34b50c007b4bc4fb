"""Assembly of the engine: addresses, actor specs, the shared codec.

One `ActorConfig` (engine config + every actor's inbox address + the run's
link secret) is handed to each actor as bytes: over the child's stdin
under `trillium serve` (supervisor.py), never argv or the environment.
The secret is made fresh for every ActorConfig built here (32 random bytes;
`link_auth.py`); `repr` never shows it. `engine_specs(...)` lists the actors in start order
for the supervisor: in one process over inproc:// (trillium.LLM, tests) or
as one process each over ipc:// (`trillium serve`).
"""

from __future__ import annotations

import json
import os
import secrets
import tempfile
import uuid

import attrs
import cattrs

from trillium.actors.codec import Codec
from trillium.actors.link_auth import SECRET_BYTES, LinkKey
from trillium.actors.protocol import ALL_MESSAGE_TYPES
from trillium.actors.supervisor import ActorSpec
from trillium.config import EngineConfig

_converter = cattrs.Converter()


@attrs.frozen
class Addresses:
    scheduler: str
    executor: str
    detokenizer: str
    api: str

    @staticmethod
    def inproc() -> "Addresses":
        tag = uuid.uuid4().hex[:8]
        return Addresses(*(f"inproc://{tag}-{name}" for name in ("scheduler", "executor", "detokenizer", "api")))

    @staticmethod
    def ipc(directory: str | None = None) -> "Addresses":
        directory = directory or tempfile.mkdtemp(prefix="trillium-")
        return Addresses(
            *(f"ipc://{os.path.join(directory, name)}" for name in ("scheduler", "executor", "detokenizer", "api"))
        )


@attrs.frozen
class ActorConfig:
    engine: EngineConfig
    addresses: Addresses
    # Hex of the run's link secret (link_auth.LinkKey); None only in a config
    # made elsewhere without one, which `links.Links` refuses.
    link_secret: str | None = attrs.field(factory=lambda: secrets.token_hex(SECRET_BYTES), repr=False)
    tp_rank: int = 0  # which tensor-parallel executor rank reads this (executor/tp_fanout.py)
    # `trillium serve`: where the api publishes its tokenizer's backend for the detokenizer
    # (detokenizer/backend_handoff.py); None: the detokenizer loads the tokenizer itself.
    tokenizer_backend_file: str | None = None

    def link_key(self) -> LinkKey | None:
        return None if self.link_secret is None else LinkKey(bytes.fromhex(self.link_secret))

    def to_bytes(self) -> bytes:
        return json.dumps(_converter.unstructure(self)).encode()

    @staticmethod
    def from_bytes(data: bytes) -> "ActorConfig":
        fields = json.loads(data)
        fields.setdefault("link_secret", None)  # WHY: never a fresh secret the peers do not share
        fields.setdefault("tp_rank", 0)
        fields.setdefault("tokenizer_backend_file", None)
        return _converter.structure(fields, ActorConfig)


def engine_codec() -> Codec:
    return Codec(ALL_MESSAGE_TYPES)


def engine_specs(config: ActorConfig, node_rank: int = 0) -> list[ActorSpec]:
    """Actors in start order (in one process; as subprocesses they start together): the
    executor (slowest start: loads weights), then the detokenizer and the scheduler,
    which connect to it. Tensor parallel: the executor is rank 0, and ranks 1.. are
    `executor-rank<r>` (no inbox: they follow rank 0's broadcasts), on a store port
    chosen here when the config has none. More than one host (`tp_nnodes`,
    distributed/nodes.py): node 0 runs all of the above but only its own ranks;
    node `node_rank` > 0 (`--headless`) runs only its ranks' `executor-rank<r>`."""
    from trillium.distributed.nodes import ranks_on_node

    size, nnodes = config.engine.tensor_parallel_size, config.engine.tp_nnodes
    if size > 1 and not config.engine.tp_master_port:
        config = attrs.evolve(config, engine=attrs.evolve(config.engine, tp_master_port=free_loopback_port()))
    blob = config.to_bytes()
    followers = [
        ActorSpec(name=f"executor-rank{rank}", target="trillium.actors.executor.tp_fanout:run",
                  config=attrs.evolve(config, tp_rank=rank).to_bytes())
        for rank in ranks_on_node(size, nnodes, node_rank) if rank > 0
    ]
    if node_rank > 0:
        return followers
    return [
        ActorSpec(name="executor", target="trillium.actors.executor.actor:run", config=blob),
        *followers,
        ActorSpec(name="detokenizer", target="trillium.actors.detokenizer.actor:run", config=blob),
        ActorSpec(name="scheduler", target="trillium.actors.scheduler.actor:run", config=blob),
    ]


def free_loopback_port() -> int:
    """A TCP port free on 127.0.0.1 now (the tensor-parallel ranks' store)."""
    return free_loopback_ports(1)[0]


def free_loopback_ports(count: int) -> list[int]:
    """`count` distinct TCP ports free on 127.0.0.1 now (one store per data-parallel replica).

    WHY all bound at once: ports picked one by one may come back the same.
    """
    import contextlib
    import socket

    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) for _ in range(count)]
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]

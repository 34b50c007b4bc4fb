"""The trainer's end of the weight-update group (rank 0, hosting the TCPStore).

    group = WeightUpdateGroup.create(master_address, master_port, rank=0, world_size=2,
                                     backend="gloo", group_name="weight_update_group", timeout_s=60)
    wait_work(group.broadcast_async(tensor), failed, timeout_s)   # rank 0 -> every engine rank
    group.close()

The group is built by the recipe the engine's executor uses too,
`trillium.distributed.update_group.open_group`, which is SGLang's
`init_custom_process_group` (a TCPStore rendezvous, `PrefixStore(group_name)`,
then torch's `_new_process_group_helper`), so this client, the engine and
trainers written for SGLang all meet in the store. It is a standalone
group: a trainer's default process group (FSDP, DDP) is left alone. That
module imports only torch: a trainer never loads the engine.
"""

from __future__ import annotations

import socket
import time

import torch

from trillium.distributed.update_group import broadcast_async, close_group, open_group

_POLL_S = 0.0005


def free_port(host: str = "127.0.0.1") -> int:
    """A port free right now on `host` (the trainer binds it as the store's master a moment later)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class WeightUpdateGroup:
    def __init__(self, process_group, rank: int, world_size: int, backend: str) -> None:
        self.process_group = process_group
        self.rank = rank
        self.world_size = world_size
        self.backend = backend

    @classmethod
    def create(
        cls,
        master_address: str,
        master_port: int,
        *,
        rank: int,
        world_size: int,
        backend: str = "gloo",
        group_name: str = "weight_update_group",
        timeout_s: float = 60.0,
    ) -> "WeightUpdateGroup":
        """Join (rank 0: host) the group; blocks until every rank joined (TimeoutError after timeout_s)."""
        group = open_group(master_address, master_port, rank, world_size, group_name=group_name,
                           backend=backend, timeout_s=timeout_s)
        return cls(group, rank, world_size, backend)

    def device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")

    def broadcast_async(self, tensor: torch.Tensor, src: int = 0):
        """Start broadcasting `tensor` from `src`; returns the torch Work handle."""
        return broadcast_async(self.process_group, tensor, src)

    def close(self) -> None:
        if self.process_group is not None:
            close_group(self.process_group)
            self.process_group = None


def wait_work(work, failed, timeout_s: float) -> None:
    """Wait for `work`; stop early when `failed()` returns an exception (the engine gave up)."""
    deadline = time.monotonic() + timeout_s
    while not work.is_completed():
        error = failed()
        if error is not None:
            raise error
        if time.monotonic() > deadline:
            raise TimeoutError(f"broadcast did not complete within {timeout_s:.0f} s")
        time.sleep(_POLL_S)
    work.wait()

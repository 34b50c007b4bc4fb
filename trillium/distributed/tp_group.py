"""The tensor-parallel group of one engine's executor ranks (torch.distributed).

    TpGroup.join(rank, size, master_port, device, timeout_s) -> TpGroup
    NO_TP: the one-rank null object (every collective is the identity)

Two process groups over one TCPStore (rank 0 hosts it at the port the
server chose, `assembly.engine_specs`, or `--master-port`; bound on
`--master-addr` alone, 127.0.0.1 on one host: torch's own store would
listen on every interface):

- `compute`: the model's collectives (the all-reduce after each row-parallel
  layer and the vocab-parallel embedding, the gather of the LM head's
  logits to rank 0). NCCL on CUDA, gloo on CPU. Its timeout is the
  collective timeout: a rank that died or hangs inside a step is an error
  on the others (`RuntimeError` from gloo / NCCL), never a hang.
- `steps`: gloo always, for the step fan-out (`executor/tp_fanout.py`): rank
  0 broadcasts each message as bytes (one broadcast when it fits 16 KiB).
  WHY gloo on CUDA too: the messages are host bytes (vLLM keeps such a "cpu
  group" beside its NCCL one). WHY its own, much longer timeout: a follower
  waits here between steps, and an idle server sends no step for hours. A
  rank 0 that dies still ends the wait at once (the connection closes).

Right after the groups form every rank proves the deployment's link
secret and engine config to the others (`distributed/nodes.py`
`prove_membership`): the store and gloo are unauthenticated.

The model layers (`models/tensor_parallel.py`) call `all_reduce` and
`gather_to_first`; only this module imports torch.distributed for TP.
"""

from __future__ import annotations

import datetime
import logging

import attrs
import torch

log = logging.getLogger(__name__)

# How long a follower waits for the next step (idle servers send none).
STEP_WAIT_S = 7 * 24 * 3600.0
# The first broadcast of every message: its length and its first bytes (most messages whole).
BROADCAST_HEAD_BYTES = 16384


@attrs.define(eq=False)
class TpGroup:
    rank: int
    size: int
    compute: object = None  # torch.distributed ProcessGroup (None: one rank)
    steps: object = None

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @staticmethod
    def join(rank: int, size: int, master_port: int, device: torch.device, timeout_s: float,
             master_addr: str = "127.0.0.1", membership=None) -> "TpGroup":
        """Form the group; every rank calls this (rank 0 hosts the store). TimeoutError if one never comes.

        `membership`: (LinkKey, config fingerprint) every rank proves before anything else moves
        (`nodes.prove_membership`); None only where a test builds a core without a deployment."""
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=timeout_s)
        store = _store(rank, size, master_addr, master_port, timeout)
        backend = "nccl" if device.type == "cuda" else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(device)  # WHY: NCCL runs its collectives on the current device
        dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
        compute = dist.group.WORLD
        steps = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=STEP_WAIT_S))
        group = TpGroup(rank, size, compute, steps)
        if membership is not None:
            from trillium.distributed.nodes import prove_membership

            prove_membership(group, *membership)
        log.info("tensor-parallel rank %d of %d joined %s:%d (%s; collective timeout %.0f s%s)", rank, size,
                 master_addr, master_port, backend, timeout_s, "; members proved" if membership else "")
        return group

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks, in place."""
        if self.size > 1:
            import torch.distributed as dist

            dist.all_reduce(tensor, group=self.compute)
        return tensor

    def gather_to_first(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
        """Rank 0: the ranks' tensors concatenated along `dim`; the others: None."""
        if self.size == 1:
            return tensor
        import torch.distributed as dist

        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.size)] if self.is_first else None
        dist.gather(tensor, parts, dst=0, group=self.compute)
        return torch.cat(parts, dim=dim) if self.is_first else None

    def broadcast_bytes(self, payload: bytes | None) -> bytes:
        """Rank 0 sends `payload`, every other rank receives it.

        WHY one fixed-size first broadcast (length + the first bytes): each gloo
        broadcast is a hand-off between the processes, and a step's message
        almost always fits (a decode step of 32 requests is ~1.5 KB); only a
        longer one (new requests' prompts) takes a second broadcast for the rest.
        """
        import torch.distributed as dist

        head = torch.zeros(BROADCAST_HEAD_BYTES, dtype=torch.uint8)
        if self.is_first:
            first = payload[: BROADCAST_HEAD_BYTES - 8]
            head[:8] = torch.frombuffer(bytearray(len(payload).to_bytes(8, "little")), dtype=torch.uint8)
            if first:
                head[8 : 8 + len(first)] = torch.frombuffer(bytearray(first), dtype=torch.uint8)
        dist.broadcast(head, src=0, group=self.steps)
        size = int.from_bytes(head[:8].numpy().tobytes(), "little")
        rest = size - (BROADCAST_HEAD_BYTES - 8)
        if rest <= 0:
            return payload if self.is_first else head[8 : 8 + size].numpy().tobytes()
        tail = (torch.frombuffer(bytearray(payload[BROADCAST_HEAD_BYTES - 8 :]), dtype=torch.uint8)
                if self.is_first else torch.empty(rest, dtype=torch.uint8))
        dist.broadcast(tail, src=0, group=self.steps)
        return payload if self.is_first else head[8:].numpy().tobytes() + tail.numpy().tobytes()

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's `data` (the same length on every rank), on every rank, over the step group."""
        import torch.distributed as dist

        mine = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        parts = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(parts, mine, group=self.steps)
        return [part.numpy().tobytes() for part in parts]

    def all_gather_blobs(self, data: bytes) -> list[bytes]:
        """Every rank's `data` (any length), on every rank: the lengths first, then the padded bytes."""
        if self.size == 1:
            return [data]
        sizes = [int.from_bytes(b, "little") for b in self.all_gather_bytes(len(data).to_bytes(8, "little"))]
        padded = self.all_gather_bytes(data + bytes(max(sizes) - len(data)))
        return [blob[:size] for blob, size in zip(padded, sizes)]

    def barrier(self) -> None:
        """Wait for every rank (over the step group: no timeout while a slow rank loads)."""
        if self.size > 1:
            import torch.distributed as dist

            dist.barrier(group=self.steps)

    def all_ok(self, ok: bool, timeout_s: float | None = None) -> list[bool]:
        """Every rank's `ok`, on every rank (a command's outcome; over the step group).

        `timeout_s`: a RuntimeError when some rank has not answered by then (the step
        group's own timeout is a week: followers wait there between steps)."""
        if self.size == 1:
            return [ok]
        import torch.distributed as dist

        flags = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        work = dist.all_gather(flags, torch.tensor([int(ok)], dtype=torch.int64), group=self.steps, async_op=True)
        if timeout_s is None:
            work.wait()
        elif not work.wait(datetime.timedelta(seconds=timeout_s)):
            raise RuntimeError(f"a tensor-parallel rank did not answer within {timeout_s:.0f} s")
        return [bool(f.item()) for f in flags]

    def close(self) -> None:
        if self.size > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


NO_TP = TpGroup(rank=0, size=1)


def _store(rank: int, size: int, master_addr: str, master_port: int, timeout: datetime.timedelta):
    """Rank 0: the TCPStore on a socket bound to `master_addr` only; the others: a client of it."""
    import socket

    import torch.distributed as dist

    if rank != 0:
        return dist.TCPStore(master_addr, master_port, size, is_master=False, timeout=timeout)
    family = socket.AF_INET6 if ":" in master_addr else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((master_addr, master_port))
    except OSError as exc:
        listener.close()
        raise RuntimeError(f"tensor-parallel store: cannot bind {master_addr}:{master_port} ({exc.strerror}); "
                           "--master-addr must be an address of the head node (--node-rank 0)") from None
    listener.listen(128)
    # WHY detach: the store serves on the fd; a Python socket object would close it when collected.
    return dist.TCPStore(master_addr, master_port, size, is_master=True, timeout=timeout,
                         master_listen_fd=listener.detach())

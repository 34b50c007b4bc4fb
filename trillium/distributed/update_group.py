"""The weights update group: a torch.distributed group between a trainer and the engine.

SGLang's semantics: the trainer is rank 0 and broadcasts each named tensor;
the engine's executor joins at `rank_offset` (ranks in between belong to
other engine replicas or TP ranks) and receives them in the order the
update command names them.

The group is built directly, without `torch.distributed.init_process_group`
(which a process may call once, and which a trainer has usually spent on its
own training group):

    store = rendezvous("tcp://<master_address>:<master_port>", rank, world_size)
            (rank 0 hosts the TCPStore; the others connect to it)
    group = ProcessGroupGloo | ProcessGroupNCCL (PrefixStore("<group_name>/", store), rank, world_size)

`open_group` is the recipe for both sides: a trainer calls it with rank=0
(`trillium.rlhf.group` does), the engine with rank=rank_offset
(`actors/executor/control.py`). Every blocking step is bounded by
`timeout_s`: a peer that never joins or never sends gives a `TimeoutError`,
never a hang.

WHY its own package: both ends import it, and a trainer's client must not
depend on the engine's executor. It imports only torch and the standard
library.
"""

from __future__ import annotations

import datetime

import torch


def open_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str = "weight_update_group",
    backend: str = "gloo",
    timeout_s: float = 60.0,
):
    """Join (rank 0: host) the group; TimeoutError if the others do not come."""
    from torch.distributed import PrefixStore, rendezvous

    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be gloo or nccl, got {backend!r}")
    timeout = datetime.timedelta(seconds=timeout_s)
    host = f"[{master_address}]" if ":" in master_address else master_address
    try:
        store, _, _ = next(rendezvous(f"tcp://{host}:{master_port}", rank, world_size, timeout=timeout))
        store = PrefixStore(f"{group_name}/", store)
        if backend == "gloo":
            return torch.distributed.ProcessGroupGloo(store, rank, world_size, timeout)
        options = torch.distributed.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return torch.distributed.ProcessGroupNCCL(store, rank, world_size, options)
    except (RuntimeError, OSError) as exc:
        if _is_timeout(exc):
            raise TimeoutError(
                f"weights update group {group_name!r}: rank 0 ({master_address}:{master_port}) "
                f"did not join within {timeout_s:g} s"
            ) from exc
        raise


def broadcast(group, tensor: torch.Tensor, src: int = 0) -> None:
    """One broadcast from `src`; TimeoutError when it does not finish in time."""
    _wait(group.broadcast(tensor, src), src)


def broadcast_async(group, tensor: torch.Tensor, src: int = 0):
    """Start broadcasting `tensor` from `src`; returns the torch Work handle."""
    options = torch.distributed.BroadcastOptions()
    options.rootRank = src
    return group.broadcast([tensor], options)


def receive_tensors(group, buffers: list[torch.Tensor]) -> None:
    """Fill `buffers`, in order, from rank 0's broadcasts."""
    works = [group.broadcast(buffer, 0) for buffer in buffers]  # queued: gloo runs them back to back
    for work in works:
        _wait(work)


def close_group(group) -> None:
    """Shut the group down. NOTE: the caller must also drop its last reference
    before the interpreter exits: a gloo group destroyed during interpreter
    shutdown aborts the process ("terminate called without an active exception")."""
    shutdown = getattr(group, "shutdown", None)
    if shutdown is not None:
        try:
            shutdown()
        except RuntimeError:
            pass  # already broken (a peer left): dropping it is all there is to do


def _wait(work, src: int = 0) -> None:
    try:
        work.wait()
    except RuntimeError as exc:
        if _is_timeout(exc):
            raise TimeoutError(f"broadcast from rank {src} timed out: {exc}") from exc
        raise


def _is_timeout(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text or type(exc).__name__ == "DistNetworkError"

"""The weights update group: a torch.distributed group between a trainer and the engine.

SGLang's semantics: the trainer is rank 0 and broadcasts each named tensor;
the engine's executor joins at `rank_offset` (ranks in between belong to
other engine replicas or TP ranks) and receives them in the order the
update command names them.

The group is formed by the recipe RL trainers use with SGLang, so a trainer
that calls `sglang.srt.utils.init_custom_process_group` (or the verl /
slime / OpenRLHF / AReaL copies of it) meets the engine in the store:

    store = rendezvous("tcp://<master_address>:<master_port>", rank, world_size)
            (rank 0 hosts the TCPStore; the others connect to it)
    store.set_timeout(timeout)
    group = torch's _new_process_group_helper(world_size, rank, [], backend,
                                              PrefixStore("<group_name>", store),
                                              group_name=group_name, timeout=timeout)
    _world.pg_group_ranks[group] = {r: r for r in range(world_size)}

WHY torch's private helper rather than building `ProcessGroupGloo` by hand:
the helper adds two more store prefixes of its own, `<group_name>/` and
then `<device>/` (`cpu/` for gloo, `cuda/` for nccl); the keys a peer waits
for are wherever the helper puts them, in whatever torch version the
trainer runs. Calling the same helper is the only way both ends agree
(checked against torch 2.13's `distributed_c10d._new_process_group_helper`).
It is also what makes `torch.distributed.broadcast(t, src=0, group=group)`
work on the group without a default process group: `_world.pg_group_ranks`
maps group ranks to "global" ones.

`open_group` is the recipe for both sides: a trainer calls it with rank=0
(`trillium.rlhf.group` does), the engine with rank=rank_offset
(`actors/executor/control.py`). Every blocking step is bounded by
`timeout_s`: a peer that never joins or never sends gives a `TimeoutError`,
never a hang. `close_group` destroys the group the way SGLang's
`destroy_weights_update_group` does (`destroy_process_group(group)`), which
also frees its name for the next `open_group`.

WHY its own package: both ends import it, and a trainer's client must not
depend on the engine's executor. It imports only torch and the standard
library.
"""

from __future__ import annotations

import datetime
import inspect
import logging

import torch

log = logging.getLogger(__name__)


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
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be gloo or nccl, got {backend!r}")
    if not group_name:
        raise ValueError("group_name must not be empty")
    timeout = datetime.timedelta(seconds=timeout_s)
    host = f"[{master_address}]" if ":" in master_address else master_address
    try:
        store, rank, world_size = next(rendezvous(f"tcp://{host}:{master_port}", rank, world_size, timeout=timeout))
        store.set_timeout(timeout)
        group, _ = _new_process_group_helper(
            world_size, rank, [], Backend(backend), PrefixStore(group_name, store),
            group_name=group_name, timeout=timeout, **{_options_arg(): None},
        )
    except (RuntimeError, OSError) as exc:
        if _is_timeout(exc):
            raise TimeoutError(
                f"weights update group {group_name!r}: the other ranks ({master_address}:{master_port}) "
                f"did not join within {timeout_s:g} s"
            ) from exc
        raise
    _world.pg_group_ranks[group] = {r: r for r in range(world_size)}
    return group


def _options_arg() -> str:
    """The helper's options parameter: `backend_options` since torch 2.6, `pg_options` before."""
    from torch.distributed.distributed_c10d import _new_process_group_helper

    parameters = inspect.signature(_new_process_group_helper).parameters
    return "backend_options" if "backend_options" in parameters else "pg_options"


def broadcast(group, tensor: torch.Tensor, src: int = 0) -> None:
    """One broadcast from `src`; TimeoutError when it does not finish in time."""
    _wait(broadcast_async(group, tensor, src), src)


def broadcast_async(group, tensor: torch.Tensor, src: int = 0):
    """Start broadcasting `tensor` from `src`; returns the torch Work handle."""
    return torch.distributed.broadcast(tensor, src=src, group=group, async_op=True)


def receive_tensors(group, buffers: list[torch.Tensor]) -> None:
    """Fill `buffers`, in order, from rank 0's broadcasts."""
    works = [broadcast_async(group, buffer, 0) for buffer in buffers]  # queued: gloo runs them back to back
    for work in works:
        _wait(work)


def close_group(group) -> None:
    """Destroy the group (SGLang's `destroy_process_group(group)`): shut it down and free its name.

    NOTE: a group left alive at interpreter exit aborts the process ("terminate
    called without an active exception"): both ends must close what they open."""
    try:
        torch.distributed.destroy_process_group(group)
    except (RuntimeError, ValueError) as exc:
        # Already destroyed, or broken (a peer left): nothing more to release.
        log.debug("closing the weights update group: %s", exc)


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

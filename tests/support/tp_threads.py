"""Tensor-parallel ranks as threads of one process, for the sharding math.

`ThreadGroup` has `TpGroup`'s interface (distributed/tp_group.py) with the
two collectives the model layers call, `all_reduce` and `gather_to_first`,
done over shared memory between `size` threads (a barrier, then each rank
reads every rank's tensor). It lets a test build the real sharded model of
every rank (`load_model(..., tp=group)`: the loader's `get_slice` reads, the
row-parallel layers, the vocab-parallel embedding and head) and compare it
with the unsharded one in milliseconds, with no process start. The real
torch.distributed path is what tests/e2e/test_serve_tensor_parallel.py runs.
"""

from __future__ import annotations

import threading

import torch


class _Exchange:
    def __init__(self, size: int) -> None:
        self.size = size
        self.slots: list[torch.Tensor | None] = [None] * size
        self.barrier = threading.Barrier(size, timeout=60)


class ThreadGroup:
    def __init__(self, rank: int, exchange: _Exchange) -> None:
        self.rank, self.size, self._ex = rank, exchange.size, exchange

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def _everyone(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        self._ex.slots[self.rank] = tensor.clone()
        self._ex.barrier.wait()
        parts = list(self._ex.slots)
        self._ex.barrier.wait()  # everyone has read before a slot is reused
        return parts

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        parts = self._everyone(tensor)
        total = parts[0].clone()
        for part in parts[1:]:
            total += part
        tensor.copy_(total)
        return tensor

    def gather_to_first(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
        parts = self._everyone(tensor)
        return torch.cat(parts, dim=dim) if self.is_first else None


def run_ranks(size: int, work) -> list:
    """work(group) on `size` threads at once; their results in rank order (an exception is re-raised)."""
    exchange = _Exchange(size)
    results: list = [None] * size
    errors: list[BaseException] = []

    def main(rank: int) -> None:
        try:
            with torch.inference_mode():
                results[rank] = work(ThreadGroup(rank, exchange))
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)
            exchange.barrier.abort()

    threads = [threading.Thread(target=main, args=(rank,)) for rank in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results

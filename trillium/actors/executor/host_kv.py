"""The host KV tier's memory: per layer, host blocks shaped like the device's.

Role: the executor side of the host tier (the scheduler's index is
actors/kv_tiers/host.py). It owns `num_slots` host blocks for every per-block
tensor of every layer's device cache (keys, values, and whatever else a
cache layout keeps per block), same dtype, pinned on CUDA so the copies are
plain DMA. A step's copies arrive in its `ExecuteBatch` (`kv`, a
KvTransfers) and run at the very start of `ExecutorCore.execute`, through
kv_stores.py, before the forward writes anything:

    saves   device block save_block_ids[i]  -> host slot save_host_slots[i]
    loads   host slot load_host_slots[j]    -> device block load_block_ids[j]

Saves first: a block the scheduler evicted (and handed to a request) this
step still holds its old KV until the forward, and a slot saved and loaded
in the same step arrives intact.

NOTE: the copies are synchronous (the step waits for them); only the disk
tier's reads run in the background (disk_kv.py).
The device caches are read from the core at each call, not kept: sleep and
wake-up replace them.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import attrs
import numpy as np
import torch

log = logging.getLogger(__name__)

_FLOAT8 = tuple(getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, name))


def _block_tensors(layer_cache, num_blocks: int) -> list[torch.Tensor]:
    """The tensors of one layer's cache indexed by block (leading dim num_blocks).

    WHY generic: a layer's cache is a (k, v) pair today; a quantized layout
    may add per-block scales in a tuple or a small attrs / dataclass object.
    """
    if isinstance(layer_cache, torch.Tensor):
        parts = [layer_cache]
    elif isinstance(layer_cache, (tuple, list)):
        parts = list(layer_cache)
    elif attrs.has(type(layer_cache)):
        parts = [getattr(layer_cache, f.name) for f in attrs.fields(type(layer_cache))]
    elif dataclasses.is_dataclass(layer_cache):
        parts = [getattr(layer_cache, f.name) for f in dataclasses.fields(layer_cache)]
    else:
        parts = list(vars(layer_cache).values())
    tensors = [t for t in parts if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == num_blocks]
    # WHY bytes for float8: index_select / index_copy_ do not cover every float8 dtype.
    return [t.view(torch.uint8) if t.dtype in _FLOAT8 else t for t in tensors]


def _slot_view(tensor: torch.Tensor, slot: int) -> torch.Tensor:
    """One host slot as flat bytes (a view: a slot is contiguous)."""
    return tensor[slot].reshape(-1).view(torch.uint8)


def _row_bytes(tensors: list[torch.Tensor], index: int) -> bytes:
    return b"".join(_slot_view(t, index).cpu().numpy().tobytes() for t in tensors)


def _index(values: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64)).to(device)


class HostKvStore:
    def __init__(self, kv_caches, num_blocks: int, num_slots: int, block_size: int, device: torch.device) -> None:
        self.num_blocks = num_blocks
        self.num_slots = num_slots
        self.device = device
        pin = device.type == "cuda"
        self.host = [
            torch.empty((num_slots, *t.shape[1:]), dtype=t.dtype, pin_memory=pin)  # a slot is read only once saved
            for layer in kv_caches
            for t in _block_tensors(layer, num_blocks)
        ]
        self.block_bytes = sum(h[0].numel() * h.element_size() for h in self.host)
        log.info(
            "host KV tier: %d blocks (%d tokens, %.1f MiB%s)",
            num_slots, num_slots * block_size, num_slots * self.block_bytes / 2**20, ", pinned" if pin else "",
        )

    def _device_tensors(self, kv_caches) -> list[torch.Tensor]:
        tensors = [t for layer in kv_caches for t in _block_tensors(layer, self.num_blocks)]
        if len(tensors) != len(self.host):
            raise RuntimeError(f"device KV cache has {len(tensors)} block tensors, host tier {len(self.host)}")
        return tensors

    def apply(self, kv_caches, transfers) -> float:
        """A step's copies (a KvTransfers): saves, then loads (see the module
        docstring). Returns the seconds the loads took (0.0: none)."""
        if len(transfers.save_block_ids):
            self.save(kv_caches, transfers.save_block_ids, transfers.save_host_slots)
        if not len(transfers.load_block_ids):
            return 0.0
        started = time.perf_counter()
        self.load(kv_caches, transfers.load_host_slots, transfers.load_block_ids)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # NOTE: only in steps that load: the latency metric needs it
        return time.perf_counter() - started

    # -- the disk tier's access to one slot (executor/disk_kv.py) ----------

    def slot_bytes(self, slot: int) -> bytes:
        """One slot's content as bytes (a copy), every tensor in order."""
        return _row_bytes(self.host, slot)

    def device_block_bytes(self, kv_caches, block_id: int) -> bytes:
        """One device block's content in `slot_bytes`' format (a copy)."""
        return _row_bytes(self._device_tensors(kv_caches), block_id)

    def write_slot(self, slot: int, payload) -> None:
        """Fill one slot from `slot_bytes`' format; ValueError on a size mismatch."""
        views = [_slot_view(t, slot) for t in self.host]
        if len(payload) != sum(v.numel() for v in views):
            raise ValueError(f"{len(payload)} bytes for a {sum(v.numel() for v in views)}-byte block")
        offset = 0
        for view in views:
            n = view.numel()
            view.copy_(torch.frombuffer(payload, dtype=torch.uint8, count=n, offset=offset))
            offset += n

    def save(self, kv_caches, block_ids: np.ndarray, slots: np.ndarray) -> None:
        ids = _index(block_ids, self.device)
        host_slots = _index(slots, torch.device("cpu"))
        for device_t, host_t in zip(self._device_tensors(kv_caches), self.host):
            host_t.index_copy_(0, host_slots, device_t.index_select(0, ids).cpu())

    def load(self, kv_caches, slots: np.ndarray, block_ids: np.ndarray) -> None:
        ids = _index(block_ids, self.device)
        host_slots = _index(slots, torch.device("cpu"))
        for device_t, host_t in zip(self._device_tensors(kv_caches), self.host):
            device_t.index_copy_(0, ids, host_t.index_select(0, host_slots).to(self.device, non_blocking=True))

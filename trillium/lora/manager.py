"""LoRAManager: the executor's adapters: registered ids, host cache, device slots.

    manager.register(lora_id, name, path)   read + validate (AdapterError), cache on the host
    manager.unregister(lora_id)             forget it (its slot is cleared)
    manager.batch(lora_ids, num_tokens)     -> LoRABatch | None for one step

Three levels, as vLLM's LoRA runtime:

- registered: every adapter the engine may serve, id -> (name, path);
- host cache: up to `max_cpu_loras` validated adapters in host memory, LRU.
  An adapter evicted from it is read again from its path when next needed;
- device slots: `max_loras` adapters in `LoRASlots`. A step needs each of
  its adapters in a slot: resident ones stay, missing ones go into a free
  slot or replace the least recently used adapter the step does not need
  (a "swap-in", counted). The scheduler never puts more distinct adapters
  in one step than there are slots.

Tensor parallel (`tp_shard` of more than one rank): the adapter is read and
validated whole, then each rank keeps its shard (`lora/tensor_parallel.py`)
in slots sized for its layers. Every rank registers the same adapters (the
load/unload commands are fanned out: executor/tp_fanout.py) and sees the same
steps, so the slot choices below come out the same on every rank.

Runs on the executor's torch thread (like every weight operation).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence

from trillium.lora.adapter import AdapterError, LoRAAdapter, load_adapter
from trillium.lora.batch import LoRABatch
from trillium.lora.slots import LoRASlots
from trillium.lora.tensor_parallel import shard_adapter

log = logging.getLogger(__name__)

BASE = 0  # lora_id of the base model


class LoRAManager:
    def __init__(self, model_config, max_loras: int, max_rank: int, max_cpu_loras: int,
                 dtype=None, device="cpu", tp_shard=None) -> None:
        self.model_config = model_config  # the whole model's: adapters are validated against it
        self.max_rank = max_rank
        self.max_cpu_loras = max(max_cpu_loras, max_loras)
        self.tp_shard = tp_shard  # None: one rank
        local = model_config if tp_shard is None else tp_shard.local_config
        self.slots = LoRASlots(local, max_loras, max_rank, dtype, device)
        self._registered: dict[int, tuple[str, str]] = {}
        self._host: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # lora_id -> slot, LRU first
        self.num_swap_ins = 0

    # -- registration ---------------------------------------------------

    def register(self, lora_id: int, name: str, path: str) -> LoRAAdapter:
        """Read and validate the adapter; AdapterError (nothing registered) if it cannot be served."""
        if lora_id <= BASE:
            raise ValueError(f"lora_id must be >= 1, got {lora_id}")
        adapter = self._read(path)
        self.unregister(lora_id)
        self._registered[lora_id] = (name, path)
        self._cache(lora_id, adapter)
        log.info("LoRA adapter %r (id %d, rank %d, %s) registered from %s", name, lora_id, adapter.rank,
                 ",".join(sorted(adapter.target_modules)), path)
        return adapter

    def unregister(self, lora_id: int) -> bool:
        known = self._registered.pop(lora_id, None) is not None
        self._host.pop(lora_id, None)
        slot = self._slot_of.pop(lora_id, None)
        if slot is not None:
            self.slots.clear(slot)
        return known

    @property
    def registered(self) -> dict[int, str]:
        return {lora_id: name for lora_id, (name, _) in self._registered.items()}

    @property
    def resident(self) -> dict[int, int]:
        """lora_id -> device slot."""
        return dict(self._slot_of)

    # -- one step -----------------------------------------------------------

    def batch(self, lora_ids: Sequence[int], num_tokens: Sequence[int]) -> LoRABatch | None:
        """The step's LoRABatch (None when every request is a base-model one)."""
        needed = [i for i in dict.fromkeys(lora_ids) if i != BASE]
        if not needed:
            return None
        if len(needed) > self.slots.max_loras:
            raise RuntimeError(f"{len(needed)} adapters in one step, only {self.slots.max_loras} slots")
        slot_of = {lora_id: self._ensure_resident(lora_id, set(needed)) for lora_id in needed}
        slots = [-1 if lora_id == BASE else slot_of[lora_id] for lora_id in lora_ids]
        return LoRABatch.build(self.slots, num_tokens, slots)

    def _ensure_resident(self, lora_id: int, needed: set[int]) -> int:
        slot = self._slot_of.get(lora_id)
        if slot is not None:
            self._slot_of.move_to_end(lora_id)
            return slot
        if lora_id not in self._registered:
            raise KeyError(f"LoRA adapter id {lora_id} is not loaded")
        used = set(self._slot_of.values())
        free = [s for s in range(self.slots.max_loras) if s not in used]
        if free:
            slot = free[0]
        else:
            victim = next(i for i in self._slot_of if i not in needed)
            slot = self._slot_of.pop(victim)
        self.slots.load(slot, self._adapter(lora_id))
        self._slot_of[lora_id] = slot
        self.num_swap_ins += 1
        return slot

    def _adapter(self, lora_id: int) -> LoRAAdapter:
        adapter = self._host.get(lora_id)
        if adapter is not None:
            self._host.move_to_end(lora_id)
            return adapter
        name, path = self._registered[lora_id]
        try:
            adapter = self._read(path)
        except (AdapterError, OSError) as exc:
            raise RuntimeError(f"LoRA adapter {name!r} could not be read again from {path}: {exc}") from exc
        self._cache(lora_id, adapter)
        return adapter

    def _read(self, path: str) -> LoRAAdapter:
        """Read and validate the whole adapter; keep this rank's shard of it."""
        adapter = load_adapter(path, self.model_config, self.max_rank)
        return adapter if self.tp_shard is None else shard_adapter(adapter, self.tp_shard)

    def _cache(self, lora_id: int, adapter: LoRAAdapter) -> None:
        self._host[lora_id] = adapter
        self._host.move_to_end(lora_id)
        while len(self._host) > self.max_cpu_loras:
            self._host.popitem(last=False)

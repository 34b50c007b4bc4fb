"""Host-memory KV tier: the scheduler's index of KV blocks kept in host RAM.

Role: the second level of the prefix cache. Blocks the device `BlockPool`
evicts spill here instead of being lost, and a prefix lookup that runs past
the device's hits keeps walking this index, so a request whose prefix was
evicted from the device still skips its prefill: its blocks are copied back
into fresh device blocks before the step runs.

The executor owns the memory (executor/host_kv.py: per layer, `num_slots`
host blocks shaped like the device blocks); this index only decides which
slot holds which block hash and queues the copies for the step being
scheduled (`take_transfers`), which the executor performs at the very start
of that step, before its forward writes anything:

    step N schedule()                               step N execute()
      pool pops a free cached block d (hash h)        1. saves: device d -> host s
        -> evicted(d, h): h -> slot s, SAVE(d, s)        (d still holds h: nothing
      lookup walks past the device hits                  has written the cache yet)
        -> reserve(slots); pool pops fresh d'         2. loads: host s' -> device d'
        -> load(s', d'): LOAD(s', d')                  3. forward (reads d' as a hit)

Copy semantics: a loaded block stays on the host too, so it is never saved
twice. Which block leaves when the host is full is the eviction policy's
call (policies.py: LRU or ARC).

INVARIANT: a slot this step loads from is never chosen as a victim before
the step's transfers are taken (`_reserved`), so a save can never overwrite
what a load of the same step reads. Saves run before loads, so a block both
saved and loaded in one step arrives intact.

Pure synchronous code: no trio, no zmq, no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from trillium.actors.kv_tiers.block_pool import BlockHash, BlockId, BlockPool
from trillium.actors.kv_tiers.policies import make_policy
from trillium.actors.protocol.outputs import KvTierStats

HostSlot = int


def _int32(values) -> np.ndarray:
    return np.fromiter(values, dtype=np.int32)


class KvTransfers(NamedTuple):
    """One step's copies between the device cache and the host tier (int32 arrays)."""

    save_block_ids: np.ndarray  # device blocks to copy ...
    save_host_slots: np.ndarray  # ... into these host slots (first)
    load_host_slots: np.ndarray  # host slots to copy ...
    load_block_ids: np.ndarray  # ... into these device blocks (then)

    @property
    def empty(self) -> bool:
        return not len(self.save_block_ids) and not len(self.load_block_ids)


NO_TRANSFERS = KvTransfers(*(np.zeros(0, np.int32) for _ in range(4)))


class HostTier:
    """`num_slots` host blocks keyed by block hash, with an eviction policy.

    Implements `core.KvTier` (name, sizes, match_prefix, reset) and the
    pool's `block_pool.LowerTier` hooks (evicted, lookup, reserve, load).
    """

    name = "host"

    def __init__(self, num_slots: int, policy: str = "lru", block_bytes: int = 0) -> None:
        if num_slots < 1:
            raise ValueError(f"a host tier needs at least one slot, got {num_slots}")
        self.num_total_blocks = num_slots
        self.block_bytes = block_bytes  # one block across all layers (for the bytes-moved metric)
        self._policy_name = policy
        self._policy = make_policy(policy, num_slots)
        self._slot_of: dict[BlockHash, HostSlot] = {}
        self._hash_of: dict[HostSlot, BlockHash] = {}
        self._free_slots = list(range(num_slots - 1, -1, -1))  # pop() hands out the lowest
        # This step's transfers. Keyed by destination: a later copy to the same
        # place supersedes an earlier one (index_copy_ with repeated indices
        # has no defined winner).
        self._saves: dict[HostSlot, BlockId] = {}
        self._loads: dict[BlockId, HostSlot] = {}
        self._reserved: set[HostSlot] = set()
        # Lifetime totals, in blocks.
        self.num_hit_blocks = 0
        self.num_evicted_blocks = 0
        self.num_saved_blocks = 0
        self.num_loaded_blocks = 0

    # -- views (core.KvTier) ------------------------------------------------

    @property
    def num_used_blocks(self) -> int:
        return len(self._slot_of)

    @property
    def num_free_blocks(self) -> int:
        return self.num_total_blocks - len(self._slot_of)

    @property
    def usage(self) -> float:
        return len(self._slot_of) / self.num_total_blocks

    @property
    def bytes_to_host(self) -> int:
        return self.num_saved_blocks * self.block_bytes

    @property
    def bytes_to_device(self) -> int:
        return self.num_loaded_blocks * self.block_bytes

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._slot_of

    def match_prefix(self, block_hashes: Sequence[BlockHash]) -> int:
        return len(self.lookup(block_hashes))

    def reset(self) -> int:
        """Forget every block and any queued copy (weights changed, or the
        device cache is being freed). Returns the number of blocks dropped."""
        num = len(self._slot_of)
        self._policy = make_policy(self._policy_name, self.num_total_blocks)
        self._slot_of.clear()
        self._hash_of.clear()
        self._free_slots = list(range(self.num_total_blocks - 1, -1, -1))
        self._saves.clear()
        self._loads.clear()
        self._reserved.clear()
        return num

    # -- the pool's hooks (block_pool.LowerTier) ----------------------------

    def evicted(self, block_id: BlockId, block_hash: BlockHash) -> None:
        """The device dropped a cached block to reuse it: keep a copy here."""
        if block_hash in self._slot_of:
            return  # copy semantics: the host already holds it
        slot = self._free_slots.pop() if self._free_slots else self._evict_one()
        if slot is None:
            return  # every slot is being loaded this step: let the block go
        self._slot_of[block_hash] = slot
        self._hash_of[slot] = block_hash
        self._policy.insert(block_hash)
        self._saves[slot] = block_id

    def lookup(self, block_hashes: Sequence[BlockHash]) -> tuple[HostSlot, ...]:
        """Slots of the leading hashes of the chain held here (pure lookup)."""
        slots = []
        for block_hash in block_hashes:
            slot = self._slot_of.get(block_hash)
            if slot is None:
                break
            slots.append(slot)
        return tuple(slots)

    def reserve(self, slots: Sequence[HostSlot]) -> None:
        """These slots are loaded this step: count the hits, refresh them in
        the policy, and keep them from being evicted until the step is sent.
        Call before the pool pops the device blocks they load into (a pop
        may evict a device block, which may need a host slot)."""
        for slot in slots:
            self._policy.touch(self._hash_of[slot])
            self._reserved.add(slot)
        self.num_hit_blocks += len(slots)

    def load(self, slot: HostSlot, block_id: BlockId) -> None:
        """Queue the copy of a reserved slot into a fresh device block."""
        if slot not in self._reserved:
            raise RuntimeError(f"host slot {slot} loaded without reserve()")
        self._loads[block_id] = slot

    # -- one step -----------------------------------------------------------

    def take_transfers(self) -> KvTransfers:
        """This step's copies (for its ExecuteBatch); resets the queue."""
        if not self._saves and not self._loads:
            self._reserved.clear()
            return NO_TRANSFERS
        transfers = KvTransfers(
            save_block_ids=_int32(self._saves.values()),
            save_host_slots=_int32(self._saves.keys()),
            load_host_slots=_int32(self._loads.values()),
            load_block_ids=_int32(self._loads.keys()),
        )
        self.num_saved_blocks += len(self._saves)
        self.num_loaded_blocks += len(self._loads)
        self._saves.clear()
        self._loads.clear()
        self._reserved.clear()
        return transfers

    def _evict_one(self) -> HostSlot | None:
        """Free the policy's victim's slot; None if every resident is reserved."""
        skipped = []
        slot = None
        while (victim := self._policy.victim()) is not None:
            candidate = self._slot_of[victim]
            if candidate in self._reserved:
                skipped.append(victim)  # NOTE: only when nearly every slot is loading this step
                continue
            del self._slot_of[victim]
            del self._hash_of[candidate]
            self.num_evicted_blocks += 1
            slot = candidate
            break
        for key in skipped:
            self._policy.insert(key)
        return slot


def tier_stats(pool: BlockPool, tier: HostTier) -> dict:
    """The SchedulerStats fields of the device and host tiers."""
    return dict(
        kv_tiers=(
            KvTierStats("device", pool.usage, pool.num_blocks, pool.num_hit_blocks, pool.num_evicted_blocks),
            KvTierStats("host", tier.usage, tier.num_total_blocks, tier.num_hit_blocks, tier.num_evicted_blocks),
        ),
        kv_bytes_to_host_total=tier.bytes_to_host,
        kv_bytes_to_device_total=tier.bytes_to_device,
    )

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

Swap preemption (scheduler/preemption.py): `swap_out` pins slots for a
preempted request's device blocks and queues their saves; pinned slots are
in no index and no policy (never hits, never victims) until `swap_in`
queues their loads into fresh device blocks, or `drop_swap` (finished,
aborted, reset) unpins them. A swapped-in slot comes free only once the
step's transfers are taken (`_releasing`), so no save of that step reuses a
slot it loads from. `reset` drops the pinned slots too.

Pure synchronous code: no trio, no zmq, no torch.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np

from trillium.actors.kv_tiers.block_pool import BlockHash, BlockId
from trillium.actors.kv_tiers.disk import DiskTier
from trillium.actors.kv_tiers.policies import make_policy
from trillium.actors.protocol.execute import NO_TRANSFERS, KvTransfers

HostSlot = int


def _int32(values) -> np.ndarray:
    return np.fromiter(values, dtype=np.int32)


class HostTier:
    """`num_slots` host blocks keyed by block hash, with an eviction policy.

    Implements the pool's `block_pool.LowerTier` hooks (evicted, lookup,
    reserve, load); kv_tiers/manager.py drives the rest.
    """

    name = "host"

    def __init__(self, num_slots: int, policy: str = "lru", block_bytes: int = 0,
                 disk: DiskTier | None = None) -> None:
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
        # Swap preemption: slots pinned per swapped-out request (in block
        # order), and slots swapped in this step (free once it is taken).
        self._swapped: dict[str, list[HostSlot]] = {}
        self._releasing: list[HostSlot] = []
        # The disk tier under this one (host evictions spill there), and the
        # slots being filled from it: slot -> hash. A fetching slot is in no
        # index, list or policy until its read comes back (`fetch_done`);
        # `_stale` are fetches a reset overtook: their slots just come back free.
        self.disk = disk
        self._fetching: dict[HostSlot, BlockHash] = {}
        self._stale: set[HostSlot] = set()
        # Lifetime totals, in blocks.
        self.num_hit_blocks = 0
        self.num_evicted_blocks = 0
        self.num_saved_blocks = 0
        self.num_loaded_blocks = 0

    # -- views ---------------------------------------------------------------

    @property
    def num_used_blocks(self) -> int:
        return len(self._slot_of) + self.num_pinned_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.num_total_blocks - self.num_used_blocks

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_total_blocks

    @property
    def num_pinned_blocks(self) -> int:
        """Slots holding swapped-out requests' KV."""
        return sum(map(len, self._swapped.values()))

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
        device cache is being freed), and unpin swapped-out requests' slots
        (the scheduler makes them recompute first). Returns the number of
        cached blocks dropped."""
        num = len(self._slot_of)
        self._swapped.clear()
        self._releasing.clear()
        self._policy = make_policy(self._policy_name, self.num_total_blocks)
        self._slot_of.clear()
        self._hash_of.clear()
        # WHY not the fetching slots: the executor's I/O thread may still write them.
        self._stale.update(self._fetching)
        self._free_slots = [s for s in range(self.num_total_blocks - 1, -1, -1) if s not in self._stale]
        self._saves.clear()
        self._loads.clear()
        self._reserved.clear()
        return num

    # -- the pool's hooks (block_pool.LowerTier) ----------------------------

    def evicted(self, block_id: BlockId, block_hash: BlockHash) -> None:
        """The device dropped a cached block to reuse it: keep a copy here."""
        if block_hash in self._slot_of:
            return  # copy semantics: the host already holds it
        slot = self._take_slot()
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

    # -- the disk tier under this one -----------------------------------------

    def disk_hits(self, block_hashes: Sequence[BlockHash]) -> int:
        """Leading hashes of the chain held on disk (0 without a disk tier)."""
        return 0 if self.disk is None else self.disk.match_prefix(block_hashes)

    def start_fetch(self, block_hashes: Sequence[BlockHash]) -> list[HostSlot]:
        """Queue reads of these disk blocks into host slots; returns the slots,
        in order (fewer, maybe none, if the host tier has no slot to spare)."""
        assert self.disk is not None
        slots = []
        for block_hash in block_hashes:
            slot = self._take_slot()
            if slot is None:
                break
            self._fetching[slot] = block_hash
            self.disk.fetch(block_hash, slot)
            slots.append(slot)
        return slots

    @property
    def num_fetching(self) -> int:
        return len(self._fetching)

    def fetch_done(self, slot: HostSlot, ok: bool, pin: bool = False) -> BlockHash | None:
        """A read came back: a good block joins the index; a failed one is
        forgotten by the disk tier. Returns the slot's hash (None if unknown).

        `pin`: its request still waits for it. A pinned block is found by
        lookups but is in no policy, so no eviction takes it before the
        request is admitted (`unpin`)."""
        block_hash = self._fetching.pop(slot, None)
        if block_hash is None:
            return None
        assert self.disk is not None
        self.disk.fetched(ok)
        if slot in self._stale or not ok or block_hash in self._slot_of:
            if not ok:
                self.disk.drop(block_hash)
            self._stale.discard(slot)
            self._free_slots.append(slot)
            return block_hash
        self._slot_of[block_hash] = slot
        self._hash_of[slot] = block_hash
        if not pin:
            self._policy.insert(block_hash)
        return block_hash

    def pin(self, block_hashes) -> None:
        """Keep these held blocks from eviction (a loading request's host hits:
        its own fetches must not push them out) until `unpin`."""
        for block_hash in block_hashes:
            if block_hash in self._slot_of:
                self._policy.remove(block_hash)

    def unpin(self, block_hashes) -> None:
        """The requests that waited for these fetched blocks were admitted (or left)."""
        for block_hash in block_hashes:
            if block_hash in self._slot_of and block_hash not in self._policy:
                self._policy.insert(block_hash)

    # -- swap preemption (scheduler/preemption.py) ----------------------------

    def can_swap_out(self, num_blocks: int) -> bool:
        """`num_blocks` slots can be pinned now: free ones, or ones holding
        cached blocks the policy may evict (not those loading this step)."""
        return num_blocks <= len(self._free_slots) + len(self._slot_of) - len(self._reserved)

    def swap_out(self, request_id: str, block_ids: Sequence[BlockId]) -> bool:
        """Pin a slot for each of a preempted request's device blocks (in
        order) and queue their saves; False, changing nothing, if the tier
        cannot spare that many slots."""
        if request_id in self._swapped:
            raise RuntimeError(f"request {request_id} is already swapped out")
        if not block_ids or not self.can_swap_out(len(block_ids)):
            return False
        slots: list[HostSlot] = []
        for block_id in block_ids:
            slot = self._take_slot()
            if slot is None:  # NOTE: only if can_swap_out overcounted; give the slots back
                for taken in slots:
                    del self._saves[taken]
                self._free_slots.extend(slots)
                return False
            self._saves[slot] = block_id
            slots.append(slot)
        self._swapped[request_id] = slots
        return True

    def swap_in(self, request_id: str, block_ids: Sequence[BlockId]) -> None:
        """Queue the loads of a swapped-out request's slots into these fresh
        device blocks (in order) and unpin the slots: they come free when
        this step's transfers are taken, not before (see the module doc)."""
        slots = self._swapped.pop(request_id)
        if len(block_ids) != len(slots):
            raise ValueError(f"request {request_id}: {len(slots)} blocks swapped out, {len(block_ids)} to load")
        for slot, block_id in zip(slots, block_ids):
            self._loads[block_id] = slot
        self._releasing.extend(slots)

    def drop_swap(self, request_id: str) -> int:
        """Unpin a swapped-out request's slots and drop their queued saves
        (it finished, was aborted, or will recompute). Returns the count."""
        slots = self._swapped.pop(request_id, ())
        for slot in slots:
            self._saves.pop(slot, None)
        self._free_slots.extend(slots)
        return len(slots)

    def num_swapped_blocks(self, request_id: str) -> int:
        return len(self._swapped.get(request_id, ()))

    def swapped_request_ids(self) -> tuple[str, ...]:
        return tuple(self._swapped)

    # -- one step -----------------------------------------------------------

    def take_transfers(self) -> KvTransfers:
        """This step's copies (for its ExecuteBatch); resets the queue."""
        # Slots swapped in this step: their loads are in what is taken now.
        self._free_slots.extend(self._releasing)
        self._releasing.clear()
        disk_ops = None if self.disk is None or not self.disk.has_ops else self.disk.take_ops()
        if not self._saves and not self._loads and disk_ops is None:
            self._reserved.clear()
            return NO_TRANSFERS
        transfers = KvTransfers(
            save_block_ids=_int32(self._saves.values()),
            save_host_slots=_int32(self._saves.keys()),
            load_host_slots=_int32(self._loads.values()),
            load_block_ids=_int32(self._loads.keys()),
        )
        if disk_ops is not None:
            # WHY first in the step: a WRITE reads a slot this step's saves may reuse.
            transfers = attrs.evolve(transfers, disk_ops=disk_ops[0], disk_host_slots=disk_ops[1],
                                     disk_hashes=disk_ops[2])
        self.num_saved_blocks += len(self._saves)
        self.num_loaded_blocks += len(self._loads)
        self._saves.clear()
        self._loads.clear()
        self._reserved.clear()
        return transfers

    def _take_slot(self) -> HostSlot | None:
        return self._free_slots.pop() if self._free_slots else self._evict_one()

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
            # WHY: a block saved into this slot in this very step is not in host
            # memory yet: its copy is cancelled (the slot is reused), and the
            # disk tier writes it from the device block it was to be saved from.
            pending_save = self._saves.pop(candidate, None)
            if self.disk is not None:
                self.disk.spill(candidate, victim, device_block=pending_save)
            slot = candidate
            break
        for key in skipped:
            self._policy.insert(key)
        return slot

"""The KV tier manager: the host and disk tiers as one component of the scheduler.

Role: everything the scheduler core needs from the tiers under the device
cache, behind one small interface (`KvTiers`), handed to the core when it is
built (`build_kv_tiers`). With no tier configured the core gets `NO_KV_TIERS`,
a null object (as `DisabledPrefixIndex` is for prefix caching), so the core
has no "is there a tier" checks.

    Scheduler core ──┬── BlockPool ──lower tier──> HostTier ──spills──> DiskTier
                     └── KvTierManager (this module)
                           owns: the HostTier (and its DiskTier), requests in
                           LOADING, who each disk read is for, pinned blocks,
                           the tier resets and the tier stats

What it owns and why here:

- LOADING. A waiting request whose prefix continues on disk past its device
  and host hits (`start_loading`) leaves the queue and holds no device block
  while the executor reads those blocks into host slots in the background.
  Once every read is back (`step_done`, from a BatchResult) the request is
  handed back to the core, which queues it again at the front; its prefix
  then hits in the host tier. Once per request: a block evicted from the host
  again before the request runs cannot send it back to LOADING forever.
- Pins. A loading request's host hits and its fetched blocks are pinned (in
  no eviction policy) until it is admitted (`admitted`) or leaves
  (`dropped`): in a small host tier its own fetches would evict them.
- Transfers. The copies the tiers queue while a step is planned are taken
  once per step (`take_transfers`) into the step's `KvTransfers`; with only
  loading requests left (`must_transfer`), transfer-only batches carry the
  disk operations and bring the completions back.

The byte stores live in the executor (executor/kv_stores.py), which applies
each KvTransfers in one function. Pure synchronous code: no trio, no zmq,
no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import attrs

from trillium.actors.kv_tiers.block_pool import BlockHash, BlockPool, LowerTier, PrefixHit
from trillium.actors.kv_tiers.disk import DiskTier, rank_root
from trillium.actors.kv_tiers.host import HostTier
from trillium.actors.protocol.execute import NO_TRANSFERS, BatchResult, KvTransfers
from trillium.actors.protocol.outputs import KvTierStats
from trillium.actors.scheduler.request import RequestStatus


class TieredRequest(Protocol):
    """What the manager reads of a scheduler request (scheduler/request.py)."""

    request_id: str
    arrival_seq: int
    block_hashes: list[BlockHash]
    status: RequestStatus

    @property
    def num_tokens(self) -> int: ...

    @property
    def reads_prefix_cache(self) -> bool: ...

    def set_status(self, status: RequestStatus) -> None: ...


class LoadEvents(Protocol):
    """scheduler/metrics.py StepEvents, as far as the tiers report to it."""

    def kv_load(self, tier: str, seconds: float) -> None: ...


class KvTiers(Protocol):
    """What the scheduler core asks of its KV tiers."""

    @property
    def lower_tier(self) -> LowerTier | None:
        """The BlockPool's lower tier (the host tier), None without one."""

    @property
    def host(self) -> HostTier | None:
        """The host tier (swap preemption keeps KV there), None without one."""

    @property
    def num_loading(self) -> int: ...

    def loading_requests(self) -> tuple: ...

    def start_loading(self, request, hit: PrefixHit, now: float) -> bool:
        """Move a waiting request to LOADING if its prefix continues on disk."""

    def must_transfer(self) -> bool:
        """Nothing may run, but a transfer-only batch has work to carry."""

    def take_transfers(self) -> KvTransfers: ...

    def step_done(self, result: BatchResult, now: float, events: LoadEvents) -> list:
        """A step's result: loading requests now ready, in arrival order."""

    def admitted(self, request) -> None: ...

    def dropped(self, request) -> None: ...

    def reset(self, *, keep_disk: bool = False, weight_version: str | None = None) -> int: ...

    def reset_disk(self, weight_version: str | None = None) -> int: ...

    def reset_host(self) -> None: ...

    def stats(self, pool: BlockPool) -> dict: ...


class NoKvTiers:
    """No tier under the device cache: nothing loads, moves or is reported."""

    lower_tier = None
    host = None
    num_loading = 0

    def loading_requests(self) -> tuple:
        return ()

    def start_loading(self, request, hit: PrefixHit, now: float) -> bool:
        return False

    def must_transfer(self) -> bool:
        return False

    def take_transfers(self) -> KvTransfers:
        return NO_TRANSFERS

    def step_done(self, result: BatchResult, now: float, events: LoadEvents) -> list:
        return []

    def admitted(self, request) -> None:
        return None

    def dropped(self, request) -> None:
        return None

    def reset(self, *, keep_disk: bool = False, weight_version: str | None = None) -> int:
        return 0

    def reset_disk(self, weight_version: str | None = None) -> int:
        return 0

    def reset_host(self) -> None:
        return None

    def stats(self, pool: BlockPool) -> dict:
        return {}  # WHY empty: no tier stats at all, so the api exports no tier series


NO_KV_TIERS = NoKvTiers()


@attrs.define
class _Loading:
    """A request in LOADING: its reads still out, and where it goes back to."""

    request: TieredRequest
    num_pending: int
    since: float
    status_before: RequestStatus  # WAITING or PREEMPTED: where it goes back to


class KvTierManager:
    """The host tier (and the disk tier under it) for one scheduler core."""

    def __init__(self, host: HostTier, block_size: int = 16) -> None:
        self.host = host
        self.disk: DiskTier | None = host.disk
        self.block_size = block_size
        self._loading: dict[str, _Loading] = {}
        self._fetch_owner: dict[int, str] = {}  # host slot being filled -> request id
        self._fetched_once: set[str] = set()  # requests that went through LOADING
        self._pinned: dict[str, list[BlockHash]] = {}  # kept in the host tier until the request runs

    @property
    def lower_tier(self) -> HostTier:
        return self.host

    # -- LOADING ------------------------------------------------------------

    @property
    def num_loading(self) -> int:
        return len(self._loading)

    def loading_requests(self) -> tuple:
        return tuple(entry.request for entry in self._loading.values())

    def start_loading(self, request, hit: PrefixHit, now: float) -> bool:
        """If the request's prefix continues on disk past its device and host
        hits (`hit`), start reading those blocks into host slots and move it
        to LOADING. Once per request: the second time it is admitted as is."""
        if self.disk is None or request.request_id in self._fetched_once or not request.reads_prefix_cache:
            return False
        max_blocks = (request.num_tokens - 1) // self.block_size
        rest = request.block_hashes[hit.num_computed_tokens // self.block_size : max_blocks]
        num = self.disk.match_prefix(rest)
        if not num:
            return False
        self._fetched_once.add(request.request_id)
        first = len(hit.block_ids)
        host_hits = request.block_hashes[first : first + len(hit.lower_slots)]
        self.host.pin(host_hits)  # WHY: in a small host tier its own fetches would evict them
        self._pinned.setdefault(request.request_id, []).extend(host_hits)
        slots = self.host.start_fetch(rest[:num])
        if not slots:
            self._unpin(request.request_id)
            return False
        for slot in slots:
            self._fetch_owner[slot] = request.request_id
        self._loading[request.request_id] = _Loading(request, len(slots), now, request.status)
        request.set_status(RequestStatus.LOADING)
        return True

    def must_transfer(self) -> bool:
        """Disk reads are in flight or disk operations are queued."""
        return self.disk is not None and (self.host.num_fetching > 0 or self.disk.has_ops)

    def step_done(self, result: BatchResult, now: float, events: LoadEvents) -> list:
        """Record the step's host load time; disk reads that came back join
        the host tier, and a request whose reads are all back is returned
        (in arrival order) for the core to queue again, at the front."""
        if result.kv_host_load_s:
            events.kv_load("host", result.kv_host_load_s)
        done = [(int(s), True) for s in result.kv_fetched_host_slots]
        done += [(int(s), False) for s in result.kv_fetch_failed_host_slots]
        ready = []
        for slot, ok in done:
            entry = self._loading.get(self._fetch_owner.pop(slot, ""))
            # WHY pin: in a small host tier other fetches could evict it before its request runs.
            block_hash = self.host.fetch_done(slot, ok, pin=entry is not None)
            if entry is None:
                continue  # aborted or finished while loading
            request = entry.request
            if ok and block_hash is not None:
                self._pinned.setdefault(request.request_id, []).append(block_hash)
            entry.num_pending -= 1
            if entry.num_pending == 0:
                del self._loading[request.request_id]
                request.set_status(entry.status_before)
                events.kv_load("disk", now - entry.since)
                ready.append(request)
        ready.sort(key=lambda r: r.arrival_seq)
        return ready

    def admitted(self, request) -> None:
        """Its host hits are reserved now (or it was a miss after all)."""
        self._unpin(request.request_id)

    def dropped(self, request) -> None:
        """The request finished or was aborted; its reads still land in the host tier."""
        self._loading.pop(request.request_id, None)
        self._fetched_once.discard(request.request_id)
        self._unpin(request.request_id)

    def _unpin(self, request_id: str) -> None:
        pinned = self._pinned.pop(request_id, None)
        if pinned:
            self.host.unpin(pinned)

    def pinned_hashes(self, request_id: str) -> Sequence[BlockHash]:
        return tuple(self._pinned.get(request_id, ()))

    # -- one step -------------------------------------------------------------

    def take_transfers(self) -> KvTransfers:
        return self.host.take_transfers()

    # -- resets -----------------------------------------------------------------

    def reset(self, *, keep_disk: bool = False, weight_version: str | None = None) -> int:
        """Forget the host tier's blocks, and the disk tier's files unless
        `keep_disk` (new weights also move the disk tier to `weight_version`'s
        directory). Returns the number of entries dropped."""
        dropped = self.host.reset()
        if not keep_disk:
            dropped += self.reset_disk(weight_version)
        return dropped

    def reset_disk(self, weight_version: str | None = None) -> int:
        return 0 if self.disk is None else self.disk.reset(weight_version)

    def reset_host(self) -> None:
        self.host.reset()

    # -- stats ------------------------------------------------------------------

    def stats(self, pool: BlockPool) -> dict:
        """The SchedulerStats fields of the device, host and (if any) disk tiers."""
        host, disk = self.host, self.disk
        tiers = (
            KvTierStats("device", pool.usage, pool.num_blocks, pool.num_hit_blocks, pool.num_evicted_blocks),
            KvTierStats("host", host.usage, host.num_total_blocks, host.num_hit_blocks, host.num_evicted_blocks),
        )
        fields = dict(kv_tiers=tiers, kv_bytes_to_host_total=host.bytes_to_host,
                      kv_bytes_to_device_total=host.bytes_to_device)
        if disk is None:
            return fields
        return dict(
            fields,
            kv_tiers=(*tiers, KvTierStats("disk", disk.usage, disk.num_total_blocks, disk.num_hit_blocks,
                                          disk.num_evicted_blocks)),
            kv_bytes_to_disk_total=disk.bytes_written,
            kv_bytes_from_disk_total=disk.bytes_read,
            kv_disk_failed_reads_total=disk.num_failed_reads,
        )


def build_kv_tiers(engine) -> KvTiers:
    """The tiers an `EngineConfig` (resolved) asks for; NO_KV_TIERS when none."""
    tiers = engine.kv_tiers
    if not tiers.num_host_blocks:
        return NO_KV_TIERS
    disk = None
    if tiers.disk_path:
        # WHY rank 0's directory under TP: every rank writes the same blocks (its shard of each);
        # a block missing on another rank fails that rank's read, which fails the block for all.
        disk = DiskTier(rank_root(tiers.disk_path, engine.tensor_parallel_size, 0), tiers.disk_model_fingerprint, tiers.num_disk_blocks,
                        tiers.eviction_policy, engine.kv_block_bytes)
    host = HostTier(tiers.num_host_blocks, tiers.eviction_policy, engine.kv_block_bytes, disk=disk)
    return KvTierManager(host, engine.block_size)

"""The executor's KV tier stores, and the one place a step's KV copies run.

Role: the executor side of the KV tier manager (actors/kv_tiers/manager.py).
`KvStores` owns the host tier's memory (host_kv.py, when --kv-host-bytes is
set) and the disk tier's files (disk_kv.py, when --kv-disk-path is set), and
`apply` carries out one `KvTransfers` (protocol/execute.py) against the
device cache, in the order that message documents:

    1. disk ops   (WRITEs copy host slots out before a save can reuse them)
    2. saves      device block -> host slot
    3. loads      host slot -> device block

Both an `ExecuteBatch` (at the start of the step, before the forward writes
anything) and a forwarded `Sleep` (before the cache is freed) go through
`apply`, so the order is written once. With no tier configured both stores
are None and every call is a no-op on an empty `KvTransfers`; a non-empty
one names the missing store in its error.
"""

from __future__ import annotations

import json

import numpy as np

from trillium.actors.protocol.execute import KvTransfers
from trillium.actors.kv_tiers.disk import DiskOp


class KvStores:
    def __init__(self, host=None, disk=None, tp=None) -> None:
        self.host = host  # executor/host_kv.py HostKvStore
        self.disk = disk  # executor/disk_kv.py DiskKvStore (over `host`)
        self.votes = None if disk is None or tp is None or tp.size == 1 else ReadVotes(tp)

    @classmethod
    def build(cls, config, kv_caches, device, tp=None) -> "KvStores":
        """The stores an EngineConfig asks for (`config.kv_tiers`)."""
        tiers = config.kv_tiers
        if not tiers.num_host_blocks:
            return cls()
        from trillium.actors.executor.host_kv import HostKvStore

        host = HostKvStore(kv_caches, config.num_blocks, tiers.num_host_blocks, config.block_size, device)
        if not tiers.disk_path:
            return cls(host)
        from trillium.actors.executor.disk_kv import DiskKvStore
        from trillium.actors.kv_tiers.disk import rank_root, version_directory

        size, rank = (1, 0) if tp is None else (tp.size, tp.rank)
        root = rank_root(tiers.disk_path, size, rank)
        roots = None if size == 1 else (rank_root(tiers.disk_path, size, 0), root)
        disk = DiskKvStore(host, version_directory(root, tiers.disk_model_fingerprint, "0"), roots)
        return cls(host, disk, tp)

    def apply(self, kv_caches, transfers: KvTransfers) -> float:
        """Run one step's copies (module docstring order); the seconds the
        host -> device loads took (0.0: none)."""
        if len(transfers.disk_ops):
            if self.votes is not None:
                self.votes.issued += int(np.count_nonzero(transfers.disk_ops == DiskOp.READ))
            self._need(self.disk, "disk").apply(kv_caches, transfers.disk_ops, transfers.disk_host_slots,
                                                transfers.disk_hashes)
        if len(transfers.save_block_ids) or len(transfers.load_block_ids):
            return self._need(self.host, "host").apply(kv_caches, transfers)
        return 0.0

    def completions(self, wait_s: float = 0.0) -> dict:
        """Disk reads finished since the last call, as BatchResult fields
        (waiting up to `wait_s` for one); {} when none is in flight."""
        if self.votes is not None:
            if not self.votes.issued:  # INVARIANT: the same on every rank (the same ops reach them all)
                return {}
            good, failed = self.votes.vote(*self.disk.completions(wait_s))
            return dict(kv_fetched_host_slots=good, kv_fetch_failed_host_slots=failed) if len(good) + len(
                failed) else {}
        if self.disk is None or not self.disk.num_in_flight:
            return {}
        good, failed = self.disk.completions(wait_s)
        return dict(kv_fetched_host_slots=good, kv_fetch_failed_host_slots=failed)

    def close(self) -> None:
        """Finish the disk tier's queued writes (a restart reads them)."""
        if self.disk is not None:
            self.disk.close()

    @staticmethod
    def _need(store, name: str):
        if store is None:
            raise RuntimeError(f"KV transfers for the {name} tier, but none is configured")
        return store


class ReadVotes:
    """Under TP: a disk read is done when every rank's read of it is (each rank reads its shard).

    Every rank calls `vote` in the same steps (while `issued` reads are unreported, a
    count that is the same on every rank) with the reads its own I/O thread finished;
    one all-gather on the step group (JSON, no pickle) gives every rank every rank's, and
    a slot is reported, by every rank alike, once all ranks finished it: good when every
    rank's read was, failed when any rank's failed (that rank's file was bad or missing).
    """

    def __init__(self, tp) -> None:
        self.tp = tp
        self.issued = 0  # READs not yet reported (every rank's count)
        self._finished = [dict() for _ in range(tp.size)]  # per rank: host slot -> ok

    def vote(self, good: np.ndarray, failed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        mine = [[int(s), True] for s in good] + [[int(s), False] for s in failed]
        for rank, blob in enumerate(self.tp.all_gather_blobs(json.dumps(mine).encode())):
            self._finished[rank].update((slot, ok) for slot, ok in json.loads(blob))
        done = set(self._finished[0]).intersection(*self._finished[1:])
        outcome = {slot: all([finished.pop(slot) for finished in self._finished]) for slot in sorted(done)}
        self.issued -= len(outcome)
        return (np.fromiter((s for s, ok in outcome.items() if ok), np.int32),
                np.fromiter((s for s, ok in outcome.items() if not ok), np.int32))

"""Disk KV tier: the scheduler's index of KV blocks kept as files on local disk.

Role: the third level of the prefix cache, under the host tier. Blocks the
host tier evicts spill here (write-back: only what leaves host memory is
written), and a prefix lookup that runs past the device and host hits keeps
walking this index. A disk hit is not loaded inside a step: the request
goes to the `loading` state while the executor's I/O thread reads its
files into host slots, other requests keep stepping, and once every read
has come back the request is queued again and its blocks hit in the host
tier (see `HostTier.start_fetch` / `fetch_done` and scheduler/core.py).

The executor owns the files (executor/disk_kv.py): one file per block,
named by the block's chained hash, with a header holding the payload's
SHA-256 and the cache layout (shapes, dtypes, fp8 scales). A corrupt,
truncated or foreign file fails its read; the request then recomputes
those tokens and the file is deleted. The scheduler never opens a file:
it lists the directory once at start (so blocks written by an earlier run
of the same model hit after a restart) and queues ordered operations for
the executor, carried in the next `ExecuteBatch`:

    WRITE  host slot -> file of hash   (a host eviction; the slot's bytes are copied in the step)
    WRITE_DEVICE  device block -> file (a host eviction of a block whose save to the host
                                        was queued in the same step: it is not in the slot yet)
    READ   file of hash -> host slot   (a fetch; completes asynchronously)
    DELETE file of hash                (a disk eviction)
    CLEAR  every file; then use the directory named by `hash` (weights changed)

Directory: <kv-disk-path>/<model fingerprint>/<weight version digest>/; the
model fingerprint (config.resolve) covers the checkpoint files, dtypes and
block size, so a file is only ever read by an engine that computes the same
KV. Pure synchronous code apart from that one listing: no trio, no torch.
"""

from __future__ import annotations

import enum
import hashlib
import os
from collections.abc import Sequence

import numpy as np

from trillium.actors.kv_tiers.block_pool import BlockHash
from trillium.actors.kv_tiers.policies import make_policy

FILE_SUFFIX = ".kv"


class DiskOp(enum.IntEnum):
    WRITE = 0
    READ = 1
    DELETE = 2
    CLEAR = 3
    WRITE_DEVICE = 4


_CHECKPOINT_SUFFIXES = (".safetensors", ".gguf", ".json", ".bin")


def model_fingerprint(model: str, *, dtype: str, kv_cache_dtype: str, block_size: int) -> str:
    """A digest of what the KV of a block depends on besides its tokens: the
    checkpoint (config and weight files by name, size and mtime: no hashing
    of gigabytes at start), the compute and cache dtypes and the block size."""
    h = hashlib.sha256(f"{dtype}|{kv_cache_dtype}|{block_size}".encode())
    path = os.path.abspath(model)
    files = [path] if os.path.isfile(path) else sorted(
        os.path.join(path, name) for name in os.listdir(path) if name.endswith(_CHECKPOINT_SUFFIXES)
    )
    for name in files:
        st = os.stat(name)
        h.update(f"|{os.path.basename(name)}:{st.st_size}:{st.st_mtime_ns}".encode())
        if name.endswith("config.json"):
            with open(name, "rb") as f:
                h.update(f.read())
    return h.hexdigest()[:32]


def rank_root(root: str, tp_size: int, tp_rank: int) -> str:
    """Where one tensor-parallel rank keeps its shard's block files: `root` itself
    with one rank, `<root>/rank<r>` under TP (the scheduler indexes rank 0's)."""
    return root if tp_size == 1 else os.path.join(root, f"rank{tp_rank}")


def version_directory(root: str, model_fingerprint: str, weight_version: str) -> str:
    """Where the blocks of one model at one weight version live."""
    digest = hashlib.sha256(weight_version.encode()).hexdigest()[:16]
    return os.path.join(root, model_fingerprint, f"w-{digest}")


def block_file(directory: str, block_hash: BlockHash) -> str:
    return os.path.join(directory, block_hash.hex() + FILE_SUFFIX)


def existing_blocks(directory: str) -> list[BlockHash]:
    """Hashes of the block files in `directory`, oldest first (by mtime).

    Only names are checked here; a file's content is verified when read.
    """
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return []
    found = []
    for entry in entries:
        name = entry.name
        if not name.endswith(FILE_SUFFIX) or not entry.is_file():
            continue
        try:
            block_hash = BlockHash(bytes.fromhex(name[: -len(FILE_SUFFIX)]))
            found.append((entry.stat().st_mtime_ns, block_hash))
        except (ValueError, OSError):
            continue  # not one of ours, or gone meanwhile
    found.sort()
    return [block_hash for _, block_hash in found]


class DiskTier:
    """Up to `num_blocks` block files keyed by hash, with an eviction policy."""

    name = "disk"

    def __init__(self, root: str, model_fingerprint: str, num_blocks: int, policy: str = "lru",
                 block_bytes: int = 0, weight_version: str = "0",
                 existing: Sequence[BlockHash] | None = None) -> None:
        """`existing`: the blocks already on disk, oldest first (default: list the directory)."""
        if num_blocks < 1:
            raise ValueError(f"a disk tier needs room for at least one block, got {num_blocks}")
        self.root = root
        self.model_fingerprint = model_fingerprint
        self.directory = version_directory(root, model_fingerprint, weight_version)
        if existing is None:
            existing = existing_blocks(self.directory)
        self.num_total_blocks = num_blocks
        self.block_bytes = block_bytes
        self._policy_name = policy
        self._policy = make_policy(policy, num_blocks)
        self._ops: list[tuple[DiskOp, int, bytes]] = []
        self.num_hit_blocks = 0
        self.num_evicted_blocks = 0
        self.num_written_blocks = 0
        self.num_read_blocks = 0
        self.num_failed_reads = 0
        for block_hash in existing:  # oldest first: the newest survive a smaller budget
            self._add(block_hash)
        self.num_restored_blocks = len(self._policy)

    @property
    def num_used_blocks(self) -> int:
        return len(self._policy)

    @property
    def num_free_blocks(self) -> int:
        return self.num_total_blocks - len(self._policy)

    @property
    def usage(self) -> float:
        return len(self._policy) / self.num_total_blocks

    @property
    def bytes_written(self) -> int:
        return self.num_written_blocks * self.block_bytes

    @property
    def bytes_read(self) -> int:
        return self.num_read_blocks * self.block_bytes

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._policy

    def match_prefix(self, block_hashes: Sequence[BlockHash]) -> int:
        num = 0
        for block_hash in block_hashes:
            if block_hash not in self._policy:
                break
            num += 1
        return num

    # -- what the host tier and the scheduler report ----------------------

    def spill(self, slot: int, block_hash: BlockHash, *, device_block: int | None = None) -> None:
        """The host tier evicts `slot` (holding `block_hash`): write it out,
        unless a file already holds it (copy semantics, like the host).
        `device_block`: the block's save into the slot was queued in this
        step, so its KV is read from that device block instead."""
        if block_hash in self._policy:
            return
        self._add(block_hash)
        if device_block is None:
            self._ops.append((DiskOp.WRITE, slot, block_hash))
        else:
            self._ops.append((DiskOp.WRITE_DEVICE, device_block, block_hash))
        self.num_written_blocks += 1

    def fetch(self, block_hash: BlockHash, slot: int) -> None:
        """Queue the read of a held block into a host slot (a hit)."""
        self._policy.touch(block_hash)
        self._ops.append((DiskOp.READ, slot, block_hash))
        self.num_hit_blocks += 1

    def fetched(self, ok: bool) -> None:
        if ok:
            self.num_read_blocks += 1
        else:
            self.num_failed_reads += 1

    def drop(self, block_hash: BlockHash) -> None:
        """A read failed (corrupt, truncated, foreign): forget the block so no
        lookup finds it again, and delete its file on every rank."""
        # WHY a DELETE although the failing executor removed its file: under TP
        # the other ranks' copies were good, and a restart would index rank 0's
        # copy again only to fail the same read once more.
        self._policy.remove(block_hash)
        self._ops.append((DiskOp.DELETE, -1, block_hash))

    def reset(self, weight_version: str | None = None) -> int:
        """Forget and delete every block; with a new `weight_version` (the
        weights changed) later blocks go to its directory, so a restart (which
        loads the checkpoint again) never reads them. Returns the blocks dropped."""
        num = len(self._policy)
        self._policy = make_policy(self._policy_name, self.num_total_blocks)
        if weight_version is not None:
            self.directory = version_directory(self.root, self.model_fingerprint, weight_version)
        self._ops.append((DiskOp.CLEAR, -1, self.directory.encode()))
        return num

    def take_ops(self) -> tuple[np.ndarray, np.ndarray, tuple[bytes, ...]]:
        """This step's operations, in order: (op codes int8, host slots int32, hashes)."""
        if not self._ops:
            return _NO_OPS
        ops, self._ops = self._ops, []
        return (np.fromiter((op for op, _, _ in ops), np.int8, len(ops)),
                np.fromiter((slot for _, slot, _ in ops), np.int32, len(ops)),
                tuple(h for _, _, h in ops))

    @property
    def has_ops(self) -> bool:
        return bool(self._ops)

    def _add(self, block_hash: BlockHash) -> None:
        if len(self._policy) >= self.num_total_blocks:
            victim = self._policy.victim(block_hash)
            if victim is not None:
                self._ops.append((DiskOp.DELETE, -1, victim))
                self.num_evicted_blocks += 1
        self._policy.insert(block_hash)


_NO_OPS = (np.zeros(0, np.int8), np.zeros(0, np.int32), ())

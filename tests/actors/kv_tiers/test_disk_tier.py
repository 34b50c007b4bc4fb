"""Unit tests of the disk KV tier's index and of the scheduler driving it
(LOADING requests, asynchronous reads) against a simulated executor.

The simulated executor is support/fake_executor.py's TieredFakeExecutor (a fingerprint of every
token in each computed KV slot, whole context re-read every step) plus a
simulated disk: WRITEs copy the host slot when the batch arrives, and one
FIFO "I/O thread" runs the jobs a few at a time across later steps, so
reads complete out of step with the scheduling. Any block loaded from the
wrong place changes the output or fails an assertion.
"""

from __future__ import annotations

import os
import random

import numpy as np
import pytest

from support.fake_executor import TieredFakeExecutor, reference
from support.scheduler_harness import Harness, run_conversations
from trillium.actors.kv_tiers.block_pool import hash_block_tokens
from trillium.actors.kv_tiers.disk import (
    DiskOp,
    DiskTier,
    block_file,
    existing_blocks,
    model_fingerprint,
    version_directory,
)
from trillium.actors.kv_tiers.host import HostTier
from trillium.actors.kv_tiers.manager import KvTierManager
from trillium.actors.protocol.execute import BatchResult
from trillium.actors.scheduler.core import Scheduler
from trillium.actors.scheduler.request import RequestStatus


def h(i: int):
    return hash_block_tokens(None, [i], 0)


def disk_tier(num_blocks: int = 4, existing=(), policy: str = "lru") -> DiskTier:
    return DiskTier("/nonexistent-root", "fp", num_blocks, policy, block_bytes=10, existing=existing)


def ops(tier: DiskTier) -> list[tuple[str, int, bytes]]:
    codes, slots, hashes = tier.take_ops()
    assert codes.dtype == np.int8 and slots.dtype == np.int32
    return [(DiskOp(c).name, s, x) for c, s, x in zip(codes.tolist(), slots.tolist(), hashes)]


# -- the index ------------------------------------------------------------------


def test_spills_are_written_once_and_a_full_tier_deletes_its_victim():
    tier = disk_tier(2)
    tier.spill(5, h(1))
    tier.spill(6, h(2))
    tier.spill(7, h(1))  # already on disk: copy semantics, no second write
    tier.spill(8, h(3))  # full: the least recently used (h1) goes
    assert ops(tier) == [("WRITE", 5, h(1)), ("WRITE", 6, h(2)), ("DELETE", -1, h(1)), ("WRITE", 8, h(3))]
    assert h(1) not in tier and tier.num_used_blocks == 2 and tier.usage == 1.0
    assert tier.num_evicted_blocks == 1 and tier.bytes_written == 30
    assert ops(tier) == []  # handed over


def test_fetch_counts_a_hit_and_a_failed_read_forgets_the_block():
    tier = disk_tier(4, existing=[h(1), h(2), h(3)])
    assert tier.match_prefix([h(1), h(2), h(9), h(3)]) == 2
    tier.fetch(h(2), 0)
    assert ops(tier) == [("READ", 0, h(2))] and tier.num_hit_blocks == 1
    tier.fetched(True)
    tier.fetched(False)
    ops(tier)
    tier.drop(h(3))
    assert h(3) not in tier and tier.num_read_blocks == 1 and tier.num_failed_reads == 1
    assert ops(tier) == [("DELETE", -1, h(3))]  # every rank deletes its copy, not just the failing one


def test_restored_blocks_beyond_the_budget_are_deleted_oldest_first():
    tier = disk_tier(2, existing=[h(1), h(2), h(3)])  # oldest first
    assert h(1) not in tier and h(2) in tier and h(3) in tier and tier.num_restored_blocks == 2
    assert ops(tier) == [("DELETE", -1, h(1))]


def test_reset_clears_and_new_weights_move_to_another_directory():
    tier = DiskTier("/root", "fp", 4, existing=[h(1)])
    first = tier.directory
    assert first == version_directory("/root", "fp", "0")
    assert tier.reset() == 1 and h(1) not in tier
    assert ops(tier) == [("CLEAR", -1, first.encode())]
    tier.reset("v2")
    assert tier.directory != first and ops(tier) == [("CLEAR", -1, tier.directory.encode())]


def test_existing_blocks_lists_block_files_by_age(tmp_path):
    for i, name in enumerate([h(2).hex() + ".kv", h(1).hex() + ".kv", "notes.txt", "zz.kv", h(3).hex() + ".kv.1.tmp"]):
        path = tmp_path / name
        path.write_bytes(b"x")
        os.utime(path, ns=(10**9 * (i + 1), 10**9 * (i + 1)))
    assert existing_blocks(str(tmp_path)) == [h(2), h(1)]
    assert existing_blocks(str(tmp_path / "missing")) == []
    assert block_file(str(tmp_path), h(1)) == str(tmp_path / (h(1).hex() + ".kv"))


def test_model_fingerprint_covers_checkpoint_files_dtypes_and_block_size(tmp_path):
    (tmp_path / "config.json").write_text('{"a": 1}')
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    base = dict(dtype="float32", kv_cache_dtype="float32", block_size=16)
    fp = model_fingerprint(str(tmp_path), **base)
    assert fp == model_fingerprint(str(tmp_path), **base)
    assert fp != model_fingerprint(str(tmp_path), **{**base, "kv_cache_dtype": "fp8_e4m3"})
    assert fp != model_fingerprint(str(tmp_path), **{**base, "block_size": 32})
    (tmp_path / "model.safetensors").write_bytes(b"other weights")
    assert fp != model_fingerprint(str(tmp_path), **base)


# -- the host tier over it ----------------------------------------------------------


def test_host_evictions_spill_to_disk_from_the_slot_or_from_the_device_block():
    disk = disk_tier(8)
    host = HostTier(2, disk=disk)
    host.evicted(10, h(1))
    host.evicted(11, h(2))
    host.take_transfers()
    host.evicted(12, h(3))  # evicts h1 (saved in an earlier step): written to disk
    t = host.take_transfers()
    assert [DiskOp(c).name for c in t.disk_ops] == ["WRITE"] and t.disk_hashes == (h(1),)
    assert t.disk_host_slots.tolist() == [0] and t.save_host_slots.tolist() == [0]
    # One slot: h4 takes it, then h5 takes it from h4 in the same step. h4 never
    # reached host memory: its save is cancelled and it is written from device block 13.
    disk = disk_tier(8)
    host = HostTier(1, disk=disk)
    host.evicted(13, h(4))
    host.evicted(14, h(5))
    t = host.take_transfers()
    assert [DiskOp(c).name for c in t.disk_ops] == ["WRITE_DEVICE"] and t.disk_host_slots.tolist() == [13]
    assert h(4) in disk and h(4) not in host and h(5) in host
    assert t.save_block_ids.tolist() == [14] and t.save_host_slots.tolist() == [0]


def test_fetched_blocks_join_the_host_pinned_until_their_request_runs():
    disk = disk_tier(8, existing=[h(1), h(2), h(3)])
    host = HostTier(2, disk=disk)
    slots = host.start_fetch([h(1), h(2), h(3)])
    assert slots == [0, 1] and host.num_fetching == 2  # no third slot to spare
    t = host.take_transfers()
    assert [DiskOp(c).name for c in t.disk_ops] == ["READ", "READ"] and t.disk_host_slots.tolist() == [0, 1]
    assert host.lookup([h(1)]) == ()  # not readable before its read is back
    assert host.fetch_done(0, True, pin=True) == h(1) and host.lookup([h(1), h(2)]) == (0,)
    host.fetch_done(1, False)
    assert h(2) not in disk and host.num_free_blocks == 1 and disk.num_failed_reads == 1
    host.evicted(20, h(7))  # takes the free slot
    host.evicted(21, h(8))  # full: the pinned h1 is no victim, so h7 goes
    assert h(1) in host and h(7) not in host
    host.unpin([h(1)])  # joins the policy as the most recent
    host.evicted(22, h(9))
    assert h(1) in host and h(8) not in host
    host.evicted(23, h(10))
    assert h(1) not in host  # now it is a victim like any other


def test_a_reset_during_a_read_keeps_its_slot_until_the_read_is_back():
    host = HostTier(2, disk=disk_tier(8, existing=[h(1)]))
    assert host.start_fetch([h(1)]) == [0]
    host.reset()
    host.evicted(5, h(5))
    host.evicted(6, h(6))
    assert host.num_used_blocks == 1  # slot 0 is still being written by the I/O thread
    host.fetch_done(0, True)
    assert h(1) not in host and host.num_free_blocks == 1


# -- the scheduler with a simulated disk ---------------------------------------------------


class DiskFakeExecutor(TieredFakeExecutor):
    """Host copies as the host-tier suite's, plus disk ops run by a FIFO
    "I/O thread" that advances `jobs_per_step` jobs (at random) per step."""

    def __init__(self, num_blocks, block_size, num_slots, rng, corrupt=()) -> None:
        super().__init__(num_blocks, block_size, num_slots)
        self.files: dict[bytes, list] = {}
        self.jobs: list[tuple] = []
        self.done: list[tuple[int, bool]] = []
        self.rng = rng
        self.corrupt = set(corrupt)
        self.num_transfer_only = 0

    def _run_jobs(self, count: int) -> None:
        size = self.block_size
        for _ in range(min(count, len(self.jobs))):
            job = self.jobs.pop(0)
            if job[0] == "write":
                self.files[job[1]] = job[2]
            elif job[0] == "delete":
                self.files.pop(job[1], None)
            else:
                _, block_hash, slot = job
                content = self.files.get(block_hash)
                ok = content is not None and block_hash not in self.corrupt
                if ok:
                    self.host[slot * size : (slot + 1) * size] = content
                else:
                    self.files.pop(block_hash, None)
                self.done.append((slot, ok))

    def execute(self, batch):
        size = self.block_size
        for op, slot, block_hash in zip(batch.kv.disk_ops.tolist(), batch.kv.disk_host_slots.tolist(),
                                        batch.kv.disk_hashes):
            if op == DiskOp.WRITE:
                content = self.host[slot * size : (slot + 1) * size]
                assert content[0] is not None, "wrote a slot that holds nothing"
                self.jobs.append(("write", block_hash, list(content)))
            elif op == DiskOp.WRITE_DEVICE:
                content = self.kv[slot * size : (slot + 1) * size]
                assert content[0] is not None, "wrote a device block that holds nothing"
                self.jobs.append(("write", block_hash, list(content)))
            elif op == DiskOp.READ:
                self.jobs.append(("read", block_hash, slot))
            elif op == DiskOp.DELETE:
                self.jobs.append(("delete", block_hash))
        transfer_only = not len(batch.num_scheduled_tokens)
        self.num_transfer_only += transfer_only
        result = super().execute(batch)
        self._run_jobs(max(1, len(self.jobs)) if transfer_only else self.rng.randint(0, 3))
        done, self.done = self.done, []
        return BatchResult(
            result.step_id, result.request_ids, result.sampled_token_ids,
            kv_fetched_host_slots=np.asarray([s for s, ok in done if ok], np.int32),
            kv_fetch_failed_host_slots=np.asarray([s for s, ok in done if not ok], np.int32),
        )


class DiskHarness(Harness):
    def __init__(self, num_slots: int, num_disk_blocks: int, seed: int = 0, corrupt=(), **config) -> None:
        super().__init__(**config)
        self.disk = DiskTier("/unused", "fp", num_disk_blocks, block_bytes=64, existing=())
        self.tier = HostTier(num_slots, block_bytes=64, disk=self.disk)
        self.sched = Scheduler(self.sched.config, kv_tiers=KvTierManager(self.tier, self.sched.config.block_size))
        self.sched.lora_ids.update({1, 2, 3})
        self.ex = DiskFakeExecutor(self.sched.config.num_blocks, self.sched.config.block_size, num_slots,
                                   random.Random(seed), corrupt)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_multi_turn_chats_hit_the_disk_tier_and_match_the_reference(seed):
    # 12 device blocks and 4 host slots of 4 tokens; the chats outgrow both.
    harness = DiskHarness(4, 200, seed=seed, num_blocks=12, max_num_seqs=3, max_num_batched_tokens=16)
    run_conversations(harness, 6, 5, seed=seed)  # asserts every output against the reference
    stats = harness.sched.stats()
    device, host, disk = stats.kv_tiers
    assert disk.tier == "disk" and disk.hit_blocks_total > 0 and harness.disk.num_read_blocks > 0
    assert stats.kv_bytes_to_disk_total == 64 * harness.disk.num_written_blocks > 0
    assert harness.sched.num_loading == 0 and harness.tier.num_fetching == 0


def test_corrupt_blocks_are_recomputed_and_forgotten():
    harness = DiskHarness(4, 200, seed=5, num_blocks=12, max_num_seqs=3, max_num_batched_tokens=16)
    run_conversations(harness, 6, 3, seed=5)
    harness.ex.corrupt = set(harness.ex.files)  # every file on disk now fails its check
    harness.deltas = {}  # the same request ids again
    run_conversations(harness, 6, 3, seed=5)  # the same chats again: still every output right
    assert harness.disk.num_failed_reads > 0
    assert harness.sched.stats().kv_disk_failed_reads_total == harness.disk.num_failed_reads


def disk_holds_a_prompt() -> tuple[DiskHarness, list[int]]:
    """A harness whose disk holds request "a"'s 4 blocks (pushed out of the
    16-block device and the 8-slot host by 6 other prompts)."""
    harness = DiskHarness(8, 64, num_blocks=16, max_num_seqs=4, max_num_batched_tokens=64)
    prompt = list(range(1, 18))  # 4 full blocks of 4 + 1 token
    harness.add("a", prompt, max_tokens=1)
    harness.run()
    for i in range(6):
        harness.add(f"x{i}", [100 + 20 * i + k for k in range(17)], max_tokens=1)
        harness.run()
    harness.ex._run_jobs(len(harness.ex.jobs))  # the writes land
    return harness, prompt


def test_a_loading_request_waits_while_others_step_then_hits_the_host():
    harness, prompt = disk_holds_a_prompt()
    sched, ex = harness.sched, harness.ex
    ex.rng.randint = lambda a, b: 0  # the I/O thread stalls while requests step
    again = harness.add("a2", prompt, max_tokens=1)
    other = harness.add("b", list(range(60, 70)), max_tokens=4)
    batch = harness.step()
    request = sched.get_request("a2")
    assert request.status is RequestStatus.LOADING and sched.num_loading == 1 and sched.num_waiting == 1
    assert [n.request_id for n in batch.new_requests] == ["b"]
    assert [DiskOp(c).name for c in batch.kv.disk_ops].count("READ") == 4
    harness.step()
    harness.step()  # b decodes on; a2 still loads
    assert request.status is RequestStatus.LOADING
    ex.rng.randint = lambda a, b: 10  # the reads come back
    harness.run()
    assert harness.tokens("a2") == reference(prompt, again.sampling, (), 0, 64)[0] == harness.tokens("a")
    assert harness.tokens("b") == reference(other.prompt_token_ids.tolist(), other.sampling, (), 0, 64)[0]
    stats = sched.stats()
    assert stats.prefix_cache_hits_total >= 16  # the 4 fetched blocks hit in the host
    assert [tier for tier, _ in stats.kv_load_s].count("disk") == 1  # a2's wait, in the histogram's events
    assert harness.tokens("a") == reference(prompt, again.sampling, (), 0, 64)[0]


def test_only_loading_requests_left_step_with_transfer_only_batches():
    harness, prompt = disk_holds_a_prompt()
    before = harness.ex.num_transfer_only
    msg = harness.add("a2", prompt, max_tokens=2)
    harness.run()
    assert harness.ex.num_transfer_only > before
    assert harness.tokens("a2") == reference(prompt, msg.sampling, (), 0, 64)[0]
    assert harness.sched.schedule() is None  # idle again: no empty batches


def test_an_aborted_loading_request_leaves_cleanly():
    harness, prompt = disk_holds_a_prompt()
    harness.ex.rng.randint = lambda a, b: 0
    harness.add("a2", prompt, max_tokens=1)
    harness.add("b", list(range(60, 70)), max_tokens=3)
    harness.step()
    assert harness.sched.get_request("a2").status is RequestStatus.LOADING
    harness.sched.abort(["a2"])
    assert harness.sched.num_loading == 0
    harness.ex.rng.randint = lambda a, b: 10
    harness.run()
    assert harness.final("a2")[0] == "abort" and harness.tier.num_fetching == 0
    hashes, parent = [], None
    for start in range(0, 16, 4):
        parent = hash_block_tokens(parent, prompt[start : start + 4], 0)
        hashes.append(parent)
    assert harness.tier.lookup(hashes) == harness.tier.lookup(hashes[:4]) and len(harness.tier.lookup(hashes)) == 4
    hits = harness.tier.num_hit_blocks
    harness.add("a3", prompt, max_tokens=1)  # the reads still landed: a host hit, no loading
    harness.run()
    assert harness.tier.num_hit_blocks == hits + 4 and harness.tokens("a3") == harness.tokens("a")

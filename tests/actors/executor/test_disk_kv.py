"""The disk KV tier's files on the executor side: the block file format, the
I/O thread's writes and reads through host slots, and the checks that keep a
corrupt, truncated or foreign file from ever being served."""

from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from trillium.actors.executor.disk_kv import DiskKvStore, decode_block, encode_block
from trillium.actors.executor.host_kv import HostKvStore
from trillium.actors.kv_tiers.block_pool import hash_block_tokens
from trillium.actors.kv_tiers.disk import DiskOp, block_file
from trillium.models.kv_cache import allocate_kv_caches

H1, H2 = hash_block_tokens(None, [1], 0), hash_block_tokens(None, [2], 0)


def test_block_files_round_trip_and_refuse_anything_else():
    payload = bytes(range(256)) * 4
    data = encode_block(H1, "layout-a", payload)
    assert bytes(decode_block(bytearray(data), H1, "layout-a")) == payload
    flipped = bytearray(data)
    flipped[-10] ^= 1
    for bad, block_hash, layout, why in [
        (flipped, H1, "layout-a", "digest"),
        (data[:-1], H1, "layout-a", "truncated"),
        (data, H2, "layout-a", "another block"),
        (data, H1, "layout-b", "layout"),
        (b"garbage" * 10, H1, "layout-a", "not a block file"),
        (data[:9], H1, "layout-a", "truncated header"),
    ]:
        with pytest.raises(ValueError, match=why):
            decode_block(bytearray(bad), block_hash, layout)


def ops(*items):
    return (np.asarray([op for op, _, _ in items], np.int8), np.asarray([s for _, s, _ in items], np.int32),
            tuple(x for _, _, x in items))


def wait_reads(store: DiskKvStore, num: int):
    good, failed = [], []
    while len(good) + len(failed) < num:
        g, f = store.completions(wait_s=5.0)
        good += g.tolist()
        failed += f.tolist()
    return good, failed


@pytest.fixture
def caches():
    config = SimpleNamespace(num_layers=2, num_kv_heads=2, head_dim=4)
    kv = allocate_kv_caches(config, 6, 4, torch.float32, "cpu")
    for layer in kv:
        for t in layer:
            t.copy_(torch.randn_like(t))
    return kv


def test_written_blocks_read_back_into_another_slot(caches, tmp_path):
    host = HostKvStore(caches, num_blocks=6, num_slots=4, block_size=4, device=torch.device("cpu"))
    host.save(caches, np.asarray([2, 5], np.int32), np.asarray([0, 1], np.int32))
    store = DiskKvStore(host, str(tmp_path / "w-0"))
    try:
        # Slot 1 is written from the slot, block 3 straight from the device; then both are read back.
        store.apply(caches, *ops((DiskOp.WRITE, 1, H1), (DiskOp.WRITE_DEVICE, 3, H2),
                                 (DiskOp.READ, 2, H1), (DiskOp.READ, 3, H2)))
        assert wait_reads(store, 2) == ([2, 3], [])
        for layer in range(2):
            for t, host_t in zip(caches[layer], host.host[2 * layer : 2 * layer + 2]):
                assert torch.equal(host_t[2], t[5]) and torch.equal(host_t[3], t[3])
        assert sorted(os.listdir(tmp_path / "w-0")) == sorted([H1.hex() + ".kv", H2.hex() + ".kv"])
        store.apply(caches, *ops((DiskOp.DELETE, -1, H1)))
        new_dir = str(tmp_path / "w-1")
        store.apply(caches, *ops((DiskOp.CLEAR, -1, new_dir.encode()), (DiskOp.WRITE, 0, H1)))
    finally:
        store.close()  # the queued jobs finish first
    assert os.listdir(tmp_path / "w-0") == [] and os.listdir(new_dir) == [H1.hex() + ".kv"]


def test_a_corrupt_or_missing_file_fails_its_read_and_is_deleted(caches, tmp_path):
    host = HostKvStore(caches, num_blocks=6, num_slots=4, block_size=4, device=torch.device("cpu"))
    host.save(caches, np.asarray([1], np.int32), np.asarray([0], np.int32))
    directory = str(tmp_path / "w-0")
    store = DiskKvStore(host, directory)
    try:
        store.apply(caches, *ops((DiskOp.WRITE, 0, H1), (DiskOp.WRITE, 0, H2)))
        store._io.submit(lambda: None).result()  # the writes landed
        with open(block_file(directory, H1), "r+b") as f:  # flip one payload byte
            f.seek(-3, os.SEEK_END)
            byte = f.read(1)
            f.seek(-3, os.SEEK_END)
            f.write(bytes([byte[0] ^ 0xFF]))
        with open(block_file(directory, H2), "r+b") as f:
            f.truncate(100)
        before = host.host[0][3].clone()
        store.apply(caches, *ops((DiskOp.READ, 3, H1), (DiskOp.READ, 2, H2),
                                 (DiskOp.READ, 1, hash_block_tokens(None, [9], 0))))
        good, failed = wait_reads(store, 3)
        assert good == [] and sorted(failed) == [1, 2, 3]
        # nothing was copied from the corrupt file: the same bits (the slot was never written, so its
        # bytes are whatever the allocation held, NaN patterns included, which torch.equal calls unequal)
        assert torch.equal(host.host[0][3].view(torch.int32), before.view(torch.int32))
        assert os.listdir(directory) == []
    finally:
        store.close()


def test_an_uncalibrated_fp8_cache_neither_writes_nor_reads(tmp_path):
    config = SimpleNamespace(num_layers=1, num_kv_heads=1, head_dim=4)
    kv = allocate_kv_caches(config, 4, 2, "fp8_e4m3", "cpu")
    host = HostKvStore(kv, num_blocks=4, num_slots=2, block_size=2, device=torch.device("cpu"))
    store = DiskKvStore(host, str(tmp_path / "w-0"))
    try:
        assert store.layout(kv) is None
        store.apply(kv, *ops((DiskOp.WRITE, 0, H1), (DiskOp.READ, 1, H1)))
        assert wait_reads(store, 1) == ([], [1])
        kv[0].calibrate(torch.full((2,), 100.0), torch.full((2,), 3.0))
        layout = store.layout(kv)
        assert layout is not None and "scales" in layout and store.layout(kv) is layout
    finally:
        store.close()
    assert os.listdir(tmp_path / "w-0") == []


def test_a_tensor_parallel_rank_keeps_a_new_version_under_its_own_root(caches, tmp_path):
    """Under TP the scheduler's CLEAR names rank 0's new directory; rank 1 moves to the same
    place under <kv-disk-path>/rank1 (kv_tiers/disk.py rank_root)."""
    host = HostKvStore(caches, num_blocks=6, num_slots=4, block_size=4, device=torch.device("cpu"))
    rank0, rank1 = tmp_path / "rank0", tmp_path / "rank1"
    store = DiskKvStore(host, str(rank1 / "fp" / "w-0"), roots=(str(rank0), str(rank1)))
    try:
        store.apply(caches, *ops((DiskOp.CLEAR, -1, str(rank0 / "fp" / "w-1").encode()), (DiskOp.WRITE, 0, H1)))
    finally:
        store.close()
    assert os.listdir(rank1 / "fp" / "w-1") == [H1.hex() + ".kv"] and not rank0.exists()

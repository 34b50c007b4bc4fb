"""The disk KV tier end to end: the offline API over the real actors.

- A multi-turn chat whose prefixes outgrow device + host memory but fit on
  disk: evicted prefixes come back from block files (read asynchronously
  while the request sits in LOADING) and the greedy outputs equal Hugging
  Face transformers.
- The files survive a restart of the engine on the same --kv-disk-path: the
  prompts of the first run hit the disk tier in the second. A corrupted
  block file fails its check and is deleted; the request recomputes and its
  output is unchanged.
"""

from __future__ import annotations

import os
import random

import pytest

from support.chat_turns import MAX_NEW, chat_turns
from support.oracles import hf_greedy, transformers_model
from trillium import LLM, SamplingParams
from trillium.config import EngineConfig

NUM_DEVICE_BLOCKS = 24
NUM_HOST_BLOCKS = 8


def engine(path, disk_path, num_blocks=NUM_DEVICE_BLOCKS, **extra) -> dict:
    block_bytes = EngineConfig.build(model=str(path), num_blocks=num_blocks,
                                     tensor_parallel_size=extra.get("tensor_parallel_size", 1)).resolve().kv_block_bytes
    return dict(num_blocks=num_blocks, max_num_seqs=4, max_num_batched_tokens=64,
                kv_host_bytes=f"{NUM_HOST_BLOCKS * block_bytes}B", kv_disk_path=str(disk_path),
                kv_disk_bytes=f"{256 * block_bytes}B", **extra)


def block_files(root) -> list[str]:
    return [os.path.join(d, f) for d, _, files in os.walk(root) for f in files if f.endswith(".kv")]


def test_chats_that_outgrow_host_memory_hit_the_disk_tier(checkpoint, tmp_path):
    path = checkpoint("llama")
    hf_model = transformers_model(path)
    with LLM(str(path), **engine(path, tmp_path)) as llm:
        seen = chat_turns(llm, hf_model.config.vocab_size, num_conversations=8)  # ~56 blocks in the last turn
        stats = llm.get_stats()
    for prompt, tokens in seen:
        assert tokens == hf_greedy(hf_model, prompt, MAX_NEW)[0]
    device, host, disk = stats.kv_tiers
    assert disk.tier == "disk" and disk.hit_blocks_total > 0 and host.evicted_blocks_total > 0
    assert stats.kv_bytes_from_disk_total > 0 and stats.kv_bytes_to_disk_total > 0
    assert stats.kv_disk_failed_reads_total == 0


def test_block_files_survive_a_restart_and_corrupt_ones_are_recomputed(checkpoint, tmp_path):
    path = checkpoint("llama")
    rng = random.Random(1)
    prompts = [[rng.randrange(7, 200) for _ in range(70)] for _ in range(10)]  # 4 full blocks each
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=MAX_NEW)

    def generate(llm, batch):
        return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in batch], params)]

    with LLM(str(path), **engine(path, tmp_path)) as llm:
        first = generate(llm, prompts[:2])
        generate(llm, prompts[2:])  # 40 more blocks push the first 8 through the host to disk
    assert len(block_files(tmp_path)) >= 8

    with LLM(str(path), **engine(path, tmp_path)) as llm:  # a fresh engine: device and host are empty
        again = generate(llm, prompts[:2])
        stats = llm.get_stats()
    assert again == first[:2]
    assert stats.kv_tiers[2].hit_blocks_total == 8 and stats.prefix_cache_hits_total == 8 * 16

    files = block_files(tmp_path)
    for name in files:  # flip the last payload byte of every block file
        with open(name, "r+b") as f:
            f.seek(-1, os.SEEK_END)
            last = f.read(1)
            f.seek(-1, os.SEEK_END)
            f.write(bytes([last[0] ^ 0x55]))
    with LLM(str(path), **engine(path, tmp_path)) as llm:
        recomputed = generate(llm, prompts[:2])
        stats = llm.get_stats()
    assert recomputed == first[:2]
    assert stats.kv_disk_failed_reads_total == 8 and stats.prefix_cache_hits_total == 0
    assert len(set(files) - set(block_files(tmp_path))) >= 8  # the corrupt files are gone


def test_disk_tier_under_tensor_parallelism(checkpoint, tmp_path):
    """TP=2: each rank keeps its shard's block files under <kv-disk-path>/rank<r>; a block arrives
    when both ranks' reads did, and fails for both when one rank's file is bad (LMCache likewise
    keys each TP rank's chunks apart: LMCache/LMCache, lmcache/utils.py CacheEngineKey worker_id)."""
    path = checkpoint("llama")
    rng = random.Random(2)
    prompts = [[rng.randrange(7, 200) for _ in range(70)] for _ in range(8)]  # 4 full blocks each
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=MAX_NEW)
    config = engine(path, tmp_path, num_blocks=12, tensor_parallel_size=2)  # 12 device + 8 host blocks

    def generate(llm, batch):
        return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in batch], params)]

    with LLM(str(path), **config) as llm:
        first = generate(llm, prompts[:2])
        generate(llm, prompts[2:])  # pushes the first prompts' blocks through the host to disk
    rank0, rank1 = (sorted(os.path.relpath(f, tmp_path / f"rank{r}") for f in block_files(tmp_path / f"rank{r}"))
                    for r in (0, 1))
    assert len(rank0) >= 8 and rank0 == rank1 and len(block_files(tmp_path)) == 2 * len(rank0)
    bad = min(block_files(tmp_path / "rank1"), key=os.path.getmtime)  # a block of the first prompts
    os.truncate(bad, 8)  # one block's rank-1 copy is corrupt: that block fails on both ranks
    with LLM(str(path), **config) as llm:  # a fresh engine: device and host empty
        again = generate(llm, prompts[:2])
        stats = llm.get_stats()
    assert again == first
    assert stats.kv_disk_failed_reads_total == 1 and stats.prefix_cache_hits_total >= 4 * 16, stats
    assert not os.path.exists(bad)
    good_copy = tmp_path / "rank0" / os.path.relpath(bad, tmp_path / "rank1")
    assert not os.path.exists(good_copy)  # rank 0's copy goes too: a restart must not index it again


def test_config_checks_the_disk_tier(checkpoint, tmp_path):
    path = str(checkpoint("llama"))
    with pytest.raises(ValueError, match="needs --kv-host-bytes"):
        EngineConfig.build(model=path, kv_disk_path=str(tmp_path), kv_disk_bytes="1MiB")
    with pytest.raises(ValueError, match="needs --kv-disk-bytes"):
        EngineConfig.build(model=path, kv_host_bytes="1MiB", kv_disk_path=str(tmp_path))
    with pytest.raises(ValueError, match="needs --kv-disk-path"):
        EngineConfig.build(model=path, kv_host_bytes="1MiB", kv_disk_bytes="1MiB")
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(ValueError, match="not a writable directory"):
        EngineConfig.build(model=path, kv_host_bytes="1MiB", kv_disk_path=str(tmp_path / "a-file"),
                     kv_disk_bytes="1MiB").resolve()
    config = EngineConfig.build(model=path, kv_host_bytes="1MiB", kv_disk_path=str(tmp_path), kv_disk_bytes="1MiB").resolve()
    assert config.kv_tiers.num_disk_blocks == 2**20 // config.kv_block_bytes and len(config.kv_tiers.disk_model_fingerprint) == 32
    assert EngineConfig.from_bytes(config.to_bytes()) == config
    other = EngineConfig.build(model=path, kv_host_bytes="1MiB", kv_disk_path=str(tmp_path), kv_disk_bytes="1MiB",
                         block_size=32).resolve()
    assert other.kv_tiers.disk_model_fingerprint != config.kv_tiers.disk_model_fingerprint

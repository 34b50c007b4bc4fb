"""The host KV tier end to end: the offline API over the real actors.

A multi-turn chat workload whose shared prefixes outgrow the device KV cache
but fit device + host: with the host tier, evicted prefixes come back from
host memory (host hits > 0, bytes moved both ways) and the greedy outputs
are identical to a run without tiers and to Hugging Face transformers.
"""

from __future__ import annotations

import pytest

from support.chat_turns import MAX_NEW, chat_turns
from support.oracles import hf_greedy, transformers_model
from trillium import LLM
from trillium.config import EngineConfig

NUM_DEVICE_BLOCKS = 24  # 16-token blocks; the last turn's prefixes need ~32
NUM_HOST_BLOCKS = 64


@pytest.fixture(scope="module")
def baseline(checkpoint):
    path = checkpoint("llama")
    hf_model = transformers_model(path)
    with LLM(str(path), num_blocks=NUM_DEVICE_BLOCKS, max_num_seqs=4, max_num_batched_tokens=64) as llm:
        seen = chat_turns(llm, hf_model.config.vocab_size)
        assert llm.get_stats().kv_tiers == ()  # no tier: no tier stats
    for prompt, tokens in seen:
        assert tokens == hf_greedy(hf_model, prompt, MAX_NEW)[0]
    return path, hf_model.config.vocab_size, seen


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_host_tier_hits_and_outputs_match_the_run_without_tiers(baseline, policy):
    path, vocab, expected = baseline
    block_bytes = EngineConfig.build(model=str(path), num_blocks=NUM_DEVICE_BLOCKS).resolve().kv_block_bytes
    with LLM(str(path), num_blocks=NUM_DEVICE_BLOCKS, max_num_seqs=4, max_num_batched_tokens=64,
             kv_host_bytes=f"{NUM_HOST_BLOCKS * block_bytes}B", kv_eviction_policy=policy) as llm:
        assert llm.config.kv_tiers.num_host_blocks == NUM_HOST_BLOCKS
        seen = chat_turns(llm, vocab)
        stats = llm.get_stats()
    assert seen == expected
    device, host = stats.kv_tiers
    assert device.tier == "device" and device.evicted_blocks_total > 0
    assert host.tier == "host" and host.num_blocks == NUM_HOST_BLOCKS and host.hit_blocks_total > 0
    assert stats.kv_bytes_to_host_total > 0 and stats.kv_bytes_to_device_total == host.hit_blocks_total * block_bytes


def test_config_sizes_and_checks_the_host_tier(checkpoint):
    path = str(checkpoint("llama"))
    config = EngineConfig.build(model=path, kv_host_bytes="1MiB", kv_cache_memory="1MiB").resolve()
    assert config.kv_tiers.host_bytes == 2**20 and config.kv_tiers.num_host_blocks == 2**20 // config.kv_block_bytes
    assert EngineConfig.build(model=path).resolve().kv_tiers.num_host_blocks == 0
    assert EngineConfig.from_bytes(config.to_bytes()) == config
    with pytest.raises(ValueError, match="prefix caching"):
        EngineConfig.build(model=path, kv_host_bytes=2**20, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="kv-eviction-policy"):
        EngineConfig.build(model=path, kv_host_bytes=2**20, kv_eviction_policy="mru")
    with pytest.raises(ValueError, match="holds no"):
        EngineConfig.build(model=path, kv_host_bytes=100).resolve()


def test_cli_accepts_sizes_for_the_host_tier():
    from trillium.cli import build_parser

    args = build_parser().parse_args(["generate", "--model", "m", "--kv-host-bytes", "512MiB",
                                      "--kv-eviction-policy", "arc", "hi"])
    assert args.kv_host_bytes == 512 * 2**20 and args.kv_eviction_policy == "arc"
